"""LoRA on megatron-core's parallel linears (megappo/models/lora.py) against `peft` on the HF model, tiny
llama, fp32, CPU/gloo, at TP1, TP2 (also with sequence parallelism) and PP2: the same adapter weights (random, B nonzero; one A shared by
q/k/v and by gate/up, as one adapter over megatron's fused linear_qkv / linear_fc1 is) give the same
log-probs; adapters off give the base model; the merged weights (W + scaling B@A) give the adapted
model; a backward reaches the adapters only, with peft's gradients; an optimizer step over the
adapters leaves every base weight bit-identical. One 2-process launch does every distributed check."""

import pytest
import torch

from megappo.models.lora import LoraConfig, apply_lora
from megappo.models.lora_peft import hf_lora_to_megatron, megatron_lora_to_hf
from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout

FAM = "tiny-llama"
RANK, ALPHA = 4, 8.0
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYOUTS = {"tp1": ParallelLayout(dp=2), "tp2": ParallelLayout(tp=2), "tp2sp": ParallelLayout(tp=2),
           "pp2": ParallelLayout(pp=2)}
SEQUENCE_PARALLEL = {"tp2sp"}
B, S = 2, 12
SEED = 1234


def make_ids():
    return torch.randint(0, 1000, (B, S), generator=torch.Generator().manual_seed(0))


def random_adapter(path) -> dict:
    """{HF module: (A, B)} for every targeted projection, A shared within q/k/v and within gate/up."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    h, d = c.hidden_size, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    g = torch.Generator().manual_seed(7)

    def a(n):
        return (torch.rand(RANK, n, generator=g) * 2 - 1) / n ** 0.5

    def b(n):
        return torch.randn(n, RANK, generator=g) * 0.05

    out = {}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv, fc = a(h), a(h)
        out[p + "self_attn.q_proj"] = (qkv, b(c.num_attention_heads * d))
        out[p + "self_attn.k_proj"] = (qkv, b(c.num_key_value_heads * d))
        out[p + "self_attn.v_proj"] = (qkv, b(c.num_key_value_heads * d))
        out[p + "self_attn.o_proj"] = (a(c.num_attention_heads * d), b(h))
        out[p + "mlp.gate_proj"] = (fc, b(c.intermediate_size))
        out[p + "mlp.up_proj"] = (fc, b(c.intermediate_size))
        out[p + "mlp.down_proj"] = (a(c.intermediate_size), b(h))
    return out


def _logprobs(logits, ids):
    return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def _worker(rank, world, port, path, adapter):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megappo.models.gpt import build_gpt_chunks, build_transformer_config, load_hf_config, load_hf_weights
    from megappo.models.logprobs import vocab_parallel_logprobs
    from megappo.models.lora import is_lora_param, iter_lora_modules, lora_disabled, lora_parameters, merged_named_parameters
    from megappo.models.lora_peft import load_hf_lora
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.parallel.weight_mapping import ModelDims, global_named_parameters

    init_distributed(rank, world, "127.0.0.1", port)
    ids = make_ids()
    pos = torch.arange(S)[None].expand(B, S)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    out = {}
    for key, layout in LAYOUTS.items():
        init_megatron(layout, seed=SEED)
        hf_config = load_hf_config(path)
        tf_config = build_transformer_config(hf_config, layout, sequence_parallel=key in SEQUENCE_PARALLEL)
        chunks = build_gpt_chunks(hf_config, tf_config, layout)
        dims = ModelDims.from_hf_config(hf_config, tp=layout.tp)
        tp_rank = mpu.get_tensor_model_parallel_rank()
        load_hf_weights(chunks, path, dims, tp_rank, layout.tp)
        model = chunks[0]

        def lp(backward=False):
            """This model's log-probs (None on a first pipeline stage); `backward`: of -sum(log-probs)."""
            if layout.pp == 1:
                out = vocab_parallel_logprobs(model(ids, pos, mask)[:, :-1], ids[:, 1:], vocab_size=dims.vocab_size,
                                              compute_entropy=False)[0]
                if backward:
                    (-out.sum()).backward()
                return out.detach()
            other = mpu.get_pipeline_model_parallel_next_rank()  # pp=2: the other stage either way
            if mpu.is_pipeline_first_stage():
                h = model(ids, pos, mask)  # [s, b, hidden]
                dist.send(h.detach().contiguous(), other)
                if backward:
                    g = torch.empty_like(h)
                    dist.recv(g, other)
                    h.backward(g)
                return None
            x = torch.empty(S, B, dims.hidden_size)
            dist.recv(x, other)
            x.requires_grad_(backward)
            model.set_input_tensor(x)
            out = vocab_parallel_logprobs(model(ids, pos, mask)[:, :-1], ids[:, 1:], vocab_size=dims.vocab_size,
                                          compute_entropy=False)[0]
            if backward:
                (-out.sum()).backward()
                dist.send(x.grad.contiguous(), other)
            return out.detach()

        with torch.no_grad():
            lp_plain = lp()
        names = apply_lora(chunks, LoraConfig(rank=RANK, alpha=ALPHA, init="kaiming"))
        res = {"names": names,
               "init": {n: (m.lora_A.detach().clone(), m.lora_B.detach().clone()) for n, m in iter_lora_modules(chunks)}}
        with torch.no_grad():  # fresh adapters: B = 0, the base model exactly
            fresh = lp()
            res["fresh_diff"] = None if fresh is None else (fresh - lp_plain).abs().max().item()
        load_hf_lora(chunks, adapter, dims, tp_rank, layout.tp)
        res["shards"] = {n: (m.lora_A.detach().clone(), m.lora_B.detach().clone()) for n, m in iter_lora_modules(chunks)}

        with torch.no_grad(), lora_disabled(chunks):
            res["logprobs_base"] = lp()
        res["logprobs"] = lp(backward=True)
        if tf_config.sequence_parallel:  # finalize_model_grads' sum over TP of sequence-parallel params' grads
            for p in lora_parameters(chunks):
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=mpu.get_tensor_model_parallel_group())
        base = [(n, p) for n, p in model.named_parameters() if not is_lora_param(n)]
        res["base_untouched"] = all(p.grad is None and not p.requires_grad for _, p in base)
        res["n_base"] = len(base)
        res["lora_grads"] = {n: (m.lora_A.grad.clone(), m.lora_B.grad.clone()) for n, m in iter_lora_modules(chunks)}

        # merged weights: W + scaling * B @ A in the base's layout, adapters off -> the adapted model
        merged = dict(merged_named_parameters(chunks))
        params = dict(global_named_parameters(model))
        saved = {n: params[n].detach().clone() for n in merged}
        with torch.no_grad(), lora_disabled(chunks):
            for n, t in merged.items():
                params[n].copy_(t)
            res["logprobs_merged"] = lp()
            for n, t in saved.items():
                params[n].copy_(t)

        before = {n: p.detach().clone() for n, p in base}
        lora_before = [p.detach().clone() for p in lora_parameters(chunks)]
        opt = torch.optim.AdamW(lora_parameters(chunks), lr=1e-2, weight_decay=0.1)
        opt.step()
        res["base_bit_identical"] = all(torch.equal(p, before[n]) for n, p in base)
        res["adapters_moved"] = all(not torch.equal(p, q) for p, q in zip(lora_parameters(chunks), lora_before))
        res["tp_rank"] = tp_rank
        res["first_layer"] = model.decoder.layers[0].layer_number - 1
        out[key] = res
    return out


@pytest.fixture(scope="module")
def assets(tiny_assets):
    path = str(tiny_assets[FAM])
    adapter = random_adapter(path)
    return path, adapter, spawn_local(_worker, 2, path, adapter, timeout=300)


@pytest.fixture(scope="module")
def peft_reference(assets):
    """HF + peft with the same adapter: (log-probs, log-probs with adapters off, {module: (dA, dB)})."""
    import peft
    from transformers import AutoModelForCausalLM

    path, adapter, _ = assets
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=HF_TARGETS,
                                                    lora_dropout=0.0, init_lora_weights=True)).eval()
    mods = {}
    with torch.no_grad():
        for name, mod in pm.named_modules():
            if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
                hf = name.removeprefix("base_model.model.")
                a, b = adapter[hf]
                mod.lora_A["default"].weight.copy_(a)
                mod.lora_B["default"].weight.copy_(b)
                mods[hf] = mod
    assert set(mods) == set(adapter)
    ids = make_ids()
    logp = _logprobs(pm(ids).logits, ids)
    (-logp.sum()).backward()
    grads = {k: (m.lora_A["default"].weight.grad.clone(), m.lora_B["default"].weight.grad.clone())
             for k, m in mods.items()}
    with torch.no_grad(), pm.disable_adapter():
        base = _logprobs(pm(ids).logits, ids)
    return logp.detach(), base, grads


def _dims(path, tp=1):
    from megappo.models.gpt import load_hf_config
    from megappo.parallel.weight_mapping import ModelDims

    return ModelDims.from_hf_config(load_hf_config(path), tp=tp)


def _by_module(outs, layout, key):
    """{global module name: [value of TP rank 0, 1, ...]} over every rank of a layout's run (a module
    held by several ranks with the same TP rank, e.g. data-parallel replicas, counted once)."""
    found = {}
    for o in outs:
        r = o[layout]
        for name, v in r[key].items():
            found.setdefault(name, {}).setdefault(r["tp_rank"], v)
    return {n: [d[i] for i in sorted(d)] for n, d in found.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_match_peft(assets, peft_reference, layout):
    _, _, outs = assets
    ref, ref_base, _ = peft_reference
    assert (ref - ref_base).abs().max() > 0.05  # the adapter changes the model: the check has teeth
    names, checked = set(), 0
    for o in outs:
        r = o[layout]
        names.update(r["names"])
        if r["logprobs"] is None:  # a first pipeline stage
            continue
        checked += 1
        diff = (r["logprobs"] - ref).abs().max().item()
        base_diff = (r["logprobs_base"] - ref_base).abs().max().item()
        merged_diff = (r["logprobs_merged"] - r["logprobs"]).abs().max().item()
        print(f"{layout} rank {r['tp_rank']}: max|dlogp| lora vs peft {diff:.2e}, adapters off vs HF {base_diff:.2e}, "
              f"merged vs lora {merged_diff:.2e}, fresh adapters vs base {r['fresh_diff']:.1e}")
        assert diff <= 1e-4 and base_diff <= 1e-4 and merged_diff <= 1e-5
        assert r["fresh_diff"] == 0.0  # B starts at zero
    assert checked >= 1
    assert len(names) == 4 * 4  # 4 layers x qkv, proj, fc1, fc2: global names over the pipeline stages
    if LAYOUTS[layout].pp > 1:
        assert sorted(o[layout]["first_layer"] for o in outs) == [0, 2]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_backward_reaches_adapters_only_with_peft_gradients(assets, peft_reference, layout):
    path, _, outs = assets
    _, _, ref_grads = peft_reference
    dims = _dims(path)
    for o in outs:
        assert o[layout]["base_untouched"] and o[layout]["n_base"] > 0
    grads = _by_module(outs, layout, "lora_grads")
    assert len(grads) == 16
    worst = 0.0
    for name, per_rank in grads.items():
        got = megatron_lora_to_hf(name, [g[0] for g in per_rank], [g[1] for g in per_rank], dims)
        # a fused module's one A is peft's A's shared: its gradient is the sum of theirs
        ref_a = sum(ref_grads[m][0] for m in got)
        for m, (ga, gb) in got.items():
            torch.testing.assert_close(ga, ref_a, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(gb, ref_grads[m][1], atol=1e-5, rtol=1e-4)
            worst = max(worst, (ga - ref_a).abs().max().item(), (gb - ref_grads[m][1]).abs().max().item())
        assert ref_a.abs().max() > 0
    print(f"{layout}: max |grad - peft grad| {worst:.2e}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_optimizer_step_over_adapters_leaves_base_bit_identical(assets, layout):
    for o in assets[2]:
        assert o[layout]["base_bit_identical"] and o[layout]["adapters_moved"]


def test_tp2_shards_round_trip_to_the_peft_layout(assets):
    path, adapter, outs = assets
    dims = _dims(path, tp=2)
    shards = _by_module(outs, "tp2", "shards")
    back = {}
    for name, per_rank in shards.items():
        back.update(megatron_lora_to_hf(name, [s[0] for s in per_rank], [s[1] for s in per_rank], dims))
    assert set(back) == set(adapter)
    for k, (a, b) in adapter.items():
        assert torch.equal(back[k][0], a) and torch.equal(back[k][1], b), k
    # column-parallel: A whole on each rank, B split; row-parallel: A split, B whole
    a0, b0 = shards["decoder.layers.0.self_attention.linear_qkv"][0]
    assert a0.shape == (RANK, 128) and b0.shape == ((4 + 2 + 2) * 32 // 2, RANK)
    a1, b1 = shards["decoder.layers.0.mlp.linear_fc2"][0]
    assert a1.shape == (RANK, 256 // 2) and b1.shape == (128, RANK)


def test_initial_adapters_are_the_same_at_every_layout(assets):
    """A from a per-module seed (the full A, then this rank's slice): TP1, TP2 and PP2 start from the same
    adapter; B starts at zero; A is peft's kaiming-uniform (|A| <= 1/sqrt(in))."""
    path, _, outs = assets
    dims = _dims(path, tp=2)
    full = {}
    for layout in LAYOUTS:
        hf = {}
        for name, per_rank in _by_module(outs, layout, "init").items():
            hf.update(megatron_lora_to_hf(name, [s[0] for s in per_rank], [s[1] for s in per_rank], dims))
        full[layout] = hf
    ref = full["tp1"]
    assert len(ref) == 7 * 4
    for layout, hf in full.items():
        for k, (a, b) in hf.items():
            assert torch.equal(a, ref[k][0]) and not b.any(), (layout, k)
    a = ref["model.layers.0.mlp.down_proj"][0]
    assert a.abs().max() <= 256 ** -0.5 and a.abs().max() > 0.5 * 256 ** -0.5


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="lora.rank must be a positive integer"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="lora.rank"):
        LoraConfig(rank=-4)
    with pytest.raises(ValueError, match=r"HF's q_proj is megatron's linear_qkv"):
        LoraConfig(target_modules=["q_proj"])
    with pytest.raises(ValueError, match="match no column/row-parallel linear"):
        apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(target_modules=["linear_qkv"]))
    a = torch.ones(RANK, 8)
    hf = {f"model.layers.0.self_attn.{p}_proj": (a if p != "v" else a * 2, torch.ones(64 if p == "q" else 32, RANK))
          for p in "qkv"}
    dims = _dims_tiny()
    with pytest.raises(ValueError, match="one lora_A shared"):
        hf_lora_to_megatron("decoder.layers.0.self_attention.linear_qkv", hf, dims)


def _dims_tiny():
    from megappo.parallel.weight_mapping import ModelDims

    return ModelDims.from_hf_dict(dict(model_type="llama", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=10,
                                       rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu"))


def _gather_from_a_ddp_engine(rank, world, port, path):
    """A training engine (megatron's DDP: every adapter a view into one flat param buffer) gathers its adapter:
    (the flat buffer's bytes, the bytes each rank pickled for the gather, the adapter's own bytes)."""
    import pickle

    import torch.distributed as dist

    from megappo.config.schema import OptimConfig
    from megappo.models.lora import iter_lora_modules
    from megappo.models.lora_peft import gather_hf_lora
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine

    init_distributed(rank, world, "127.0.0.1", port, backend="gloo")
    init_megatron(ParallelLayout(dp=world), seed=SEED)
    eng = MegatronEngine(path, ParallelLayout(dp=world), EngineConfig(
        device="cpu", optim=OptimConfig(lr=1e-3), seed=SEED, lora=LoraConfig(rank=RANK, alpha=ALPHA)))
    mods = [m for _, m in iter_lora_modules(eng.inner_chunks())]
    buffer = max(m.lora_A.untyped_storage().nbytes() for m in mods)
    own = sum(p.numel() * p.element_size() for m in mods for p in (m.lora_A, m.lora_B))
    sent, gather = [], dist.all_gather_object

    def measured(out, obj, *a, **kw):
        sent.append(len(pickle.dumps(obj)))
        return gather(out, obj, *a, **kw)

    dist.all_gather_object = measured
    try:
        got = gather_hf_lora(eng.inner_chunks(), eng.dims, everywhere=True)
    finally:
        dist.all_gather_object = gather
    assert got
    return buffer, sum(sent), own


def test_gathered_adapters_carry_their_own_bytes_not_ddp_buffer(tiny_assets):
    """gather_hf_lora sends each adapter tensor as an object: a param is a view into DDP's flat buffer, and a
    pickled view carries its whole storage. It did: SmolLM2 at rank 16 peaked at 22 GB in the first adapter
    sync (the node's memory: a worker killed). What each rank pickles is now its adapters' own bytes."""
    (buffer, sent, own), _ = spawn_local(_gather_from_a_ddp_engine, 2, str(tiny_assets[FAM]), timeout=300)
    assert buffer >= own / 2, (buffer, own)  # one adapter's storage holds (about) all of them: DDP's buffer
    assert own <= sent <= 1.5 * own + 20_000, (sent, own)  # tensors + names and pickle framing
