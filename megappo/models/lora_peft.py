"""LoRA adapters in peft's layout: conversion between megatron's adapters (models/lora.py, one per fused linear, TP
shards) and peft's per-HF-module (A, B), gathering a model's whole adapter from every rank, and writing a peft
adapter dir that `peft.PeftModel.from_pretrained` loads (routed experts as peft's target_parameters on
transformers' stacked expert tensors). What the adapter weight sync sends, what `megappo export` writes, what a
checkpoint's adapters are checked against."""

from __future__ import annotations

import re
from typing import Mapping, Optional, Sequence

import torch

from megappo.models.lora import LoraConfig, _group_rank, iter_lora_modules
from megappo.parallel.weight_mapping import LORA_COLUMN_TARGETS, LORA_MLA_TARGETS, LORA_TARGETS
from megappo.parallel.weight_mapping import MOE_FAMILIES, ModelDims, hf_names, hf_to_megatron_shard, \
    megatron_shards_to_hf



def _is_column(mcore_module: str) -> bool:
    leaf = mcore_module.rsplit(".", 1)[-1]
    if leaf not in LORA_TARGETS + LORA_MLA_TARGETS:
        raise KeyError(f"{mcore_module!r} is not a LoRA target ({list(LORA_TARGETS + LORA_MLA_TARGETS)})")
    return leaf in LORA_COLUMN_TARGETS + LORA_MLA_TARGETS  # MLA's projections: each one column-parallel linear


def hf_modules_of(mcore_module: str, dims: ModelDims) -> list[str]:
    """The HF modules whose adapters make up the one of a megatron module (global name), in merge order."""
    return [n.removesuffix(".weight") for n in hf_names(mcore_module + ".weight", dims)]


def hf_lora_to_megatron(mcore_module: str, hf: Mapping[str, tuple[torch.Tensor, torch.Tensor]], dims: ModelDims,
                        tp_rank: int = 0, tp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """TP rank `tp_rank`'s (A, B) shards of a megatron module's adapter from the HF modules' (A, B)."""
    srcs = hf_modules_of(mcore_module, dims)
    missing = [s for s in srcs if s not in hf]
    if missing:
        raise KeyError(f"HF adapter lacks {missing} for {mcore_module}")
    a0 = hf[srcs[0]][0]
    if any(not torch.equal(hf[s][0], a0) for s in srcs[1:]):
        raise ValueError(f"{mcore_module} fuses {srcs}: one LoRA adapter over it needs one lora_A shared by them "
                         "(this adapter has different A's: a rank-{}x adapter of the fused linear)".format(len(srcs)))
    w = mcore_module + ".weight"
    if _is_column(mcore_module):
        b = hf_to_megatron_shard(w, {s + ".weight": hf[s][1] for s in srcs}, dims, tp_rank, tp_size)
        return a0.clone(), b
    return a0.chunk(tp_size, dim=1)[tp_rank].clone(), hf[srcs[0]][1].clone()


def megatron_lora_to_hf(mcore_module: str, a_shards: Sequence[torch.Tensor], b_shards: Sequence[torch.Tensor],
                        dims: ModelDims) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """All TP ranks' (A, B) shards (rank order) of one megatron module -> {HF module: (A, B)} (peft's
    layout; a fused module's A is repeated for each of its HF modules)."""
    srcs = hf_modules_of(mcore_module, dims)
    w = mcore_module + ".weight"
    if _is_column(mcore_module):
        bs = megatron_shards_to_hf(w, list(b_shards), dims)
        return {s: (a_shards[0].clone(), bs[s + ".weight"]) for s in srcs}
    return {srcs[0]: (torch.cat(list(a_shards), dim=1), b_shards[0].clone())}


@torch.no_grad()
def load_hf_lora(model, hf: Mapping[str, tuple[torch.Tensor, torch.Tensor]], dims: ModelDims, tp_rank: int,
                 tp_size: int) -> list[str]:
    """Copy HF (peft-layout) adapter weights into this rank's adapted modules; returns their names."""
    done = []
    for name, mod in iter_lora_modules(model):
        a, b = hf_lora_to_megatron(name, hf, dims, tp_rank, tp_size)
        if a.shape != mod.lora_A.shape or b.shape != mod.lora_B.shape:
            raise ValueError(f"{name}: adapter shards A{tuple(a.shape)} B{tuple(b.shape)} != model's "
                             f"A{tuple(mod.lora_A.shape)} B{tuple(mod.lora_B.shape)} (another rank or base?)")
        mod.lora_A.copy_(a)
        mod.lora_B.copy_(b)
        done.append(name)
    return done


def gather_hf_lora(model, dims: ModelDims,
                   everywhere: bool = False) -> Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The whole adapter in peft's layout {HF module: (A, B)} on global rank 0 (None elsewhere; `everywhere`:
    on every rank), from every TP and PP rank's shards (collective over the world; one DP replica's shards
    are used). Adapters are small (r x (in + out) per linear), so they travel as objects."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    # one replica's shards: rank 0's of the data- (x context-) parallel replicas, and for a routed expert (allreduce
    # False: replicated over the expert-data-parallel group only) expert-data-parallel rank 0's of each EP rank
    dense_rank0 = mpu.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_rank0 = mpu.get_expert_data_parallel_rank() == 0
    # clone: a param is a view into DDP's whole param buffer, and pickling a view writes its whole storage
    # (on the CPU .cpu() is that view: every adapter tensor sent the buffer, 22 GB for SmolLM2 at rank 16)
    mine = {name: (_group_rank(m._lora_group), m.lora_A.detach().cpu().clone(),
                   m.lora_B.detach().cpu().clone())
            for name, m in iter_lora_modules(model)
            if (dense_rank0 if getattr(m.lora_A, "allreduce", True) else expert_rank0)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0 and not everywhere:
        return None
    shards: dict = {}
    for part in everyone:
        for name, (tp_rank, a, b) in part.items():
            shards.setdefault(name, {})[tp_rank] = (a, b)
    out = {}
    for name, by_tp in shards.items():
        ranks = sorted(by_tp)
        out.update(megatron_lora_to_hf(name, [by_tp[r][0] for r in ranks], [by_tp[r][1] for r in ranks], dims))
    return out


# routed experts in peft: transformers 5 holds a layer's experts stacked, `model.layers.{i}.mlp.experts`
# .gate_up_proj [E, 2F, H] ([gate; up] per expert) and .down_proj [E, H, F], and peft adapts them with
# target_parameters (its ParamWrapper): A [E*r, in], expert e's in rows e*r..e*r+r-1; B [out, r*E], expert
# e's in columns e, e+E, e+2E, ... Listing both wraps the first inside the second (`base_layer.`), so the
# order below is the order of adapter_config's target_parameters.
PEFT_EXPERT_PARAMS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
_EXPERT_PROJ = {p: (fc, fam.proj[fc]) for fam in MOE_FAMILIES.values() for fc in fam.proj for p in fam.proj[fc]}
_HF_EXPERT_MODULE = re.compile(r"^model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)$")


def peft_expert_tensors(hf: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, dict, list]:
    """Split {HF module: (A, B)} (experts as per-expert on-disk modules, `model.layers.1.mlp.experts.2.gate_proj`)
    into (the other modules as they are, peft's stacked expert tensors {key: tensor} without the
    `base_model.model.` prefix, peft's target_parameters)."""
    dense, stacks = {}, {}
    for mod, ab in hf.items():
        m = _HF_EXPERT_MODULE.match(mod)
        if not m or m.group(3) not in _EXPERT_PROJ:
            dense[mod] = ab
            continue
        fc, projs = _EXPERT_PROJ[m.group(3)]
        per_expert = stacks.setdefault((int(m.group(1)), fc), {}).setdefault(int(m.group(2)), {})
        per_expert[projs.index(m.group(3))] = ab
    fcs = [fc for fc in PEFT_EXPERT_PARAMS if any(k[1] == fc for k in stacks)]
    tensors = {}
    for (layer, fc), experts in sorted(stacks.items()):
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"layer {layer} {fc}: adapters for experts {sorted(experts)}, not 0..{len(experts) - 1}")
        a = torch.cat([experts[e][0][0] for e in range(len(experts))], 0)
        b = torch.stack([torch.cat([experts[e][i][1] for i in sorted(experts[e])], 0) for e in range(len(experts))], -1)
        path = f"model.layers.{layer}.mlp.experts" + ".base_layer" * (len(fcs) - 1 - fcs.index(fc))
        tensors[f"{path}.lora_A.weight"] = a.contiguous()
        tensors[f"{path}.lora_B.weight"] = b.reshape(b.shape[0], -1).contiguous()
    return dense, tensors, [f"mlp.experts.{PEFT_EXPERT_PARAMS[fc]}" for fc in fcs]


class PeftLayoutError(ValueError):
    """An adapter peft cannot hold as it is (the merged HF export still can)."""


def _is_moe(base_path) -> bool:
    import json
    from pathlib import Path

    cfg = Path(base_path) / "config.json"
    return cfg.exists() and json.loads(cfg.read_text()).get("model_type") in MOE_FAMILIES


def save_peft_adapter(hf: Mapping[str, tuple[torch.Tensor, torch.Tensor]], cfg: LoraConfig, base_path, out) -> None:
    """Write a peft adapter dir (adapter_config.json + adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(<HF base>, out)` loads: the HF modules' (A, B) in peft's key names, routed
    experts as peft's target_parameters on transformers' stacked expert tensors (peft_expert_tensors)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    dense, experts, target_parameters = peft_expert_tensors(hf)
    clash = sorted({m.rsplit(".", 1)[-1] for m in dense} & set(_EXPERT_PROJ))
    if clash and _is_moe(base_path):
        # peft (transformers 5) reads these target names as the stacked experts' (its v4 -> v5 conversion)
        raise PeftLayoutError(f"a peft adapter cannot hold the dense MLP adapters ({', '.join(clash)}) of this MoE "
                              "model: peft maps those names onto the routed experts; use the merged HF export instead")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{k}": v for k, v in experts.items()}
    for mod, (a, b) in dense.items():  # copies: q/k/v (gate/up) may share one A tensor, safetensors refuses that
        tensors[f"base_model.model.{mod}.lora_A.weight"] = a.clone(memory_format=torch.contiguous_format)
        tensors[f"base_model.model.{mod}.lora_B.weight"] = b.clone(memory_format=torch.contiguous_format)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    targets = sorted({m.rsplit(".", 1)[-1] for m in dense})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_path), "r": cfg.rank,
        # training-only; peft's ParamWrapper (the experts') refuses any other value
        "lora_alpha": cfg.alpha, "lora_dropout": 0.0 if target_parameters else cfg.dropout,
        "target_modules": targets or [], "target_parameters": target_parameters or None, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True}, indent=1))
