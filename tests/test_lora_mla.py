"""LoRA on multi-latent attention (tiny DeepSeek-V3, fp32, CPU/gloo; models/lora.py): adapters on MLA's q / kv down
and up projections (each one column-parallel linear) and on linear_proj, at TP2 in two processes.

- fresh adapters (B = 0) give the base model exactly, and the reference (adapters off) stays the base;
- one optimizer step moves the policy and leaves every base weight bit-identical;
- the exported peft adapter (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj) loads onto the HF base and
  gives the engine's log-probs (<= 1e-4);
- the merged weight sync into vLLM (TP1 on each rank, CPU MLA, its absorbed W_UK_T / W_UV derived again after the
  load) after the step passes the fingerprint, and vLLM's log-probs of its greedy samples equal Megatron's (<= 1e-4).
"""

import os
from pathlib import Path

from test_lora_ppo import _hf_gap

MLA_TARGETS = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
HF_TARGETS = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}


def _worker(rank, world, port, path, peft_dir):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["MASTER_PORT"] = str(port)
    import torch

    from megappo.config.schema import RolloutConfig
    from megappo.models.lora import LoraConfig, iter_lora_modules
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.protocol import DataProto
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig
    from megappo.workers.rollout.hybrid_engine import HybridEngine
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import VLLMRollout, left_pad
    from test_megatron_engine import R, make_batch, pg_loss

    layout = ParallelLayout(tp=2)
    init_distributed(rank, world, master_port=port)
    init_megatron(layout, seed=7)
    engine = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(lr=3e-2),
                                                       lora=LoraConfig(rank=4, alpha=8.0, target_modules=MLA_TARGETS)))
    out = {"wrapped": sorted({n.rsplit(".", 1)[-1] for n, _ in iter_lora_modules(engine.inner_chunks())})}
    batch = make_batch()
    with engine.base_model():
        out["ref_lp"] = engine.forward_only(batch, R, 4)["logprobs"]
    out["lp0"] = engine.forward_only(batch, R, 4)["logprobs"]

    rollout = VLLMRollout(path, RolloutConfig(tp=1, n=1, temperature=1.0, max_new_tokens=8, kv_cache_memory_mb=16),
                          seed=0, dtype="float32", max_model_len=256)
    hybrid = HybridEngine(engine, rollout)
    tok = rollout.tokenizer
    texts = ["What is 3 + 4? The answer is", "the water is", "one two three", "a b"]
    prompts = DataProto.from_dict(left_pad([tok(t, add_special_tokens=False)["input_ids"] for t in texts],
                                           tok.pad_token_id), {"uid": [str(i) for i in range(len(texts))]})
    greedy = SamplingSpec(temperature=1.0, max_new_tokens=8).greedy()
    base0 = {k: v.detach().clone() for c in engine.inner_chunks() for k, v in c.named_parameters() if "lora_" not in k}
    engine.train_step(batch, pg_loss, batch["response_mask"].sum().item(), R, 2)
    with hybrid:  # the sync after the step: the merged weights W + s * B @ A with B moved
        gen = hybrid.generate_sequences(DataProto(prompts.batch, prompts.non_tensor_batch, {"sampling": greedy}))
    out["sync"] = {"ok": hybrid.metrics["rollout/weights_fingerprint_ok"],
                   **hybrid.logprob_parity(gen, micro_batch_size=2)}
    out["base_bit_identical"] = all(torch.equal(v, dict(c.named_parameters())[k])
                                    for c in engine.inner_chunks() for k, v in base0.items()
                                    if k in dict(c.named_parameters()))
    out["lp1"] = engine.forward_only(batch, R, 4)["logprobs"]
    engine.export_lora_adapter(peft_dir)
    engine.save_checkpoint(peft_dir + "_ckpt")
    engine.finish_save()
    return out


def test_lora_on_multi_latent_attention_through_vllm_and_peft(tiny_assets, tmp_path):
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megappo.parallel.launch import spawn_local

    path = str(tiny_assets["tiny-deepseek_v3"])
    res = spawn_local(_worker, 2, path, str(tmp_path / "peft"), timeout=600, threads=1)
    r = res[0]
    assert r["wrapped"] == sorted(MLA_TARGETS)
    assert torch.equal(r["lp0"], r["ref_lp"])  # B = 0: the base model exactly
    assert (r["lp1"] - r["lp0"]).abs().max().item() > 1e-3  # the step moved the policy
    assert all(o["base_bit_identical"] for o in res)
    sync = r["sync"]
    print(f"after the step: fingerprint {sync['ok']}, vLLM vs megatron max|dlogp| {sync['rollout/logprob_diff_max']:.2e}")
    assert sync["ok"] == 1.0 and sync["rollout/logprob_diff_max"] <= 1e-4, sync
    assert set(json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["target_modules"]) == HF_TARGETS
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                      str(tmp_path / "peft")).eval()
    gap = _hf_gap(model, r["lp1"])
    print(f"peft on HF DeepseekV3 vs megatron LoRA (MLA) log-probs after one step: {gap:.2e}")
    assert gap <= 1e-4

    # megappo export of the adapter checkpoint in bf16: every adapted MLA projection merged, the routers'
    # correction biases kept fp32 and bit for bit (they were rounded with every other tensor)
    from safetensors.torch import load_file

    from megappo.export import export_lora

    info = export_lora(tmp_path / "peft_ckpt", tmp_path / "merged", path, dtype="bfloat16")
    assert info["merged_modules"] == len(MLA_TARGETS) * 4  # the tiny model's 4 layers
    src = {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    got = {k: v for f in sorted((tmp_path / "merged").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    bias = [k for k in got if k.endswith("e_score_correction_bias")]
    assert bias and all(got[k].dtype == torch.float32 and torch.equal(got[k], src[k]) for k in bias)
    assert got["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
