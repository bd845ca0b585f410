"""MoE routing replay through the Megatron engine (issue #73, models/routing_replay.py), on the tiny Qwen3-MoE
(softmax top-2) and DeepSeek-V3 (sigmoid scores, group-limited top-k, the correction bias) in fp32:

- recorded routes are the routers' own: replaying them leaves the log-probs bit-equal to a free forward;
- given routes are the ones used: every (token, layer) sent to the experts it was given (moe_replay_mismatch 0,
  checked on megatron's routing map), and where they are not the router's choice the agreement says so;
- one optimizer step on fixed, perturbed routes (every route moved to the next expert, so no router chose them)
  at TP2 (sequence parallel), PP2 x VPP2, DP2 x EP2, packed and with activation recompute equals the single
  process's step on the same routes: loss, grad norm, and each router's gradient (never zero: the replayed
  experts' weights are the current router's scores) within 1e-5; and the routes recorded under that layout (each
  rank its tokens and layers, gathered over TP, CP and PP) are the single process's.
"""

import functools
import json

import pytest
import torch

from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout
from test_megatron_engine import OPTIM, R, make_batch, pg_loss


def _perturbed(routes: torch.Tensor, experts: int) -> torch.Tensor:
    """The last layer's routes moved to the next expert (mod E): a valid, distinct top-k its router did not choose
    for most tokens. The layers before it see the same inputs, so their routers still choose what they were given."""
    moved = routes.clone()
    last = moved[..., -1, :]
    moved[..., -1, :] = torch.where(last >= 0, (last + 1) % experts, last)
    return moved


def _experts(path) -> int:
    from megappo.models.gpt import load_hf_config
    from megappo.parallel.weight_mapping import ModelDims

    return ModelDims.from_hf_config(load_hf_config(path), tp=1).num_experts


def _worker(rank, world, port, path, layout, packed=False, recompute=False, routes=None):
    from megatron.core import parallel_state as mpu

    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM, distributed_optimizer=False),
                                                    pack_sequences=packed, recompute=recompute))
    batch = make_batch()
    dp, n = mpu.get_data_parallel_rank(), batch["input_ids"].shape[0] // layout.dp
    local = {k: v[dp * n:(dp + 1) * n] for k, v in batch.items()}
    mbs = 4 // layout.dp
    out = {"dp": dp, "tp": mpu.get_tensor_model_parallel_rank(), "pp": mpu.get_pipeline_model_parallel_rank()}
    if routes is None:  # record, then replay what was recorded, then replay perturbed routes
        free = eng.forward_only(local, response_length=R, micro_batch_size=mbs, record_routes=True)
        own = eng.forward_only({**local, "routed_experts": free["routed_experts"]}, response_length=R,
                               micro_batch_size=mbs)
        out.update(free=free, own=own)
        routes = _perturbed(free["routed_experts"], eng.dims.num_experts)
    else:
        routes = routes[dp * n:(dp + 1) * n]
        # the routers' own routes recorded under this layout (each rank its tokens and layers, gathered)
        rec = eng.forward_only(local, response_length=R, micro_batch_size=mbs, record_routes=True)
        out["recorded"] = None if rec is None else rec["routed_experts"]
    m = eng.train_step({**local, "routed_experts": routes}, pg_loss, batch["response_mask"].sum().item(),
                       response_length=R, micro_batch_size=mbs)
    out["metrics"] = m
    out["router_grads"] = {k: v.main_grad.detach().clone() for k, v in eng.named_parameters_global()
                           if k.endswith("router.weight")}
    return out


@functools.lru_cache(maxsize=None)
def _single(path):
    """The single process's record, replays and step on perturbed routes (computed once per model)."""
    return spawn_local(_worker, 1, path, ParallelLayout())[0]


# DeepSeek-V3's group-limited top-k with the correction bias in CI; Qwen3-MoE's softmax top-k is recorded by every
# step test's reference
@pytest.mark.parametrize("family", [pytest.param("tiny-qwen3_moe", marks=pytest.mark.long), "tiny-deepseek_v3"])
def test_recorded_routes_replay_exactly_and_given_routes_are_used(tiny_assets, family):
    r = _single(str(tiny_assets[family]))
    hf = json.loads((tiny_assets[family] / "config.json").read_text())
    routes, mask = r["free"]["routed_experts"], make_batch()["attention_mask"].bool()
    assert routes.dtype == torch.int16 and routes.shape[2:] == (hf["num_hidden_layers"], hf["num_experts_per_tok"])
    # a MoE layer routes every real token to k distinct experts, a dense layer (the tiny models' first) none;
    # padding is never routed
    real = routes[mask]  # [tokens, layers, k]
    moe = (real >= 0).all(-1).all(0)
    assert bool(moe.any()) and bool(((real >= 0).all(-1).all(0) | (real < 0).all(-1).all(0)).all()), real
    assert bool((real[:, moe].sort(-1).values.diff(dim=-1) > 0).all()) and bool((routes[~mask] == -1).all())
    for k in ("logprobs", "entropy"):  # the routers' own routes, replayed: the same network, bit for bit
        assert torch.equal(r["free"][k], r["own"][k]), k
    m = r["metrics"]
    assert m["moe_replay_mismatch"] == 0, m
    # the agreement of the routers' own choice with the given routes, counted here from the routes themselves:
    # every layer before the last agrees, the last where its router chose the moved-to expert too
    moved = _perturbed(real, _experts(tiny_assets[family]))[:, -1]
    hit = (moved[:, :, None] == real[:, -1][:, None, :]).any(-1)
    given = int(moe.sum()) * real.shape[0] * real.shape[-1]
    assert m["moe_route_agreement"] == pytest.approx(1 - float((~hit).sum()) / given, abs=1e-12), m
    assert m["moe_route_agreement_worst_layer"] == pytest.approx(float(hit.double().mean()), abs=1e-12), m
    assert m["moe_route_agreement_worst_layer"] < 1
    assert all(g.abs().sum() > 0 for g in r["router_grads"].values()), "a router's gradient is zero under replay"


@pytest.mark.parametrize("family, layout, packed, recompute", [
    # multi-latent attention at TP2 (sequence parallel: each TP rank routes its rows), packed; and expert parallel
    # with activation recompute (the recompute re-runs take the routes their forwards took), packed
    ("tiny-deepseek_v3", dict(tp=2), True, False),
    ("tiny-qwen3_moe", dict(dp=2, ep=2), True, True),
    pytest.param("tiny-qwen3_moe", dict(tp=2), False, True, marks=pytest.mark.long),
    pytest.param("tiny-qwen3_moe", dict(pp=2, vpp=2), True, False, marks=pytest.mark.long),
    pytest.param("tiny-deepseek_v3", dict(dp=2, ep=2), False, False, marks=pytest.mark.long),
    # context parallel: each CP rank routes its zigzag share of every packed micro-batch
    pytest.param("tiny-qwen3_moe", dict(cp=2), True, True, marks=pytest.mark.long),
    pytest.param("tiny-deepseek_v3", dict(cp=2, ep=2), True, False, marks=pytest.mark.long),
])
def test_replayed_step_equals_single_process_on_the_same_routes(tiny_assets, family, layout, packed, recompute):
    path = str(tiny_assets[family])
    single = _single(path)
    routes = _perturbed(single["free"]["routed_experts"], _experts(tiny_assets[family]))
    lay = ParallelLayout(**layout)
    runs = spawn_local(_worker, lay.world_size, path, lay, packed, recompute, routes, threads=1)
    m1 = single["metrics"]
    grads = {}
    for r in runs:
        m2 = r["metrics"]
        assert m2["moe_replay_mismatch"] == 0 and m2["moe_route_agreement"] == m1["moe_route_agreement"], m2
        assert abs(m1["loss"] - m2["loss"]) <= 1e-5 * abs(m1["loss"]), (m1["loss"], m2["loss"])
        assert abs(m1["grad_norm"] - m2["grad_norm"]) <= 1e-5 * m1["grad_norm"], (m1["grad_norm"], m2["grad_norm"])
        grads.update(r["router_grads"])
        if r["recorded"] is not None:  # the last stage's: every layer's routes, recorded across TP / CP / PP
            n = single["free"]["routed_experts"].shape[0] // lay.dp
            want = single["free"]["routed_experts"][r["dp"] * n:(r["dp"] + 1) * n]
            got, want = r["recorded"].sort(-1).values, want.sort(-1).values  # top-k order is the kernel's
            assert torch.equal(got, want), float((got != want).float().mean())
    assert sorted(grads) == sorted(single["router_grads"])  # every stage's routers, together
    for k, g in single["router_grads"].items():
        err = ((grads[k] - g).norm() / g.norm()).item()
        assert g.abs().sum() > 0 and err <= 1e-5, (k, err)
