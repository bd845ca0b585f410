"""Padding vs packing on a long-tailed batch: the real model's own samples (vLLM, temperature 1.0, up to
--max-new-tokens) scored and trained by MegatronEngine three ways: padded (today's default), packed
(pack_sequences: micro_batch_size rows per packed micro-batch), packed + token budget
(max_tokens_per_micro_batch), and for before / after in one run: packed_budget_rows, the budget variant
with the former packed attention (one SDPA call per row in fp32, models/packed_attention.IMPL = "rows"),
and packed_budget_full_window, the budget variant with every micro-batch's LM / value head over the
batch's longest response R instead of its own (workers/packing.TRIM_RESPONSES = False). Prints one JSON object: the batch's length spread, and per variant the log-prob forward, the
actor update and the critic update times and tokens computed / real.

    .venv/bin/python bench/packing.py [--model assets/smollm2-135m-instruct] [--responses 64]
        [--max-new-tokens 512] [--micro-batch-size 4] [--max-tokens 2048] [--dtype bf16] [--batch FILE]
        [--variants padded,packed,packed_budget,packed_budget_rows,packed_budget_full_window] [--heads lm,value]

The batch is generated once and kept in --batch (safetensors; reused when present); --synthetic makes a
timing stand-in without vLLM instead (random token ids, prompts of 55-74 tokens, response lengths
lognormal around 203 clipped to [7, 512]: the same shape of long tail; times do not depend on the ids).
One process (DP1), one thread per torch op pool as the trainer's workers have; ratios are from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def make_batch(model: str, responses: int, max_new_tokens: int, dtype: str, out: Path) -> None:
    """`responses` samples of the SmolLM2 task's prompts (8 per prompt) at temperature 1.0, saved to `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from megappo.config.schema import RolloutConfig
    from megappo.data.dataset import RLHFDataset
    from megappo.data.preprocess_arithmetic import main as make_data
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    data = out.parent / "packing_prompts"
    make_data(["--out", str(data), "--held-out", "--max-operand", "30", "--val-size", "8", "--train-size", "64",
               "--instruction", "Explain your reasoning, then give the number."])
    tok = AutoTokenizer.from_pretrained(model)
    ds = RLHFDataset([str(data / "arith_train.parquet")], tok, "prompt", 128, True)
    n = 8
    cfg = RolloutConfig(n=n, temperature=1.0, max_new_tokens=max_new_tokens, kv_cache_memory_mb=1024)
    rollout = VLLMRollout(model, cfg, seed=0, dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype],
                          max_model_len=128 + max_new_tokens)
    prompts = ds.get_batch(range(responses // n))
    prompts.meta_info["sampling"] = SamplingSpec.from_config(cfg).with_seed(1)
    t = time.perf_counter()
    gen = rollout.generate_sequences(prompts)
    print(f"generated {len(gen)} responses in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    b = gen.batch
    save_file({k: b[k].contiguous() for k in ("input_ids", "attention_mask", "position_ids", "response_mask")},
              str(out), metadata={"response_length": str(max_new_tokens)})
    del rollout
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


VARIANTS = ("padded", "packed", "packed_budget", "packed_budget_rows", "packed_budget_full_window")


def make_synthetic_batch(responses: int, max_new_tokens: int, out: Path) -> None:
    """A long-tailed batch of random ids in the rollout's layout (left-padded prompts in 128 columns,
    right-padded responses in max_new_tokens), seed 0."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    b, p, r = responses, 128, max_new_tokens
    resp = (torch.exp(torch.randn(b, generator=g) * 0.8) * 203).round().clamp(7, r).long()
    prompt = torch.randint(55, 75, (b,), generator=g)
    ids = torch.randint(100, 49000, (b, p + r), generator=g)
    mask = torch.zeros(b, p + r, dtype=torch.long)
    for i in range(b):
        mask[i, p - prompt[i]:p] = 1
        mask[i, p:p + resp[i]] = 1
    save_file({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
               "response_mask": mask[:, p:].clone()}, str(out), metadata={"response_length": str(r)})


def _worker(rank, world, port, model, batch_path, dtype, mbs, max_tokens, reps, names=VARIANTS,
            heads=("lm", "value")):
    import statistics

    import torch
    from safetensors.torch import load_file

    from megappo.models import packed_attention
    from megappo.parallel import device
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import destroy, init_distributed, init_megatron
    from megappo.workers import packing
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout()
    init_megatron(layout)
    data = load_file(batch_path)
    R = data["response_mask"].shape[1]
    g = torch.Generator().manual_seed(0)
    data["advantages"] = torch.randn(data["response_mask"].shape, generator=g)
    norm = float(data["response_mask"].sum())
    params_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    on = device.current()  # cuda where torch sees a GPU: the engine, its batches and the timers' syncs

    def now() -> float:
        if on == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def pg(out, mb):
        return -(out["logprobs"] * mb["advantages"] * mb["response_mask"]).sum(), {}

    def vf(out, mb):
        return (((out["values"] - mb["advantages"]) ** 2) * mb["response_mask"]).sum(), {}

    variants = {"padded": {}, "packed": {"pack_sequences": True},
                "packed_budget": {"pack_sequences": True, "max_tokens_per_micro_batch": max_tokens}}
    variants["packed_budget_rows"] = variants["packed_budget_full_window"] = variants["packed_budget"]
    report = {}
    for name in names:
        kw = variants[name]
        packed_attention.IMPL = "rows" if name.endswith("_rows") else "auto"
        packed_attention.COMPUTE_DTYPE = "fp32" if name.endswith("_rows") else None
        packing.TRIM_RESPONSES = not name.endswith("_full_window")
        row = {}
        for head, loss in (("lm", pg), ("value", vf)):
            if head not in heads:
                continue
            eng = MegatronEngine(model, layout, EngineConfig(head=head, optim=OptimConfig(lr=1e-6), device=on,
                                                             params_dtype=params_dtype, **kw))
            fwd, upd = [], []
            for _ in range(reps):
                t = now()
                eng.forward_only(data, response_length=R, micro_batch_size=mbs, compute_entropy=False)
                fwd.append(now() - t)
                t = now()
                step = eng.train_step(data, loss, norm, response_length=R, micro_batch_size=mbs, compute_entropy=False)
                upd.append(now() - t)
                computed = step["computed_tokens"]
            if head == "lm":
                row.update(logprob_s=round(statistics.median(fwd), 3), actor_update_s=round(statistics.median(upd), 3))
            else:
                row.update(critic_update_s=round(statistics.median(upd), 3))
            row.setdefault("tokens_computed", computed)
            del eng
        report[name] = row
    destroy()
    return report


def main() -> None:
    from megappo.parallel.launch import spawn_local

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "assets/smollm2-135m-instruct"))
    p.add_argument("--responses", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=2048, help="the packed_budget variant's token budget")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--batch", default=None, help="safetensors file holding the batch (generated when absent)")
    p.add_argument("--synthetic", action="store_true", help="random-id stand-in batch (no vLLM), see above")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--heads", default="lm,value", help="lm (log-prob pass, actor update), value (critic update)")
    a = p.parse_args()
    stem = f"synthetic_{a.responses}x{a.max_new_tokens}" if a.synthetic else \
        f"packing_{a.responses}x{a.max_new_tokens}_{a.dtype}"
    batch = Path(a.batch or REPO / f"outputs/bench/{stem}.safetensors")
    batch.parent.mkdir(parents=True, exist_ok=True)
    if not batch.is_file():
        if a.synthetic:
            make_synthetic_batch(a.responses, a.max_new_tokens, batch)
        else:
            make_batch(a.model, a.responses, a.max_new_tokens, a.dtype, batch)
    from safetensors.torch import load_file

    data = load_file(str(batch))
    lengths = data["response_mask"].sum(-1)
    real = int(data["attention_mask"].sum())
    names, heads = a.variants.split(","), tuple(a.heads.split(","))
    if "padded" not in names or not set(names) <= set(VARIANTS):
        p.error(f"--variants: padded (the baseline) and any of {VARIANTS}")
    runs = spawn_local(_worker, 1, a.model, str(batch), a.dtype, a.micro_batch_size, a.max_tokens, a.reps,
                       names, heads, timeout=7200)[0]
    for row in runs.values():
        row["computed_over_real"] = round(row["tokens_computed"] / real, 3)
    base = runs["padded"]
    for name, row in runs.items():
        for k in ("logprob_s", "actor_update_s", "critic_update_s"):
            if k in row:
                row[f"{k[:-2]}_speedup_vs_padded"] = round(base[k] / row[k], 2)
    print(json.dumps({"model": a.model, "dtype": a.dtype, "responses": int(lengths.numel()),
                      "response_tokens": {"min": int(lengths.min()), "median": int(lengths.median()),
                                          "max": int(lengths.max())},
                      "real_tokens": real, "padded_tokens": int(data["attention_mask"].numel()),
                      "padded_over_real": round(base["tokens_computed"] / real, 3),  # the most packing can save
                      "micro_batch_size": a.micro_batch_size, "max_tokens_per_micro_batch": a.max_tokens,
                      "variants": runs}, indent=2))


if __name__ == "__main__":
    main()
