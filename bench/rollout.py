"""Rollout-phase benchmark: `VLLMRollout.generate_sequences(DataProto)` (request building, per-request
seeds, log-probs, truncation, padding into tensors, n-interleaving) vs a bare `llm.generate` of the
same prompts on the same engine. Prints one JSON object:

  rollout_s        median seconds of generate_sequences
  bare_same_s      bare llm.generate with the same per-request SamplingParams (seed, logprobs=0):
                   the engine's own cost of what the rollout asks for; ratio = rollout_s / bare_same_s
                   (target <= 1.15)
  bare_plain_s     bare llm.generate with one SamplingParams(n=N), no seeds, no log-probs (for scale)
  rss_after_init_mb  this process's resident memory once the engine is built (direct + packed keeps a
                   plain copy of the linear weights next to the packed kernels)

    python bench/rollout.py [--model DIR] [--prompts 64] [--n 4] [--max-new-tokens 64] [--reps 5]
                            [--weight-load auto|direct|reload] [--cpu-linear packed|plain]
                            [--dtype fp32|bf16] [--kv-cache-mb 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the tiny llama asset)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--weight-load", default="auto", help="rollout.weight_load: auto, direct or reload")
    p.add_argument("--cpu-linear", default="packed", help="rollout.cpu_linear: packed (oneDNN) or plain (torch "
                   "linears; needs direct); compare tokens_per_s")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="vLLM's dtype (model.dtype)")
    p.add_argument("--kv-cache-mb", type=int, default=64, help="rollout.kv_cache_memory_mb")
    args = p.parse_args(argv)

    import random

    from megappo.config.schema import RolloutConfig
    from megappo.protocol import DataProto
    from megappo.assets import ensure_assets
    from megappo.workers.rollout.vllm_rollout import VLLMRollout, left_pad

    model = args.model or ensure_assets(REPO / "assets")["tiny-llama"]
    cfg = RolloutConfig(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                        kv_cache_memory_mb=args.kv_cache_mb, weight_load=args.weight_load,
                        cpu_linear=args.cpu_linear)
    t0 = time.perf_counter()
    rollout = VLLMRollout(model, cfg, seed=0, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
                          max_model_len=256)
    init_s = time.perf_counter() - t0
    rss_mb = _rss_mb()  # the engine's weights (+ a plain copy of the linears with direct + packed) and KV
    tok = rollout.tokenizer
    rng = random.Random(0)
    words = "what is the answer to one plus two times three solve step by step water number".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) for _ in range(args.prompts)]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    batch = DataProto.from_dict(left_pad(ids, tok.pad_token_id), {"idx": list(range(len(ids)))})

    from vllm import SamplingParams

    llm = rollout.llm
    spec = rollout.default_sampling
    s, n = spec.vllm_kwargs(), spec.num_samples
    base = 12345
    reqs = [{"prompt_token_ids": t} for t in ids for _ in range(n)]

    def rollout_call():
        return rollout.generate_sequences(DataProto(batch.batch, batch.non_tensor_batch, {"sampling": spec.with_seed(base)}))

    def bare_same():
        params = [SamplingParams(seed=base + k, logprobs=0, **s) for k in range(len(reqs))]
        return llm.generate(reqs, params, use_tqdm=False)

    def bare_plain():
        return llm.generate([{"prompt_token_ids": t} for t in ids], SamplingParams(n=n, **s), use_tqdm=False)

    t0 = time.perf_counter()
    out = rollout_call()  # warm-up (the first generate is slow)
    bare_same()
    warm_s = time.perf_counter() - t0
    times = {"rollout": [], "bare_same": [], "bare_plain": []}
    fns = {"rollout": rollout_call, "bare_same": bare_same, "bare_plain": bare_plain}
    for _ in range(args.reps):  # interleaved, so machine-load drift hits all three alike
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    gen_tokens = int(out.batch["response_mask"].sum())
    print(json.dumps({
        "model": str(model), "dtype": args.dtype, "weight_load": args.weight_load, "cpu_linear": args.cpu_linear,
        "prompts": args.prompts, "n": n, "max_new_tokens": args.max_new_tokens,
        "generated_tokens": gen_tokens, "init_s": round(init_s, 2), "rss_after_init_mb": rss_mb, "warmup_s": round(warm_s, 2),
        "rollout_s": round(med["rollout"], 4), "bare_same_s": round(med["bare_same"], 4),
        "bare_plain_s": round(med["bare_plain"], 4),
        "ratio": round(med["rollout"] / med["bare_same"], 3),
        "ratio_vs_plain": round(med["rollout"] / med["bare_plain"], 3),
        "tokens_per_s": round(gen_tokens / med["rollout"], 1),
        "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }), flush=True)


if __name__ == "__main__":
    main()
