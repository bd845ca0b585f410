"""dist_checkpointing of model + DistributedOptimizer (fully_reshardable): save at TP2, load at
TP1xPP2, take steps: equals the uninterrupted TP2 run. Catches megatron-core 0.16.1's shared Adam
`step` tensor after load (the resumed params then differ by ~4e-3 relative). The save is a background
one (trainer.async_save) finished after the next step: a snapshot that missed a tensor would resume
from step-2 values."""

from pathlib import Path

import pytest
import torch

from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout

from test_megatron_engine import R, make_batch, pg_loss, to_hf  # noqa: E402

OPTIM = dict(lr=1e-3, adam_eps=1e-6, clip_grad=1.0, lr_schedule="cosine", warmup_steps=1)


def _worker(rank, world, port, path, ckpt):
    from megatron.core import parallel_state as mpu

    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    b1 = make_batch()
    b2 = dict(b1, advantages=-b1["advantages"].flip(0))
    norm = b1["response_mask"].sum().item()
    cfg = EngineConfig(optim=OptimConfig(**OPTIM), schedule_steps=10)

    def snapshot(eng, metrics):
        return {"params": {k: v.detach().clone() for k, v in eng.named_parameters_global()},
                "tp": mpu.get_tensor_model_parallel_rank(), "metrics": metrics}

    init_megatron(ParallelLayout(tp=2))
    eng = MegatronEngine(path, ParallelLayout(tp=2), cfg)
    eng.train_step(b1, pg_loss, norm, R, 4)
    eng.save_checkpoint(ckpt, background=True)  # a thread writes the step-1 tensors ...
    eng.train_step(b2, pg_loss, norm, R, 2)  # ... while this step changes the live ones in place
    eng.finish_save()
    straight = snapshot(eng, eng.train_step(b1, pg_loss, norm, R, 4))
    del eng

    init_megatron(ParallelLayout(pp=2))
    eng = MegatronEngine(path, ParallelLayout(pp=2), cfg)
    eng.load_checkpoint(ckpt)
    assert eng.steps == 1
    eng.train_step(b2, pg_loss, norm, R, 2)
    resumed = snapshot(eng, eng.train_step(b1, pg_loss, norm, R, 4))
    del eng

    # context parallel: saved at CP2 (both ranks hold the whole model; the distributed optimizer's state is
    # sharded over DP x CP), resumed at TP2
    cp_ckpt = f"{ckpt}_cp2"
    init_megatron(ParallelLayout(cp=2))
    eng = MegatronEngine(path, ParallelLayout(cp=2), cfg)
    eng.train_step(b1, pg_loss, norm, R, 4)
    eng.save_checkpoint(cp_ckpt)
    eng.train_step(b2, pg_loss, norm, R, 2)
    cp_straight = snapshot(eng, eng.train_step(b1, pg_loss, norm, R, 4))
    del eng
    init_megatron(ParallelLayout(tp=2))
    eng = MegatronEngine(path, ParallelLayout(tp=2), cfg)
    eng.load_checkpoint(cp_ckpt)
    eng.train_step(b2, pg_loss, norm, R, 2)
    cp_resumed = snapshot(eng, eng.train_step(b1, pg_loss, norm, R, 4))
    return straight, resumed, cp_straight, cp_resumed


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    path = str(tiny_assets["tiny-llama"])
    ckpt = tmp_path_factory.mktemp("ckpt") / "step1"
    return path, ckpt, spawn_local(_worker, 2, path, str(ckpt), timeout=600)


def test_save_tp2_load_tp1_pp2_then_step_equals_uninterrupted(runs):
    path, ckpt, res = runs
    assert (ckpt / "metadata.json").exists()
    straight = to_hf([r[0] for r in res], path, 2)
    resumed = to_hf([r[1] for r in res], path, 1)
    assert straight.keys() == resumed.keys() and len(straight) == 39
    worst = max(((straight[k] - resumed[k]).norm() / straight[k].norm()).item() for k in straight)
    print(f"max per-tensor relative error resumed vs uninterrupted: {worst:.2e}")
    assert worst <= 1e-5
    ms, mr = res[0][0]["metrics"], res[-1][1]["metrics"]
    assert abs(ms["lr"] - mr["lr"]) <= 1e-12 and ms["lr"] < OPTIM["lr"]  # cosine schedule resumed
    assert abs(ms["loss"] - mr["loss"]) <= 1e-5 * abs(ms["loss"])


def test_save_cp2_load_tp2_then_step_equals_uninterrupted(runs):
    path, _, res = runs
    straight = to_hf([res[0][2]], path, 1)  # a CP rank holds the whole model
    resumed = to_hf([r[3] for r in res], path, 2)
    worst = max(((straight[k] - resumed[k]).norm() / straight[k].norm()).item() for k in straight)
    print(f"CP2 -> TP2: max per-tensor relative error resumed vs uninterrupted: {worst:.2e}")
    assert len(straight) == 39 and worst <= 1e-5
    ms, mr = res[0][2]["metrics"], res[0][3]["metrics"]
    assert abs(ms["loss"] - mr["loss"]) <= 1e-5 * abs(ms["loss"]) and abs(ms["lr"] - mr["lr"]) <= 1e-12


# ---- a checkpoint written before the upgrade to megatron-core 0.19 (Python 3.12) -----------------------

OLD = Path(__file__).parent / "fixtures" / "mcore_0_16_1"


def _resume_old_worker(rank, world, port):
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(ParallelLayout())
    b1 = make_batch()
    b2 = dict(b1, advantages=-b1["advantages"].flip(0))
    eng = MegatronEngine(str(OLD / "model"), ParallelLayout(),
                         EngineConfig(optim=OptimConfig(**OPTIM), schedule_steps=10))
    eng.load_checkpoint(OLD / "ckpt")
    steps = eng.steps
    metrics = eng.train_step(b2, pg_loss, b1["response_mask"].sum().item(), R, 2)
    return {"params": {k: v.detach().clone() for k, v in eng.named_parameters_global()}, "tp": 0,
            "metrics": metrics, "steps": steps}


def test_checkpoint_of_megatron_core_0_16_resumes_resharded_on_this_stack():
    """tests/fixtures/mcore_0_16_1: saved at TP2 by Python 3.11 + megatron-core 0.16.1 after one step
    (with common.pt, the old format), plus the weights after the next step in that same process. Loaded
    here at TP1 (resharded) the same next step gives the same weights (a user upgrading mid-run)."""
    import json

    from safetensors.torch import load_file

    meta = json.loads((OLD / "meta.json").read_text())
    assert meta["megatron-core"] == "0.16.1" and (OLD / "ckpt" / "common.pt").is_file()
    (res,) = spawn_local(_resume_old_worker, 1, timeout=300)
    assert res["steps"] == 1
    want, got = load_file(OLD / "after_step2.safetensors"), to_hf([res], str(OLD / "model"), 1)
    assert want.keys() == got.keys() and len(want) == 21
    worst = max(((want[k] - got[k]).norm() / want[k].norm()).item() for k in want)
    print(f"0.16.1 checkpoint resumed on this stack: max per-tensor relative error after the next step {worst:.2e}")
    assert worst <= 1e-5
    m = meta["step2_metrics"]
    assert abs(res["metrics"]["lr"] - m["lr"]) <= 1e-12 and abs(res["metrics"]["loss"] - m["loss"]) <= 1e-5 * abs(m["loss"])


def test_a_megatron_core_too_old_for_a_checkpoint_is_named_in_one_line(runs):
    """The reverse of the upgrade cannot work (0.16 needs common.pt, 0.17+ no longer writes it): the
    loader names the directory, the version that wrote it and `make install` instead of a traceback."""
    import megatron.core

    from megappo.utils.checkpoint import megatron_format_problem

    _, ckpt, _ = runs
    assert megatron_format_problem(ckpt, megatron.core.__version__) is None
    assert megatron_format_problem(OLD / "ckpt", "0.16.1") is None  # the old format, read by the old version
    if (ckpt / "common.pt").exists():
        pytest.skip(f"megatron-core {megatron.core.__version__} still writes common.pt")
    msg = megatron_format_problem(ckpt, "0.16.1")
    assert msg and str(ckpt) in msg and "megatron-core 0.16.1 cannot read" in msg and "make install" in msg
    assert "\n" not in msg
