"""Benchmark: MegatronEngine host offload (workers/offload.py) of an actor after a real train step.
Prints one JSON object per model:

  device_bytes_freed   params + optimizer states (copied to host) + grad buffers (dropped)
  offload_s / reload_s median seconds of engine.offload() / engine.reload()
  offload_gbps         bytes copied to host / offload_s (on GPU: the PCIe / C2C copy rate; on CPU a
                       host memcpy, reported for the mechanism's overhead only)
  step_s / step_offloaded_s   one train step resident vs one with reload + offload around it

    .venv/bin/python bench/offload.py [--models tiny,100m] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _worker(rank, world, port, model, reps):
    import torch

    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import destroy, init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    layout = ParallelLayout()
    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    eng = MegatronEngine(model, layout, EngineConfig(optim=OptimConfig(lr=1e-5, distributed_optimizer=True)))
    B, S, R = 4, 64, 32
    g = torch.Generator().manual_seed(0)
    data = {"input_ids": torch.randint(0, eng.dims.vocab_size, (B, S), generator=g),
            "attention_mask": torch.ones(B, S, dtype=torch.long), "advantages": torch.randn(B, R, generator=g)}

    def loss_fn(out, mb):
        return -(out["logprobs"] * mb["advantages"]).sum(), {}

    def step():
        eng.train_step(data, loss_fn, normalizer=B * R, response_length=R, micro_batch_size=2)

    step()  # Adam states exist from here on
    res = {"offload_s": [], "reload_s": [], "step_s": [], "step_offloaded_s": []}
    for _ in range(reps):
        t = time.perf_counter()
        step()
        res["step_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        freed = eng.offload()
        res["offload_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        eng.reload()
        res["reload_s"].append(time.perf_counter() - t)
    eng.config.offload = True  # from here on every public call reloads / offloads around itself
    eng.offload()
    copied = eng.offload_stats["host_bytes"]
    for _ in range(reps):
        t = time.perf_counter()
        step()  # reload, step, offload
        res["step_offloaded_s"].append(time.perf_counter() - t)
    params = sum(p.numel() for _, p in eng.named_parameters_global())
    destroy()
    out = {k: round(statistics.median(v), 4) for k, v in res.items()}
    out.update(params=params, device_bytes_freed=freed, bytes_copied_to_host=copied,
               offload_gbps=round(copied / max(out["offload_s"], 1e-9) / 1e9, 2))
    return out


def main(argv=None) -> None:
    from megappo.parallel.launch import spawn_local
    from megappo.assets import ensure_assets

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,100m", help="comma list: tiny, 100m, or a HF model dir")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--work", default=None, help="where to build the ~100M model (default: a temp dir)")
    a = p.parse_args(argv)
    assets = ensure_assets(REPO / "assets")
    for m in a.models.split(","):
        if m == "tiny":
            model = assets["tiny-llama"]
        elif m == "100m":
            from weight_sync import make_100m

            model = make_100m(Path(a.work or tempfile.mkdtemp(prefix="megappo_bench_")) / "llama-100m",
                              assets["tokenizer"])
        else:
            model = Path(m)
        r = spawn_local(_worker, 1, str(model), a.reps, timeout=900)[0]
        print(json.dumps({"model": m, **r}), flush=True)


if __name__ == "__main__":
    main()
