"""Benchmark: what a checkpoint of one trained role costs a step, as JSON. One MegatronEngine (model +
DistributedOptimizer after one train step) per rank, then a blocking save and a background save
(trainer.async_save) of the same state, each timed by part:
  state_dict_s   building the sharded state dict (the optimizer's fully-reshardable gather over DP)
  blocking_s     megatron dist_checkpointing.save, files and metadata written
  background_s   the same save with background=True: what the step waits before training goes on
  finish_s       BackgroundSave.finish() right after (the thread's remaining writes + metadata)
  bytes          the checkpoint's size on disk
--profile N prints the N slowest functions (cumulative) of rank 0's blocking save to stderr.

    .venv/bin/python bench/checkpoint.py [--model assets/tiny-llama] [--dp 2] [--dtype bf16] [--profile 25]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _worker(rank, world, port, model, dtype, out, profile):
    import torch

    from megappo.parallel import dist_checkpoint
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import destroy, init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout(dp=world)
    init_megatron(layout)
    eng = MegatronEngine(model, layout, EngineConfig(
        optim=OptimConfig(lr=1e-6), params_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]))
    g = torch.Generator().manual_seed(rank)
    data = {"input_ids": torch.randint(0, eng.dims.vocab_size, (2, 32), generator=g),
            "attention_mask": torch.ones(2, 32, dtype=torch.long), "advantages": torch.randn(2, 16, generator=g)}
    eng.train_step(data, lambda o, mb: (-(o["logprobs"] * mb["advantages"]).sum(), {}), normalizer=32,
                   response_length=16, micro_batch_size=2)
    times = {}
    t = time.perf_counter()
    eng._sharded_state_dict(is_loading=False)
    times["state_dict_s"] = time.perf_counter() - t

    prof = None
    if profile and rank == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    eng.save_checkpoint(Path(out) / "blocking")
    times["blocking_s"] = time.perf_counter() - t
    if prof is not None:
        import io
        import pstats
        import sys

        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(profile)
        print(s.getvalue(), file=sys.stderr)
    t = time.perf_counter()
    eng.save_checkpoint(Path(out) / "background", background=True)
    times["background_s"] = time.perf_counter() - t
    t = time.perf_counter()
    eng.finish_save()
    times["finish_s"] = time.perf_counter() - t
    destroy()
    return times


def main() -> None:
    from megappo.assets import ensure_assets
    from megappo.parallel.launch import spawn_local

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the tiny llama under assets/)")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--profile", type=int, default=0)
    a = p.parse_args()
    model = a.model or str(ensure_assets("assets")["tiny-llama"])
    with tempfile.TemporaryDirectory(prefix="megappo-ckpt-bench-") as out:
        per_rank = spawn_local(_worker, a.dp, model, a.dtype, out, a.profile, timeout=1800)
        size = sum(f.stat().st_size for f in Path(out, "blocking").rglob("*") if f.is_file())
    report = {"model": model, "dp": a.dp, "dtype": a.dtype, "bytes": size,
              **{k: round(max(r[k] for r in per_rank), 3) for k in per_rank[0]}}  # the slowest rank
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
