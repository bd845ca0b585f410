"""Which device a process computes on: one value, decided once, read everywhere.

The driver resolves `resources.device` (auto | cpu | cuda) against the cluster (`resolve`) and starts
every worker with `worker_env(device)`: MEGAPPO_DEVICE=cpu|cuda, and for CPU workers an empty
CUDA_VISIBLE_DEVICES (Ray >= 2.48 leaves a GPU-less actor the node's value, so a CPU run on a GPU
machine would otherwise see the GPUs: megatron on the CPU, nccl and vLLM on the GPU). Inside a
process `current()` answers from MEGAPPO_DEVICE; a process started without it (a CLI tool, a test)
falls back to whether torch sees a GPU. The CPU shims, vLLM's engine kwargs, the process-group
backends and the engine's placement all ask `on_gpu()`, so they can never disagree.

    local_ordinal(rank, visible, local_rank)   # the CUDA ordinal a rank uses (0 inside a Ray actor)
    transformer_engine_problem()               # None, or why TE's PyTorch layers cannot be used here
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

ENV = "MEGAPPO_DEVICE"
DEVICES = ("cpu", "cuda")


def resolve(name: str, gpus_available: bool) -> str:
    """`resources.device` -> "cpu" | "cuda": auto picks cuda when the cluster (or this process) has GPUs."""
    if name == "auto":
        return "cuda" if gpus_available else "cpu"
    if name not in DEVICES:
        raise ValueError(f"resources.device={name!r}: choose auto, cpu or cuda")
    if name == "cuda" and not gpus_available:
        raise RuntimeError("resources.device=cuda but no GPU is visible (check CUDA_VISIBLE_DEVICES and the "
                           "GPUs Ray reports for the nodes); set resources.device=cpu or auto")
    return name


def worker_env(device: str) -> dict[str, str]:
    """The environment a worker of a `device` run starts with (before torch or vLLM look for a GPU)."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: choose one of {DEVICES}")
    env = {ENV: device}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch, vLLM's torch calls and nccl see no GPU
    else:
        env[ALLOC_ENV] = pinned_alloc_conf(os.environ)
    return env


ALLOC_ENV = "PYTORCH_ALLOC_CONF"  # torch reads it first, PYTORCH_CUDA_ALLOC_CONF only when it is unset
PINNED_ROUND_MB = 1


def pinned_alloc_conf(environ: Mapping[str, str]) -> str:
    """The user's allocator settings plus pinned_max_round_threshold_mb: torch's caching host allocator
    rounds every pinned block up to a power of two (up to 2x: an offloaded role's host copy, a checkpoint's
    snapshot); above the threshold it allocates the exact size (torch >= 2.9, c10 AllocatorConfig)."""
    mine = environ.get(ALLOC_ENV) or environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    if "pinned_max_round_threshold_mb" in mine:
        return mine
    return ",".join(p for p in (mine, f"pinned_max_round_threshold_mb:{PINNED_ROUND_MB}") if p)


def current(environ: Optional[Mapping[str, str]] = None) -> str:
    """This process's device: MEGAPPO_DEVICE when the driver set it, else cuda iff torch sees a GPU."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    if value:
        if value not in DEVICES:
            raise ValueError(f"{ENV}={value!r}: expected one of {DEVICES}")
        return value
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def on_gpu() -> bool:
    return current() == "cuda"


def local_ordinal(rank: int, visible: int, local_rank: Optional[str] = None) -> int:
    """The CUDA ordinal rank `rank` uses. One visible GPU (a Ray actor's CUDA_VISIBLE_DEVICES is its own
    GPU): ordinal 0, whatever LOCAL_RANK the job script exported. Several (torchrun on a node): LOCAL_RANK,
    else rank modulo the visible count."""
    if visible <= 1:
        return 0
    ordinal = int(local_rank) if local_rank not in (None, "") else rank % visible
    if not 0 <= ordinal < visible:
        raise ValueError(f"LOCAL_RANK={local_rank} but this process sees {visible} GPUs (0..{visible - 1})")
    return ordinal


def transformer_engine_problem() -> Optional[str]:
    """None when Transformer Engine's PyTorch layers import; else one line saying why not. Probes what
    megatron uses (`transformer_engine.pytorch`), not the top-level package, whose `__init__` (TE 2.11.0)
    swallows an ImportError of `.pytorch` and only warns about a missing extension; the probe itself
    raises ImportError, FileNotFoundError / OSError (a .so missing or not loading), RuntimeError (the
    meta package alone) or AssertionError (core and extension versions differ): docs/ENVIRONMENT.md."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, RuntimeError, OSError: all mean "not usable"
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"import transformer_engine.pytorch failed: {type(e).__name__}: {first}"
    return None
