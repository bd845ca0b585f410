"""Context parallelism through the Megatron engine (issue #72): the same tiny llama at CP2 (2 gloo ranks, each
packed micro-batch cut zigzag over the pair, megappo's CP attention) and at CP1 (one process): forward log-probs
and entropy within 1e-5, and one optimizer step's loss, grad norm and every updated weight within 1e-5 (relative),
on rows of odd lengths (test_megatron_engine's batch). Then `megappo logprobs --cp` against transformers and CP1 on
rows of odd lengths up to the model's 512 positions."""

import pytest
import torch

from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout
from test_megatron_engine import OPTIM, R, make_batch, pg_loss, to_hf


def _worker(rank, world, port, path, layout, lora=False):
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    from megatron.core import parallel_state as mpu

    init_megatron(layout)
    from megappo.models.lora import LoraConfig

    eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM), lora=LoraConfig(rank=4) if lora else None))
    seen = []  # the tokens each model call got on this rank
    eng.model[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].numel()))
    batch = make_batch()
    dp, n = mpu.get_data_parallel_rank(), batch["input_ids"].shape[0] // layout.dp
    local = {k: v[dp * n:(dp + 1) * n] for k, v in batch.items()}
    fwd = eng.forward_only(local, response_length=R, micro_batch_size=4 // layout.dp)
    metrics = eng.train_step(local, pg_loss, batch["response_mask"].sum().item(), response_length=R,
                             micro_batch_size=4 // layout.dp)
    return {"forward": fwd, "metrics": metrics, "tp": mpu.get_tensor_model_parallel_rank(), "dp": dp, "seen": seen,
            "cp": mpu.get_context_parallel_rank(),
            "params": {k: v.detach().clone() for k, v in eng.named_parameters_global()}}


@pytest.mark.parametrize("family, layout, lora", [
    ("tiny-llama", dict(cp=2), False),
    # multi-latent attention (the latent's RoPE part split like k) with routed experts: tokens routed after the split
    ("tiny-deepseek_v3", dict(cp=2), False),
    pytest.param("tiny-llama", dict(tp=2, cp=2), False, marks=pytest.mark.long),
    pytest.param("tiny-qwen3_moe", dict(cp=2, dp=2, ep=2), False, marks=pytest.mark.long),
    # an expert group of the two CP ranks of one replica (expert data parallel = dp * cp / ep = 1)
    pytest.param("tiny-qwen3_moe", dict(cp=2, ep=2), False, marks=pytest.mark.long),
    # LoRA (rank 4 on the default targets): the adapters' gradients reduced over DP x CP like any other; the
    # weights compared are the merged ones (W + scaling * B @ A)
    pytest.param("tiny-llama", dict(cp=2), True, marks=pytest.mark.long),
])
def test_cp_forward_and_step_equal_cp1(tiny_assets, family, layout, lora):
    path = str(tiny_assets[family])
    lay = ParallelLayout(**layout)
    single = spawn_local(_worker, 1, path, ParallelLayout(), lora)[0]
    runs = spawn_local(_worker, lay.world_size, path, lay, lora, threads=1)
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
        # MoE: the expert-load metrics count every real token once, summed over the CP ranks (padding is not routed)
        moe = sorted(k for k in m1 if k.startswith("moe_"))
        assert [k for k in m2 if k.startswith("moe_")] and moe or not family.endswith(("moe", "v3")), m2
        for k in moe:
            assert m2[k] == pytest.approx(m1[k], rel=1e-6), (k, m1[k], m2[k])
        # each rank ran its share of the rows' tokens (packed, padded to 2 * cp per row), not the whole batch
        assert max(r["seen"]) < 0.6 * max(single["seen"]) / lay.dp, (r["seen"], single["seen"])
    a = to_hf([single], path, 1)
    # every rank's: expert-parallel ranks hold other experts (megatron's EP group spans CP x DP)
    b = to_hf(runs, path, lay.tp)
    worst = max(((a[k] - b[k]).norm() / a[k].norm()).item() for k in a)
    assert worst <= 1e-5, worst
    for t in (r for r in runs if r["cp"] == 1):  # the CP ranks hold the same weights
        same = next(r for r in runs if r["cp"] == 0 and r["tp"] == t["tp"] and r["dp"] == t["dp"])
        assert all(torch.equal(same["params"][k], t["params"][k]) for k in t["params"] if k in same["params"])


# odd lengths from 3 up to the model's 512 positions, response starts anywhere in the row
LONG_ROWS = [(3, 1), (9, 4), (31, 30), (127, 60), (511, 200)]


@pytest.mark.parametrize("family, layout", [
    ("tiny-llama", dict(pp=2, cp=2)),
    pytest.param("tiny-llama", dict(tp=2, cp=2), marks=pytest.mark.long),
    pytest.param("tiny-qwen3_moe", dict(cp=2, dp=2, ep=2), marks=pytest.mark.long),
    pytest.param("tiny-deepseek_v3", dict(cp=2), marks=pytest.mark.long),  # multi-latent attention, YaRN
    pytest.param("tiny-glm4_moe", dict(cp=2), marks=pytest.mark.long),  # partial RoPE
])
def test_logprobs_cli_at_cp_matches_cp1_and_transformers(tiny_assets, tmp_path, family, layout):
    """`megappo logprobs --cp` on rows of odd lengths up to the model's positions (one per micro-batch: each
    row's tokens alone over the CP pair) and two rows per micro-batch (packed together): <= 1e-5 of the same
    layout at CP1, <= 1e-4 of transformers."""
    import argparse
    import json

    from megappo.assets import hf_response_logprobs
    from megappo.logprobs import score

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, 1000, (n,), generator=g).tolist(), "response_start": k} for n, k in LONG_ROWS]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = str(tiny_assets[family])
    ref = hf_response_logprobs(model, rows)
    def run(lay, mbs):
        return score(argparse.Namespace(model=model, input=str(tmp_path / "rows.jsonl"), critic=False, temperature=1.0,
                                        micro_batch_size=mbs, seed=1, device="cpu",
                                        **{"tp": 1, "pp": 1, "dp": 1, "vpp": None, "ep": 1, **lay}))

    base = run(dict(layout, cp=1, dp=layout.get("dp", 1) * layout["cp"]), 1)  # the same world, data parallel
    for mbs in (1, 2):
        got = run(layout, mbs)
        for i, r in enumerate(ref):
            lp = got[f"logprobs.{i}"]
            assert lp.shape == r.shape
            assert (lp - base[f"logprobs.{i}"]).abs().max().item() <= 1e-5, (mbs, i)
            assert (lp - r).abs().max().item() <= 1e-4, (mbs, i, (lp - r).abs().max().item())
