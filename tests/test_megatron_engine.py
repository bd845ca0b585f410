"""One optimizer step (Adam, distributed optimizer, grad clipping) under TP2xPP2xDP2 (8 processes)
equals the single-process run; the loss does not depend on the micro-batch size (1 vs 4). The loss is
normalised by the caller's global token count, so DP/PP/micro-batching must not change it."""

import pytest
import torch

from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout

B, S, R = 8, 16, 6


def make_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (B, S), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    mask[5, :2] = 0
    mask[3, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "advantages": torch.randn(B, R, generator=g),
            "response_mask": mask[:, -R:].float()}


def pg_loss(out, mb):
    m = mb["response_mask"]
    loss = -(out["logprobs"] * mb["advantages"] * m).sum() - 0.01 * (out["entropy"] * m).sum()
    return loss, {"tokens": m.sum()}


# adam_eps 1e-6: a few grads are mathematically zero (k-proj bias) and fp32 noise there would be
# amplified to lr-sized Adam steps with a tiny eps
OPTIM = dict(lr=1e-3, adam_eps=1e-6, clip_grad=1.0)


def _train(path, layout, mbs):
    from megatron.core import parallel_state as mpu

    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM)))
    batch = make_batch()
    normalizer = batch["response_mask"].sum().item()
    dp, n = mpu.get_data_parallel_rank(), B // layout.dp
    local = {k: v[dp * n:(dp + 1) * n] for k, v in batch.items()}
    metrics = eng.train_step(local, pg_loss, normalizer, response_length=R, micro_batch_size=mbs)
    params = {k: v.detach().clone() for k, v in eng.named_parameters_global()} if dp == 0 else None
    return {"metrics": metrics, "params": params, "tp": mpu.get_tensor_model_parallel_rank()}


def _worker(rank, world, port, path, layout, mbs_list):
    from megappo.parallel.megatron_init import init_distributed, init_megatron

    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    return [_train(path, layout, mbs) for mbs in mbs_list]


def to_hf(results, path, tp):
    from megappo.models.gpt import load_hf_config
    from megappo.parallel.weight_mapping import ModelDims, megatron_shards_to_hf

    dims = ModelDims.from_hf_config(load_hf_config(path), tp=tp)
    shards = {}
    for r in results:
        for k, v in (r["params"] or {}).items():
            shards.setdefault(k, {})[r["tp"]] = v
    hf = {}
    for k, by_tp in shards.items():
        assert sorted(by_tp) == list(range(tp)), k
        hf.update(megatron_shards_to_hf(k, [by_tp[i] for i in range(tp)], dims))
    return hf


@pytest.fixture(scope="module")
def runs(tiny_assets):
    path = str(tiny_assets["tiny-llama"])
    single = spawn_local(_worker, 1, path, ParallelLayout(), [4, 1])[0]
    dist8 = [r[0] for r in spawn_local(_worker, 8, path, ParallelLayout(tp=2, pp=2, dp=2), [1], timeout=900)]
    return path, single, dist8


def test_loss_identical_for_micro_batch_1_and_4(runs):
    _, (mbs4, mbs1), _ = runs
    assert mbs4["metrics"]["tokens"] == mbs1["metrics"]["tokens"] == 46.0
    assert abs(mbs4["metrics"]["loss"] - mbs1["metrics"]["loss"]) <= 1e-6 * abs(mbs4["metrics"]["loss"])
    assert abs(mbs4["metrics"]["grad_norm"] - mbs1["metrics"]["grad_norm"]) <= 1e-5 * mbs4["metrics"]["grad_norm"]
    # atol 5e-6 (lr 1e-3): an element whose gradient is ~1e-8 moves by lr * g / (|g| + eps), so fp32
    # rounding in g (another summation order) shows there as ~1e-6 (measured: 3 of 230k elements, 3.2e-6)
    for k, v in mbs4["params"].items():
        assert torch.allclose(v, mbs1["params"][k], rtol=0, atol=5e-6), k


def test_tp2_pp2_dp2_step_equals_single_process(runs):
    path, (single, _), dist8 = runs
    m1, m8 = single["metrics"], dist8[0]["metrics"]
    print("single", m1, "\nTP2xPP2xDP2", m8)
    for m in dist8:  # every rank reports the same metrics
        assert m["metrics"] == m8
    assert abs(m1["loss"] - m8["loss"]) <= 1e-5 * abs(m1["loss"])
    assert abs(m1["grad_norm"] - m8["grad_norm"]) <= 1e-5 * m1["grad_norm"]
    assert m1["grad_norm"] > 1.0  # clipping was active (clip_grad=1.0)
    a, b = to_hf([single], path, 1), to_hf(dist8, path, 2)
    assert a.keys() == b.keys() and len(a) == 39
    from megappo.models.gpt import SafetensorsReader

    init = SafetensorsReader(path)
    worst = max(((a[k] - b[k]).norm() / a[k].norm()).item() for k in a)
    moved = min((a[k] - init.get(k)).abs().max().item() for k in a)
    print(f"max per-tensor relative error {worst:.2e}; smallest max |update| {moved:.2e}")
    assert worst <= 1e-5
    assert moved > 1e-4  # every tensor really took a step


# ---- mixture of experts: expert parallel ------------------------------------------------------------

def _moe_worker(rank, world, port, path, layout, ckpt=None, resume=None):
    """One step from the HF weights (then, with `ckpt`: save, and a second step); with `resume`: a fresh
    engine loads that checkpoint (written at another layout) and takes the second step."""
    from megatron.core import parallel_state as mpu

    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    b1 = make_batch()
    b2 = dict(b1, advantages=-b1["advantages"].flip(0))
    dp, n = mpu.get_data_parallel_rank(), B // layout.dp

    def step(eng, batch):
        local = {k: v[dp * n:(dp + 1) * n] for k, v in batch.items()}
        return eng.train_step(local, pg_loss, batch["response_mask"].sum().item(), response_length=R, micro_batch_size=2)

    def params(eng):  # every rank: expert-parallel ranks hold different experts (global expert names)
        return {k: v.detach().clone() for k, v in eng.named_parameters_global()}

    eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM)))
    out = {"metrics": step(eng, b1), "params": params(eng), "tp": mpu.get_tensor_model_parallel_rank()}
    if ckpt:
        eng.save_checkpoint(ckpt)
        out["step2"] = {"metrics": step(eng, b2), "params": params(eng), "tp": out["tp"]}
    if resume:
        init_megatron(layout)
        eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM)))
        eng.load_checkpoint(resume)
        out["step2"] = {"metrics": step(eng, b2), "params": params(eng), "tp": out["tp"]}
    return out


def test_moe_step_with_expert_parallel_equals_single_process(tiny_assets, tmp_path):
    """Qwen3-MoE (4 experts, top-2, a dense first layer): one PPO-style step at TP2xPP2xDP2xEP2 (experts
    split over 2 expert-parallel ranks and over TP, megatron's alltoall dispatcher over gloo, sequence
    parallel) equals the single-process step: loss, grad norm and every weight after the update. Its
    checkpoint (model + optimizer) exports to HF bit for bit (vLLM serving Qwen3-MoE like transformers: test_hybrid_engine), and resumes in one process (EP 2 -> 1,
    TP 2 -> 1, PP 2 -> 1): the next step equals the uninterrupted TP2xPP2xDP2xEP2 one."""
    from megappo.models.gpt import SafetensorsReader
    from megappo.conversion import mcore_to_hf

    path, ckpt = str(tiny_assets["tiny-qwen3_moe"]), tmp_path / "step1"
    dist8 = spawn_local(_moe_worker, 8, path, ParallelLayout(tp=2, pp=2, dp=2, ep=2), str(ckpt), timeout=900)
    single = spawn_local(_moe_worker, 1, path, ParallelLayout(), None, str(ckpt), timeout=600)
    m1, m8 = single[0]["metrics"], dist8[0]["metrics"]
    print("single", m1, "\nTP2xPP2xDP2xEP2", m8)
    assert abs(m1["loss"] - m8["loss"]) <= 1e-5 * abs(m1["loss"])
    assert abs(m1["grad_norm"] - m8["grad_norm"]) <= 1e-5 * m1["grad_norm"] and m1["grad_norm"] > 1.0
    a, b = to_hf(single, path, 1), to_hf(dist8, path, 2)
    assert a.keys() == b.keys() and len(a) == 77 and sum(".mlp.experts." in k for k in a) == 3 * 4 * 3

    def rel_err(x, y):
        return max(((x[k] - y[k]).norm() / x[k].norm()).item() for k in x)

    init = SafetensorsReader(path)
    moved = sorted((a[k] - init.get(k)).abs().max().item() for k in a)
    print(f"max per-tensor relative error {rel_err(a, b):.2e}; smallest max |update| {moved[0]:.2e}")
    assert rel_err(a, b) <= 1e-5
    assert moved[0] > 1e-4  # every tensor, every expert's included, really took a step

    # the EP2 training checkpoint as HF: exactly the weights the 8 ranks held
    mcore_to_hf(ckpt, tmp_path / "hf", config=path, progress=False)
    from safetensors.torch import load_file

    exported = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert exported.keys() == b.keys() and all(torch.equal(exported[k], b[k]) for k in b)
    # resumed at EP1 in one process: the second step equals the uninterrupted one
    a2, b2 = to_hf([r["step2"] for r in single], path, 1), to_hf([r["step2"] for r in dist8], path, 2)
    l1, l8 = single[0]["step2"]["metrics"]["loss"], dist8[0]["step2"]["metrics"]["loss"]
    print(f"step 2 after the EP2 -> EP1 resume: loss {l1:.8f} vs {l8:.8f}; max relative error {rel_err(a2, b2):.2e}")
    assert abs(l1 - l8) <= 1e-5 * abs(l8)
    assert rel_err(a2, b2) <= 1e-5 and rel_err(b, b2) > 1e-4  # the step moved them


# ---- host offload ---------------------------------------------------------------------------------


def _offload_worker(rank, world, port, path):
    """Two engines from the same weights, one with offload: three steps each (the offloaded one leaves
    the device between them), then the same weights, optimizer states and forward bit for bit."""
    from megatron.core import parallel_state as mpu

    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    layout = ParallelLayout(tp=2, pp=1, dp=1)
    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    optim = OptimConfig(distributed_optimizer=True, **OPTIM)
    plain = MegatronEngine(path, layout, EngineConfig(optim=optim))
    off = MegatronEngine(path, layout, EngineConfig(optim=optim, offload=True))
    ref = MegatronEngine(path, layout, EngineConfig(optim=None, offload=True))
    param_bytes = sum(p.numel() * p.element_size() for _, p in plain.named_parameters_global())
    report = {"param_bytes": param_bytes, "offloaded_after_init": off.offloaded and ref.offloaded,
              "freed": [], "storages_empty": [], "metrics": []}
    batch = make_batch()
    norm = batch["response_mask"].sum().item()
    for _ in range(3):
        a = plain.train_step(batch, pg_loss, norm, response_length=R, micro_batch_size=4)
        b = off.train_step(batch, pg_loss, norm, response_length=R, micro_batch_size=4)
        report["metrics"].append((a, b))
        report["freed"].append(off.offload_stats["device_bytes_freed"])
        report["storages_empty"].append(off.offloaded and all(
            p.untyped_storage().nbytes() == 0 for _, p in off.named_parameters_global()))
    with off.resident(parts=["params"]):  # a weight sync's view: the weights only, optimizer and grads stay off
        states = [v for st in off.optimizer.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        grads = [b.grad_data for b in off.model[0].buffers]
        report["params_only"] = (all(p.untyped_storage().nbytes() > 0 for _, p in off.named_parameters_global())
                                 and all(t.untyped_storage().nbytes() == 0 for t in states + grads)
                                 and all(torch.equal(p, q) for (_, p), (_, q) in zip(
                                     plain.named_parameters_global(), off.named_parameters_global())))
    report["params_only_offloaded_after"] = off.offloaded and all(
        p.untyped_storage().nbytes() == 0 for _, p in off.named_parameters_global())
    with off.resident():  # weights and Adam states came back exactly
        report["params_equal"] = all(torch.equal(p, q) for (_, p), (_, q) in zip(
            plain.named_parameters_global(), off.named_parameters_global()))
        sa, sb = plain.optimizer.optimizer.state, off.optimizer.optimizer.state
        report["adam_equal"] = len(sa) == len(sb) > 0 and all(
            torch.equal(x[k], y[k]) for x, y in zip(sa.values(), sb.values()) for k in ("exp_avg", "exp_avg_sq"))
        report["resident_inside"] = not off.offloaded
    report["offloaded_after"] = off.offloaded
    # a forward (log-probs, values) brings back the weights only: Adam states and grads stay in host memory
    seen = []
    hook = off.model[0].register_forward_pre_hook(lambda *_: seen.append(all(
        t.untyped_storage().nbytes() == 0 for t in states + grads)))
    fo = off.forward_only(batch, response_length=R, micro_batch_size=4)
    hook.remove()
    report["forward_params_only"] = bool(seen) and all(seen)
    fa = plain.forward_only(batch, response_length=R, micro_batch_size=4)
    report["offloaded_forward_equal"] = fa is None or torch.equal(fa["logprobs"], fo["logprobs"])
    fb = ref.forward_only(batch, response_length=R, micro_batch_size=4)  # offloaded forward-only engine
    report["ref_forward_ran_offloaded_after"] = ref.offloaded
    report["tp"] = mpu.get_tensor_model_parallel_rank()
    report["ref_is_initial_weights"] = fa is not None and fb is not None and not torch.equal(fa["logprobs"], fb["logprobs"])
    fc = MegatronEngine(path, layout, EngineConfig(optim=None)).forward_only(batch, response_length=R, micro_batch_size=4)
    report["ref_forward_equal"] = torch.equal(fb["logprobs"], fc["logprobs"])
    return report


def test_offload_round_trip_is_exact(tiny_assets):
    reports = spawn_local(_offload_worker, 2, str(tiny_assets["tiny-llama"]))
    for r in reports:
        assert r["offloaded_after_init"]
        for a, b in r["metrics"]:
            assert a == b  # identical loss, grad norm, lr at every step
        assert all(r["storages_empty"]), r["storages_empty"]
        # params + grads (fp32 buffer) + two Adam states (sharded or not, each >= its shard share)
        assert min(r["freed"]) >= 2 * r["param_bytes"], (r["freed"], r["param_bytes"])
        assert r["params_equal"] and r["adam_equal"] and r["resident_inside"]
        assert r["params_only"] and r["params_only_offloaded_after"]
        assert r["offloaded_after"] and r["ref_forward_ran_offloaded_after"]
        assert r["forward_params_only"] and r["offloaded_forward_equal"]
        assert r["ref_is_initial_weights"] and r["ref_forward_equal"]


# ---- sequence parallel and activation recompute ---------------------------------------------------


def _sp_recompute_worker(rank, world, port, path):
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    layout = ParallelLayout(tp=2)
    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    batch = make_batch()
    norm = batch["response_mask"].sum().item()
    out = {}
    variants = {"plain": {}, "sp": {"sequence_parallel": True}, "recompute": {"recompute": True},
                "sp+recompute": {"sequence_parallel": True, "recompute": True}}
    for name, kw in variants.items():
        e = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM), **kw))
        m = e.train_step(batch, pg_loss, norm, response_length=R, micro_batch_size=4)
        f = e.forward_only(batch, response_length=R, micro_batch_size=4)
        out[name] = {"flags": (e.tf_config.sequence_parallel, e.tf_config.recompute_granularity),
                     "loss": m["loss"], "grad_norm": m["grad_norm"], "logprobs": f["logprobs"],
                     "params": {k: v.detach().clone() for k, v in e.named_parameters_global()}}
    return out


def test_sequence_parallel_and_recompute_match_plain_tp2(tiny_assets):
    """Same step and same log-probs with sequence parallel (reduce-scatter / all-gather along the
    sequence instead of all-reduce) and with full activation recompute, on gloo."""
    for out in spawn_local(_sp_recompute_worker, 2, str(tiny_assets["tiny-llama"])):
        base = out["plain"]
        assert out["sp"]["flags"] == (True, None) and out["recompute"]["flags"] == (False, "full")
        assert out["sp+recompute"]["flags"] == (True, "full") and base["flags"] == (False, None)
        for name in ("sp", "recompute", "sp+recompute"):
            v = out[name]
            assert abs(v["loss"] - base["loss"]) <= 1e-6 * abs(base["loss"]), name
            assert abs(v["grad_norm"] - base["grad_norm"]) <= 1e-6 * base["grad_norm"], name
            assert (v["logprobs"] - base["logprobs"]).abs().max() <= 1e-6, name
            for k, p in base["params"].items():
                assert torch.allclose(v["params"][k], p, rtol=0, atol=1e-7), (name, k)


# ---- right alignment (no mask tensor, no all-padding columns) ----------------------------------


def test_right_align_moves_rows_to_column_zero_and_maps_response_outputs():
    from megappo.workers.megatron_engine import right_align

    # rows: [pads | prompt | response | pads], S = 7, R = 3
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0],
                        [0, 4, 5, 6, 7, 8, 9],
                        [0, 0, 0, 6, 7, 0, 0]])
    mask = (ids > 0).long()
    out = right_align({"input_ids": ids, "attention_mask": mask, "x": torch.arange(3)}, response_length=3)
    # cut to the longest row (6 tokens); every row starts at column 0
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 0, 0], [4, 5, 6, 7, 8, 9], [6, 7, 0, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6, [1, 1, 0, 0, 0, 0]]
    assert out["position_ids"][1].tolist() == list(range(6)) and out["position_ids"][0, :4].tolist() == [0, 1, 2, 3]
    # response token j sat at column S-R+j = 4+j; its logits come from the column before it, shifted
    assert out["_targets"].tolist() == ids[:, 4:].tolist()
    assert out["_out_index"].tolist() == [[1, 2, 3], [2, 3, 4], [0, 1, 2]]
    for b in range(3):  # the predicting column holds the token right before the response token
        for j in range(3):
            if mask[b, 4 + j]:
                assert out["input_ids"][b, out["_out_index"][b, j]] == ids[b, 3 + j]
    assert torch.equal(out["x"], torch.arange(3))  # other keys untouched
    # sequence parallel needs a multiple of tp
    assert right_align({"input_ids": ids, "attention_mask": mask}, 3, seq_multiple=4)["input_ids"].shape[1] == 8
    with pytest.raises(ValueError, match="one contiguous run"):
        right_align({"input_ids": ids, "attention_mask": torch.tensor([[0, 1, 0, 1, 1, 1, 1]] * 3)}, 3)
    # a row shorter than the response window (scoring batches): its columns there are padding, clamped
    short = right_align({"input_ids": ids, "attention_mask": torch.tensor([[0, 0, 0, 0, 0, 1, 1]] * 3)}, 3)
    assert short["_out_index"][0].tolist() == [0, 0, 0]


# ---- sequence packing: the same numbers from real tokens only ---------------------------------------

def value_loss(out, mb):
    m = mb["response_mask"]
    return (((out["values"] - mb["advantages"]) ** 2) * m).sum(), {"tokens": m.sum()}


def _packing_worker(rank, world, port, path, layout, heads=("lm", "value")):
    """The padded engine, a packed one (micro-batches of 2 rows) and a packed one with a 30-token budget
    (rows regrouped longest first), from the same weights, LM head and value head: forward outputs in
    the caller's row order and one optimizer step each (loss, grad norm, updated weights)."""
    from megatron.core import parallel_state as mpu

    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    batch = make_batch()
    norm = batch["response_mask"].sum().item()
    report = {}
    for head, loss in [(h, {"lm": pg_loss, "value": value_loss}[h]) for h in heads]:
        variants = {"padded": {}, "packed": {"pack_sequences": True},
                    "budget": {"pack_sequences": True, "max_tokens_per_micro_batch": 30}}
        for name, kw in variants.items():
            eng = MegatronEngine(path, layout, EngineConfig(head=head, optim=OptimConfig(**OPTIM), **kw))
            fwd = eng.forward_only(batch, response_length=R, micro_batch_size=2)
            metrics = eng.train_step(batch, loss, norm, response_length=R, micro_batch_size=2)
            computed = metrics.pop("computed_tokens")
            report[(head, name)] = {"fwd": fwd, "metrics": metrics, "computed": computed,
                                    "params": {k: v.detach().clone() for k, v in eng.named_parameters_global()}}
    report["last_stage"] = mpu.get_pipeline_model_parallel_rank() == layout.pp - 1
    return report


@pytest.mark.parametrize("family,layout,heads", [("tiny-llama", ParallelLayout(tp=2), ("lm", "value")),
                                                 ("tiny-llama", ParallelLayout(pp=2), ("lm", "value")),
                                                 ("tiny-deepseek_v3", ParallelLayout(tp=2), ("lm",))],
                         ids=["tp2", "pp2", "deepseek_v3-tp2"])
def test_packed_sequences_equal_the_padded_path(tiny_assets, family, layout, heads):
    """Loss, gradients (via the updated weights) and log-probs / entropy / values of packed micro-batches
    equal the padded path's within fp32 rounding (<= 1e-5), at TP2 and PP2, for the actor's LM head and
    the critic's value head; the packed runs compute only the real tokens. DeepSeek-V3's multi-latent
    attention too (the LM head: the heads share the attention): v's head is narrower than q/k's, and each
    layer has its own YaRN RoPE (by token position)."""
    reports = spawn_local(_packing_worker, 2, str(tiny_assets[family]), layout, heads)
    real = int(make_batch()["attention_mask"].sum())
    m = make_batch()["response_mask"]  # outputs at padding positions are nobody's (every use masks them)
    for r in reports:
        for head in heads:
            base = r[(head, "padded")]
            for name in ("packed", "budget"):
                got = r[(head, name)]
                if r["last_stage"]:
                    assert base["fwd"].keys() == got["fwd"].keys()
                    for k in base["fwd"]:
                        torch.testing.assert_close(got["fwd"][k] * m, base["fwd"][k] * m, rtol=0, atol=1e-5)
                assert got["metrics"]["loss"] == pytest.approx(base["metrics"]["loss"], rel=1e-5)
                assert got["metrics"]["grad_norm"] == pytest.approx(base["metrics"]["grad_norm"], rel=1e-5)
                assert got["metrics"]["tokens"] == base["metrics"]["tokens"]
                # lr 1e-3: a wrong gradient moves a weight by ~1e-3; Adam turns fp32 rounding in a ~1e-8 gradient
                # (packed rows sum in another order) into up to ~6e-6 (measured on an AVX512 machine: 5.7e-6)
                for k, v in base["params"].items():
                    torch.testing.assert_close(got["params"][k], v, rtol=0, atol=2e-5, msg=k)
                assert real <= got["computed"] <= base["computed"], (name, got["computed"], base["computed"])
            # this batch is mostly full rows: pairs in order fill 32 columns like the padding does, the budget
            # regroups them into 4 x 30 (104 real tokens)
            assert r[(head, "budget")]["computed"] < base["computed"]


def test_dp_balance_keeps_each_mini_batch_and_evens_the_tokens():
    """Membership read through the real split (the worker group's DataProto.chunk per DP rank, then
    the update's _mini_batches per rank), not restated: global mini-batch k = local k of every rank."""
    from megappo.protocol import DataProto
    from megappo.workers.packing import balance_across_dp
    from megappo.workers.role_batches import _mini_batches

    def global_mini_batches(order, dp, mini):
        data = DataProto({"row": torch.tensor(order)}, {}, {})
        per_rank = [[m.batch["row"].tolist() for m in _mini_batches(shard, mini, dp, "actor")]
                    for shard in data.chunk(dp)]
        return [[rank[k] for rank in per_rank] for k in range(len(per_rank[0]))]  # [k][d] -> rows

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(5, 500, (64,), generator=g).tolist()
    dp, mini = 4, 16
    order = balance_across_dp(lengths, dp, mini)
    assert sorted(order) == list(range(64))
    plain_minis, minis = global_mini_batches(list(range(64)), dp, mini), global_mini_batches(order, dp, mini)
    for plain, balanced in zip(plain_minis, minis):
        assert sorted(sum(plain, [])) == sorted(sum(balanced, []))  # the same rows: the same loss
        plain_tok = [sum(lengths[r] for r in rows) for rows in plain]
        bal_tok = [sum(lengths[r] for r in rows) for rows in balanced]
        assert max(bal_tok) - min(bal_tok) <= max(plain_tok) - min(plain_tok)
        assert max(bal_tok) <= sum(bal_tok) / dp + max(lengths[r] for r in sum(plain, []))
    assert sum(max(sum(lengths[r] for r in rows) for rows in m) for m in minis) < \
        sum(max(sum(lengths[r] for r in rows) for rows in m) for m in plain_minis)  # the slowest rank waits less
    assert balance_across_dp(lengths, 1, mini) == list(range(64))


def test_segment_spans():
    from megappo.models.packed_attention import segment_spans

    assert segment_spans(torch.tensor([0, 0, 0, 1, 1, 2, -1, -1])) == [(0, 3), (3, 5), (5, 6), (6, 8)]
    assert segment_spans(torch.tensor([4])) == [(0, 1)] and segment_spans(torch.tensor([], dtype=torch.long)) == []


def _short_responses_batch():
    """8 rows of left-padded prompts (5-10 tokens) and right-padded responses of 1-6 tokens (R = 6): packed
    micro-batches whose own longest response is shorter than R."""
    prompts, responses = [10, 8, 6, 10, 9, 7, 10, 5], [6, 1, 2, 6, 3, 1, 5, 2]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        mask[i, S - R - p:S - R + r] = 1
    return {"input_ids": ids, "attention_mask": mask, "advantages": torch.randn(B, R, generator=g),
            "response_mask": mask[:, -R:].float()}


def _short_responses_worker(rank, world, port, path):
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout()
    init_megatron(layout)
    batch = _short_responses_batch()
    norm = batch["response_mask"].sum().item()
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, kw in {"padded": {}, "packed": {"pack_sequences": True},
                         "budget": {"pack_sequences": True, "max_tokens_per_micro_batch": 20}}.items():
            eng = MegatronEngine(path, layout, EngineConfig(head="lm", optim=OptimConfig(**OPTIM), params_dtype=dtype,
                                                            **kw))
            fwd = eng.forward_only(batch, response_length=R, micro_batch_size=2)
            metrics = eng.train_step(batch, pg_loss, norm, response_length=R, micro_batch_size=2)
            report[(str(dtype), name)] = {"fwd": fwd, "metrics": metrics}
    return report


def test_packed_short_response_windows_equal_the_padded_path_fp32_and_bf16(tiny_assets):
    """Each packed micro-batch runs its head over its own longest response, not the batch's R (#41), and the output
    at its rows' last token (a reward model's score column; at most R): the windows here are 6, 6, 4, 6 (2 rows
    each) and 6, 6, 6, 4, 2, 3 (20-token budget), responses of 6, 1, 2, 6, 3, 1, 5, 2 tokens. Log-probs, entropy
    (padded back to R) and the update equal the padded path's: fp32
    within 1e-5 (test_packed_sequences_equal_the_padded_path's tolerance), bf16 log-probs within
    tools/gpu_smoke.py's bf16 tolerance (mean |diff| <= 0.05 over the response tokens)."""
    from megappo.workers.megatron_step import micro_batches, right_align

    batch = right_align(_short_responses_batch(), R)
    windows = lambda **kw: [mb["_targets"].shape[1] for mb in micro_batches(  # noqa: E731
        batch, 2, packed=True, pp=1, vpp=None, seq_multiple=1, **kw).items]
    assert windows(max_tokens=None) == [6, 6, 4, 6] and windows(max_tokens=20) == [6, 6, 6, 4, 2, 3]

    report = spawn_local(_short_responses_worker, 1, str(tiny_assets["tiny-llama"]))[0]
    m = _short_responses_batch()["response_mask"]
    for dtype in (str(torch.float32), str(torch.bfloat16)):
        base = report[(dtype, "padded")]
        for name in ("packed", "budget"):
            got = report[(dtype, name)]
            # [B, R]: the columns past a micro-batch's window come back as zeros (no head ran there)
            assert got["fwd"]["logprobs"].shape == (B, R) and (got["fwd"]["logprobs"][m == 0] == 0).any()
            if dtype == str(torch.float32):
                for k in ("logprobs", "entropy"):
                    torch.testing.assert_close(got["fwd"][k] * m, base["fwd"][k] * m, rtol=0, atol=1e-5)
                assert got["metrics"]["loss"] == pytest.approx(base["metrics"]["loss"], rel=1e-5)
                assert got["metrics"]["grad_norm"] == pytest.approx(base["metrics"]["grad_norm"], rel=1e-5)
            else:
                diff = ((got["fwd"]["logprobs"] - base["fwd"]["logprobs"]).abs() * m).sum() / m.sum()
                assert diff <= 0.05, (name, diff)
                assert got["metrics"]["loss"] == pytest.approx(base["metrics"]["loss"], rel=0.05, abs=0.05)
