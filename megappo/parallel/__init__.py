"""Parallelism for a plain model, applied from the outside. Knows nothing about PPO.

layout.py          ParallelLayout(tp, pp, vpp, dp): rank <-> (dp, pp, tp) in megatron's rank order
megatron_init.py   torch.distributed + megatron parallel_state bring-up / tear-down
cpu_compat.py      the only place that makes megatron-core run on a CPU torch
model_dims.py      ModelDims: a model's shapes from its HF config, the supported families, LoRA targets
weight_mapping.py  HF <-> Megatron names and tensor layouts (one source of truth)
"""

from megappo.parallel.layout import ParallelLayout

__all__ = ["ParallelLayout"]
