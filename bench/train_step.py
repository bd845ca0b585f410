"""Benchmark: one MegatronEngine train step (actor, PPO-style loss) on the tiny model under TP1, TP2,
PP2 and TP2xPP2 (CPU/gloo here, nccl on GPU). Prints one JSON object: per layout the median step time
and tokens/s over --steps steps after --warmup. Not a timed test.

    .venv/bin/python bench/train_step.py [--model assets/tiny-llama] [--batch 8] [--seq 128] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _worker(rank, world, port, model, layout, batch, seq, resp, mbs, warmup, steps, dtype="fp32"):
    import torch

    from megappo.parallel.megatron_init import destroy, init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    params_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]  # bf16: fp32 main params in the optimizer
    eng = MegatronEngine(model, layout, EngineConfig(optim=OptimConfig(lr=1e-5), params_dtype=params_dtype))
    g = torch.Generator().manual_seed(0)
    data = {"input_ids": torch.randint(0, eng.dims.vocab_size, (batch, seq), generator=g),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            "advantages": torch.randn(batch, resp, generator=g)}

    def loss_fn(out, mb):
        return -(out["logprobs"] * mb["advantages"]).sum(), {}

    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        eng.train_step(data, loss_fn, normalizer=batch * resp, response_length=resp, micro_batch_size=mbs)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    destroy()
    return times


def main() -> None:
    from megappo.parallel.launch import spawn_local
    from megappo.parallel.layout import ParallelLayout
    from megappo.assets import ensure_assets

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the tiny llama under assets/)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layouts", default="tp1,tp2,pp2,tp2pp2")
    p.add_argument("--dtypes", default="fp32", help="comma list of fp32, bf16 (Megatron bf16 mixed precision)")
    a = p.parse_args()
    model = a.model or str(ensure_assets("assets")["tiny-llama"])
    layouts = {"tp1": ParallelLayout(), "tp2": ParallelLayout(tp=2), "pp2": ParallelLayout(pp=2),
               "tp2pp2": ParallelLayout(tp=2, pp=2)}
    report = {"model": model, "batch": a.batch, "seq": a.seq, "response": a.response,
              "micro_batch_size": a.micro_batch_size, "layouts": {}}
    for name in a.layouts.split(","):
        for dtype in a.dtypes.split(","):
            lay = layouts[name]
            per_rank = spawn_local(_worker, lay.world_size, model, lay, a.batch, a.seq, a.response,
                                   a.micro_batch_size, a.warmup, a.steps, dtype, timeout=1800)
            step = [max(ts) for ts in zip(*per_rank)]  # a step ends when the slowest rank ends
            med = statistics.median(step)
            key = str(lay) if a.dtypes == "fp32" else f"{lay} {dtype}"
            report["layouts"][key] = {"world_size": lay.world_size, "dtype": dtype, "step_time_s": round(med, 4),
                                      "tokens_per_s": round(a.batch * a.seq / med, 1)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
