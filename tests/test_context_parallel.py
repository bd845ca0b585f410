"""Context parallelism through the Megatron engine (issue #72): the same tiny llama at CP2 (2 gloo ranks, each
packed micro-batch cut zigzag over the pair, megappo's CP attention) and at CP1 (one process): forward log-probs
and entropy within 1e-5, and one optimizer step's loss, grad norm and every updated weight within 1e-5 (relative),
on rows of odd lengths (test_megatron_engine's batch)."""

import pytest
import torch

from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout
from test_megatron_engine import OPTIM, R, make_batch, pg_loss, to_hf


def _worker(rank, world, port, path, layout):
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    from megatron.core import parallel_state as mpu

    init_megatron(layout)
    eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM)))
    batch = make_batch()
    dp, n = mpu.get_data_parallel_rank(), batch["input_ids"].shape[0] // layout.dp
    local = {k: v[dp * n:(dp + 1) * n] for k, v in batch.items()}
    fwd = eng.forward_only(local, response_length=R, micro_batch_size=4 // layout.dp)
    metrics = eng.train_step(local, pg_loss, batch["response_mask"].sum().item(), response_length=R,
                             micro_batch_size=4 // layout.dp)
    return {"forward": fwd, "metrics": metrics, "tp": mpu.get_tensor_model_parallel_rank(), "dp": dp,
            "cp": mpu.get_context_parallel_rank(),
            "params": {k: v.detach().clone() for k, v in eng.named_parameters_global()}}


@pytest.mark.parametrize("family, layout", [
    ("tiny-llama", dict(cp=2)),
    # multi-latent attention (the latent's RoPE part split like k) with routed experts: tokens routed after the split
    ("tiny-deepseek_v3", dict(cp=2)),
    pytest.param("tiny-llama", dict(tp=2, cp=2), marks=pytest.mark.long),
    pytest.param("tiny-qwen3_moe", dict(cp=2, dp=2, ep=2), marks=pytest.mark.long),
])
def test_cp_forward_and_step_equal_cp1(tiny_assets, family, layout):
    path = str(tiny_assets[family])
    lay = ParallelLayout(**layout)
    single = spawn_local(_worker, 1, path, ParallelLayout())[0]
    runs = spawn_local(_worker, lay.world_size, path, lay, threads=1)
    mask = make_batch()["response_mask"].bool()
    for r in runs:
        n = mask.shape[0] // lay.dp
        rows = slice(r["dp"] * n, (r["dp"] + 1) * n)
        for k in ("logprobs", "entropy"):
            err = (r["forward"][k] - single["forward"][k][rows])[mask[rows]].abs().max().item()
            assert err <= 1e-5, (k, err)
        m1, m2 = single["metrics"], r["metrics"]
        assert abs(m1["loss"] - m2["loss"]) <= 1e-5 * abs(m1["loss"]), (m1["loss"], m2["loss"])
        assert abs(m1["grad_norm"] - m2["grad_norm"]) <= 1e-5 * m1["grad_norm"], (m1["grad_norm"], m2["grad_norm"])
        # each rank ran its share of the rows' tokens (packed, padded to 2 * cp per row), not the whole batch
        assert r["metrics"]["computed_tokens"] < 0.6 * single["metrics"]["computed_tokens"] / lay.dp
    a = to_hf([single], path, 1)
    # every rank's: expert-parallel ranks hold other experts (megatron's EP group spans CP x DP)
    b = to_hf(runs, path, lay.tp)
    worst = max(((a[k] - b[k]).norm() / a[k].norm()).item() for k in a)
    assert worst <= 1e-5, worst
    for t in (r for r in runs if r["cp"] == 1):  # the CP ranks hold the same weights
        same = next(r for r in runs if r["cp"] == 0 and r["tp"] == t["tp"] and r["dp"] == t["dp"])
        assert all(torch.equal(same["params"][k], t["params"][k]) for k in t["params"] if k in same["params"])
