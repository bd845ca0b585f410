"""Context parallelism through the Megatron engine (issue #72): the same tiny llama at CP2 (2 gloo ranks, each
packed micro-batch cut zigzag over the pair, megappo's CP attention) and at CP1 (one process): forward log-probs
and entropy within 1e-5, and one optimizer step's loss, grad norm and every updated weight within 1e-5 (relative),
on rows of odd lengths (test_megatron_engine's batch)."""

import torch

from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout
from test_megatron_engine import OPTIM, R, make_batch, pg_loss, to_hf


def _worker(rank, world, port, path, layout):
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM)))
    batch = make_batch()
    fwd = eng.forward_only(batch, response_length=R, micro_batch_size=4)
    metrics = eng.train_step(batch, pg_loss, batch["response_mask"].sum().item(), response_length=R,
                             micro_batch_size=4)
    return {"forward": fwd, "metrics": metrics, "tp": 0,
            "params": {k: v.detach().clone() for k, v in eng.named_parameters_global()}}


def test_cp2_forward_and_step_equal_cp1(tiny_assets):
    path = str(tiny_assets["tiny-llama"])
    single = spawn_local(_worker, 1, path, ParallelLayout())[0]
    cp2 = spawn_local(_worker, 2, path, ParallelLayout(cp=2), threads=1)
    mask = make_batch()["response_mask"].bool()
    for r in cp2:
        for k in ("logprobs", "entropy"):
            err = (r["forward"][k] - single["forward"][k])[mask].abs().max().item()
            assert err <= 1e-5, (k, err)
        m1, m2 = single["metrics"], r["metrics"]
        assert abs(m1["loss"] - m2["loss"]) <= 1e-5 * abs(m1["loss"]), (m1["loss"], m2["loss"])
        assert abs(m1["grad_norm"] - m2["grad_norm"]) <= 1e-5 * m1["grad_norm"], (m1["grad_norm"], m2["grad_norm"])
        # each rank ran its half of the rows' tokens (packed, padded to 2 * cp per row), not the whole batch
        assert r["metrics"]["computed_tokens"] < 0.6 * single["metrics"]["computed_tokens"]
    a, b = to_hf([single], path, 1), to_hf([cp2[0]], path, 1)
    worst = max(((a[k] - b[k]).norm() / a[k].norm()).item() for k in a)
    assert worst <= 1e-5, worst
    assert all(torch.equal(cp2[0]["params"][k], cp2[1]["params"][k]) for k in cp2[0]["params"])
