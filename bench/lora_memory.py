"""LoRA against full fine-tuning in one Megatron train step (issue #40: "the base frozen: no gradients, no
optimizer state, no grad buffers; measure the memory"): for each model shape, the actor engine (megatron
DDP + distributed optimizer, Megatron bf16 mixed precision on cuda) trained in full and with rank-r LoRA on
every linear, the same PPO-style loss on the same random batch. Per run: trainable parameters, the device
memory held after a step (weights, grad buffers, optimizer state), the peak during a step, and the median
step time. The weights are random (the shapes are real ones): time and memory do not depend on the values.
One process, one device; one JSON object. A run that does not fit is reported as {"out_of_memory": ...}.

    python bench/lora_memory.py [--device cuda] [--shapes smollm2-135m,llama-3.2-1b] [--rank 16]
    python bench/lora_memory.py --shapes llama-3.1-8b --batch 4 --micro-batch-size 1   # full: OOM on an H200
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

# HF llama configs of real models (tied embeddings as they ship); "tiny" is for a CPU check of this script
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
}


def random_model(shape: str, out: Path) -> str:
    """A randomly initialised HF llama of `shape`, saved as bf16 safetensors (with a tokenizer-free config)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{"tie_word_embeddings": True, **SHAPES[shape]}, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # an 8B model is initialised and written in half the time and memory
    try:
        LlamaForCausalLM(cfg).save_pretrained(out)
    finally:
        torch.set_default_dtype(default)
    return str(out)


def measure(path: str, device: str, dtype, rank: int, batch: int, seq: int, resp: int, mbs: int,
            warmup: int, steps: int) -> dict:
    from megappo.config.schema import OptimConfig
    from megappo.models.lora import LoraConfig
    from megappo.parallel.layout import ParallelLayout
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine

    cuda = device == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    lora = LoraConfig(rank=rank, alpha=2.0 * rank) if rank else None
    eng = MegatronEngine(path, ParallelLayout(), EngineConfig(device=device, params_dtype=dtype, seed=1,
                                                              optim=OptimConfig(lr=1e-5), lora=lora))
    trainable = sum(p.numel() for c in eng.inner_chunks() for p in c.parameters() if p.requires_grad)
    total = sum(p.numel() for c in eng.inner_chunks() for p in c.parameters())
    g = torch.Generator().manual_seed(0)
    data = {"input_ids": torch.randint(0, eng.dims.vocab_size, (batch, seq), generator=g).to(device),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device),
            "advantages": torch.randn(batch, resp, generator=g).to(device),
            "response_mask": torch.ones(batch, resp, device=device)}

    def loss_fn(out, mb):
        m = mb["response_mask"]
        return -(out["logprobs"] * mb["advantages"] * m).sum(), {"tokens": m.sum()}

    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        eng.train_step(data, loss_fn, float(batch * resp), response_length=resp, micro_batch_size=mbs)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    out = {"params": total, "trainable": trainable, "step_s": round(statistics.median(times), 4),
           "tokens_per_s": round(batch * seq / statistics.median(times))}
    if cuda:
        out["held_after_step_gb"] = round((torch.cuda.memory_allocated() - start) / 1e9, 3)
        out["peak_gb"] = round((torch.cuda.max_memory_allocated() - start) / 1e9, 3)
    del eng, data
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    bad = [s for s in args.shapes.split(",") if s not in SHAPES]
    if bad:
        p.error(f"--shapes {','.join(bad)}: choose from {', '.join(SHAPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device; use --device cpu")
    dtype = torch.bfloat16 if (args.dtype or ("bf16" if args.device == "cuda" else "fp32")) == "bf16" else torch.float32
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from megappo.parallel.launch import free_port
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron

    init_distributed(0, 1, "127.0.0.1", free_port(), backend="cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
    init_megatron(ParallelLayout(), seed=1)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "rank": args.rank,
              "batch": [args.batch, args.seq, args.response, args.micro_batch_size], "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            path = random_model(shape, Path(tmp) / shape)
            runs = {}
            # LoRA first: a full fine-tuning run that does not fit (a result too) is the last on the device
            for name, r in ((f"lora_r{args.rank}", args.rank), ("full", 0)):
                try:
                    runs[name] = measure(path, args.device, dtype, r, args.batch, args.seq, args.response,
                                         args.micro_batch_size, args.warmup, args.steps)
                except torch.cuda.OutOfMemoryError as e:
                    runs[name] = {"out_of_memory": str(e).splitlines()[0][:200]}
            full, lora = runs["full"], runs[f"lora_r{args.rank}"]
            if "peak_gb" in full and "peak_gb" in lora:
                runs["lora_over_full"] = {k: round(lora[k] / full[k], 3) for k in ("held_after_step_gb", "peak_gb",
                                                                                    "step_s")}
            result["runs"][shape] = runs
            print(json.dumps({shape: runs}), file=sys.stderr, flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
