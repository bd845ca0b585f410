"""Bring up (and tear down) torch.distributed and megatron-core's parallel_state for one worker.

    init_distributed(rank, world_size, master_addr, master_port)   # gloo on CPU, nccl (+gloo) on GPU
    init_megatron(layout, seed)                                    # parallel_state + RNG

In a CPU process (parallel/device.py decides), `cpu_compat.apply()` is installed first (the only place that bends
megatron towards the CPU).
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

from megappo.parallel import cpu_compat, device
from megappo.parallel.layout import ParallelLayout


def resolve_device(name: str = "auto") -> str:
    """`resources.device` -> "cuda" or "cpu" for this process. In a worker the driver already decided
    (MEGAPPO_DEVICE, parallel/device.py): "auto" is that answer, and an explicit value must agree with it."""
    here = device.current()
    if name == "auto":
        return here
    got = device.resolve(name, gpus_available=here == "cuda")
    return got


def default_backend() -> str:
    """gloo on CPU. On GPU both: CUDA tensors go over nccl, CPU tensors (metric vectors, fingerprints,
    object collectives) over gloo, so no small CPU-side collective needs a device round trip; megatron's
    groups (new_group with backend=None) inherit both."""
    return "cpu:gloo,cuda:nccl" if device.on_gpu() else "gloo"


def init_distributed(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                     backend: Optional[str] = None, timeout_minutes: int = 30) -> None:
    """torch.distributed.init_process_group for this worker (idempotent)."""
    cpu_compat.apply()
    if dist.is_initialized():
        return
    if device.on_gpu():
        torch.cuda.set_device(device.local_ordinal(rank, torch.cuda.device_count(), os.environ.get("LOCAL_RANK")))
    dist.init_process_group(
        backend=backend or default_backend(),
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )


def import_megatron() -> None:
    """`import megatron.core`, or one line on why not. megatron-core 0.16.1 imports Transformer Engine
    whenever it is installed and catches only ImportError (core/utils.py:78-86), so a half-installed TE
    (FileNotFoundError, RuntimeError, AssertionError from its loader) breaks megatron itself."""
    try:
        import megatron.core  # noqa: F401
    except Exception as e:
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            raise
        raise RuntimeError(f"megatron-core cannot be imported because Transformer Engine is installed but broken "
                           f"({device.transformer_engine_problem() or f'{type(e).__name__}: {e}'}): reinstall it as "
                           "requirements-gpu-te.txt says (make install-gpu) or uninstall transformer_engine, "
                           "transformer_engine_cu12/_cu13 and transformer_engine_torch") from e


def init_megatron(layout: ParallelLayout, seed: int = 1234) -> None:
    """megatron parallel_state groups for `layout` (order tp-cp-ep-dp-pp) and the model-parallel RNG."""
    import_megatron()
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        raise RuntimeError("init_distributed() must run before init_megatron()")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks, world size is {dist.get_world_size()}")
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        virtual_pipeline_model_parallel_size=layout.virtual_pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.tp,
        order="tp-cp-ep-dp-pp",
    )
    if cpu_compat.needs_cpu_compat():
        cpu_compat.install_rng_tracker()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def coords() -> tuple[int, int, int, int]:
    """This rank's (dp, pp, tp, cp) as megatron sees it."""
    from megatron.core import parallel_state as mpu

    return (mpu.get_data_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
            mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank())
