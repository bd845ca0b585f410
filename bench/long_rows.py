"""Long rows under context parallelism (issue #72): one row of S tokens trained by MegatronEngine (fp32, gloo, one
optimizer step per length) at CP1 / 2 / 4, with the row's tokens split zigzag over the CP ranks (megappo's own CP
attention, K/V all-gathered: context_parallel.py's "chunks" path, flash per chunk with no mask, and its "mask"
path, one SDPA call against a boolean mask of L x cp*L, L = S / cp). Per cp, attention path (--impls) and length:
the step's peak resident memory on the largest rank (VmHWM after resetting it through /proc/self/clear_refs, so
the model build does not count), how much the step adds to what the rank held before it (activations, attention's
mask and gathered K/V, gradients' first touch) and the step time; then the longest row (doubling) whose step stays under
--cap-gb per rank. Prints one JSON object; --png draws peak memory against length per cp.

    .venv/bin/python bench/long_rows.py [--lengths 1024,2048,4096] [--cps 1,2,4] [--cap-gb 1.5]
        [--max-len 32768] [--hidden 256] [--layers 4] [--impls chunks,mask] [--png docs/long_rows.png]

The model is a llama built from a config (random weights, --hidden, --layers, 8 heads / 4 KV heads, vocab 1024,
positions --max-len), so only the shapes matter. On the 2-core dev machine CP4 runs 4 processes on 2 cores:
step times there say what the split costs in compute, not what 4 GPUs would take. Memory is per rank.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_model(out: Path, hidden: int, layers: int, positions: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1024, max_position_embeddings=positions,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def _peak_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)


def _status_gb(key: str) -> float:
    """VmHWM (the peak resident set since the last reset) or VmRSS (now), in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError(f"no {key} in /proc/self/status")


def _row(n: int):
    import torch

    g = torch.Generator().manual_seed(n)
    ids = torch.randint(1, 1024, (1, n), generator=g)
    ones = torch.ones(1, n, dtype=torch.long)
    R = n // 2  # the response: the row's second half
    mask = torch.ones(1, R, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": ones, "response_mask": mask,
            "advantages": torch.randn(1, R, generator=g), "old_log_probs": torch.zeros(1, R)}, R


def _loss(outs, mb):
    m = mb["response_mask"].float()
    return -(outs["logprobs"] * mb["advantages"] * m).sum(), {}


def _worker(rank, world, port, model, lengths, cap_gb, max_len, impl):
    import torch.distributed as dist

    from megappo.parallel import context_parallel

    context_parallel.CP_ATTENTION = impl

    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout(cp=world)
    init_megatron(layout)
    eng = MegatronEngine(model, layout, EngineConfig(optim=OptimConfig(lr=1e-5), pack_sequences=True))

    def step(n: int) -> tuple[float, float, float]:
        """(the largest rank's peak RSS in the step, its growth over the RSS before it, seconds)."""
        batch, R = _row(n)
        _peak_reset()
        before = _status_gb("VmRSS")
        dist.barrier()
        t = time.perf_counter()
        eng.train_step(batch, _loss, float(R), response_length=R, micro_batch_size=1)
        seconds = time.perf_counter() - t
        peaks = [None] * world
        dist.all_gather_object(peaks, (_status_gb("VmHWM"), _status_gb("VmHWM") - before))
        return max(p for p, _ in peaks), max(g for _, g in peaks), seconds

    step(min(lengths))  # warm-up: the optimizer's state, first-call allocations
    measured = {}
    for n in lengths:
        gb, growth, s = step(n)
        measured[str(n)] = {"peak_rank_gb": round(gb, 3), "step_growth_rank_gb": round(growth, 3), "step_s": round(s, 3)}
    longest, n = None, min(lengths)
    while n <= max_len:  # doubling: the longest row (a power of two times the shortest) under the cap
        gb = measured[str(n)]["peak_rank_gb"] if str(n) in measured else step(n)[0]
        if gb > cap_gb:
            break
        longest, n = n, 2 * n
    return {"by_length": measured, "longest_under_cap": longest}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--cap-gb", type=float, default=1.5)
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--impls", default="chunks,mask", help="CP attention paths to run at cp > 1 (context_parallel."
                   "CP_ATTENTION): chunks (flash per chunk, no mask) and / or mask (one SDPA call, L x cp*L mask)")
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    from megappo.parallel.launch import spawn_local

    lengths = [int(x) for x in args.lengths.split(",")]
    cps = [int(x) for x in args.cps.split(",")]
    report = {"model": {"hidden": args.hidden, "layers": args.layers, "heads": 8, "kv_heads": 4, "dtype": "fp32"},
              "cap_gb_per_rank": args.cap_gb, "cp": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "model", args.hidden, args.layers, args.max_len))
        for cp in cps:
            for impl in args.impls.split(",") if cp > 1 else ["auto"]:
                name = f"{cp}" if cp == 1 else f"{cp}_{impl}"
                print(f"cp={cp} {impl} ...", file=sys.stderr, flush=True)
                res = spawn_local(_worker, cp, model, lengths, args.cap_gb, args.max_len, impl, timeout=3600,
                                  threads=1)
                report["cp"][name] = res[0]
    base = report["cp"][next(iter(report["cp"]))]["by_length"]
    n = max(lengths)
    for key in ("peak_rank_gb", "step_growth_rank_gb", "step_s"):  # at the longest measured length, vs the first cp
        report[f"{key}_ratio_at_{n}"] = {c: round(r["by_length"][str(n)][key] / base[str(n)][key], 3)
                                         for c, r in report["cp"].items()}
    print(json.dumps(report, indent=1))
    if args.png:
        plot(report, lengths, Path(args.png))
    return 0


def plot(report: dict, lengths: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for cp, r in report["cp"].items():
        ax.plot(lengths, [r["by_length"][str(n)]["step_growth_rank_gb"] for n in lengths], marker="o",
                label=f"CP{cp}".replace("_", " "))
    ax.set_xlabel("row length (tokens)")
    ax.set_ylabel("memory the step adds per rank (GB)")
    ax.set_xscale("log", base=2)
    ax.set_title("One long row, one optimizer step (fp32, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
