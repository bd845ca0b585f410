"""ONE source of truth for HuggingFace <-> Megatron-core names and tensor layouts (llama / qwen2 /
mistral / qwen3 / MoE families; the dims themselves are parallel/model_dims.py's). Pure functions over
single tensors, so a converter or a resharder can stream one parameter at a time. Used by models/gpt.py (HF load), the checkpoint converter and the resharder.

Megatron names use the GLOBAL layer index (`decoder.layers.{L}.`); a pipeline stage that holds layers
[o, o+n) names its local layer i as global o+i (see `global_param_name`).

Layouts (per TP rank r of T):
- `self_attention.linear_qkv` (column parallel): rows grouped per query group g:
  [q heads of g (heads/groups * head_dim rows), k of g (head_dim), v of g (head_dim)], groups in order;
  rank r holds the contiguous groups [r*G/T, (r+1)*G/T). The same for the qkv bias (qwen2).
- `mlp.linear_fc1` (column parallel, SwiGLU): rank r holds [gate rows of r ; up rows of r] (megatron
  chunks the local output in two), so the unsharded tensor depends on T: always go HF <-> shard.
- `self_attention.linear_proj`, `mlp.linear_fc2` (row parallel): split along dim 1.
- `embedding.word_embeddings`, `output_layer` (vocab parallel): rows padded with zeros to
  `padded_vocab_size` then split along dim 0; padding rows are dropped when going back to HF.
- norms, and the critic's value head (`output_layer` of shape [1, hidden], HF `score`): replicated.
  Qwen3's per-head q/k RMSNorms (`self_attention.q_layernorm` / `k_layernorm`, [head_dim], HF
  `self_attn.q_norm` / `k_norm`) too: every TP rank applies the same weights to its own heads, and
  megatron sums their grads over TP (finalize_model_grads, `config.qk_layernorm`).
- Qwen3-MoE routed experts (megatron's SequentialMLP): `mlp.experts.local_experts.{e}.linear_fc1` /
  `linear_fc2` per expert, laid out like a dense MLP's fc1 / fc2 (split over TP = expert TP), HF
  `mlp.experts.{e}.gate_proj|up_proj|down_proj` (transformers' on-disk form); e is the GLOBAL expert index
  here, an expert-parallel rank holds a contiguous block (`global_param_name`). TE's grouped GEMM
  (TEGroupedMLP, `moe_grouped_gemm=True`; `ModelDims.grouped_experts`) holds the same per-expert
  tensors, same layout, as `mlp.experts.linear_fc1.weight{e}` / `linear_fc2.weight{e}`
  (`expert_param_name`; both spellings are read everywhere). The router
  (`mlp.router`, HF `mlp.gate`) is replicated. Mixtral: the same megatron model, HF names
  `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up, down): `MOE_FAMILIES`.
- A shared expert (megatron's `mlp.shared_experts.linear_fc1` / `linear_fc2`, laid out like a dense MLP's;
  Qwen2-MoE's sigmoid gate `mlp.shared_experts.gate_weight` [1, hidden], replicated): the family's HF module
  (`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`; GLM / DeepSeek: `mlp.shared_experts.*`).
- A sigmoid router's correction bias (megatron's fp32 buffer `mlp.router.expert_bias` [experts], HF's
  `mlp.gate.e_score_correction_bias`): replicated, kept fp32 in a bf16 model.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping, Optional

from megappo.parallel.model_dims import (  # noqa: F401 (re-exported: the model's facts, read with its names)
    DEFAULT_VOCAB_DIVISOR, LORA_COLUMN_TARGETS, LORA_INITS, LORA_MLA_TARGETS, LORA_ROW_TARGETS, LORA_TARGETS,
    MLA_COLUMN_LINEARS, MLA_DOWN_LINEARS, MLA_MODEL_TYPES, MLA_WITHOUT_TE, MOE_FAMILIES, SUPPORTED_MODEL_TYPES,
    VISION_PREFIX, ModelDims, MoeFamily, language_config, num_routed_experts, padded_vocab_size, rope_theta,
    transformer_config_kwargs)

if TYPE_CHECKING:  # torch is imported where a tensor is built: the driver validates its config
    import torch   # before Ray (and torch) start


# ---- names --------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# a sigmoid router's correction bias: megatron's fp32 buffer, and its name in transformers' (and vLLM's) gate
ROUTER_BIAS = "mlp.router.expert_bias"
HF_ROUTER_BIAS = "e_score_correction_bias"


def kept_in_fp32(hf_name: str) -> bool:
    """An HF tensor held in fp32 whatever the model's dtype: a sigmoid router's correction bias (transformers'
    _keep_in_fp32, vLLM's gate): exports keep it so, and the rollout's fingerprint compares it at fp32's tolerance."""
    return hf_name.endswith(HF_ROUTER_BIAS)


# routed experts (global expert index e): megatron SequentialMLP's or TEGroupedMLP's names <-> transformers'
# per-expert names on disk
_EXPERT_RE = re.compile(r"^mlp\.experts\.(?:local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc1|linear_fc2)\.weight|"
                        r"(?P<gfc>linear_fc1|linear_fc2)\.weight(?P<ge>\d+))$")
_HF_EXPERT_RE = re.compile(r"^(%s)\.experts\.(\d+)\.(\w+)\.weight$"
                            % "|".join(sorted({re.escape(f.block) for f in MOE_FAMILIES.values()})))

def expert_param_name(expert: int, fc: str, grouped: bool = False) -> str:
    """A routed expert's per-layer megatron suffix: SequentialMLP's `mlp.experts.local_experts.{e}.{fc}.weight`
    or (`grouped`) TEGroupedMLP's `mlp.experts.{fc}.weight{e}` (TE's GroupedLinear: one weight{i} per local
    expert, each the tensor SequentialMLP's expert i holds)."""
    return f"mlp.experts.{fc}.weight{expert}" if grouped else f"mlp.experts.local_experts.{expert}.{fc}.weight"


def parse_expert(suffix: str) -> Optional[tuple[int, str, bool]]:
    """(expert index, "linear_fc1" | "linear_fc2", grouped) of a routed expert's per-layer suffix (either
    spelling of expert_param_name); None for any other parameter."""
    e = _EXPERT_RE.match(suffix)
    if not e:
        return None
    grouped = e.group("gfc") is not None
    return int(e.group("ge") if grouped else e.group("e")), e.group("gfc") if grouped else e.group("fc"), grouped


# megatron per-layer suffix -> HF per-layer suffixes (in merge order)
_LAYER_MAP = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "self_attention.linear_qkv.layer_norm_weight": ["input_layernorm.weight"],  # TE fused spec
    "self_attention.linear_qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
    "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],  # qwen3
    "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc1.layer_norm_weight": ["post_attention_layernorm.weight"],  # TE fused spec
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
}
# multi-latent attention (DeepSeek-V3): megatron's MLASelfAttention <-> transformers' DeepseekV3Attention, every
# tensor the same rows (no fusion); the down / up projections are column-parallel (split along dim 0: q_up and
# kv_up by heads; the down projections by rows of the latent, gathered back before the norms), the a-layernorms
# replicated
_MLA_MAP = {
    "self_attention.linear_q_down_proj.weight": ["self_attn.q_a_proj.weight"],
    "self_attention.q_layernorm.weight": ["self_attn.q_a_layernorm.weight"],
    "self_attention.linear_q_up_proj.weight": ["self_attn.q_b_proj.weight"],
    "self_attention.linear_q_proj.weight": ["self_attn.q_proj.weight"],  # q_lora_rank None
    "self_attention.linear_kv_down_proj.weight": ["self_attn.kv_a_proj_with_mqa.weight"],
    "self_attention.kv_layernorm.weight": ["self_attn.kv_a_layernorm.weight"],
    "self_attention.linear_kv_up_proj.weight": ["self_attn.kv_b_proj.weight"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
}


def whole_in_rollout(mcore_name: str, dims: ModelDims) -> bool:
    """A TP-split megatron weight that vLLM keeps whole on every rollout TP rank: MLA's down projections
    (vLLM's replicated fused_qkv_a_proj / kv_a_proj_with_mqa), which a sliced weight sync must gather."""
    return dims.mla and any(mcore_name.endswith(f"self_attention.{c}.weight") for c in MLA_DOWN_LINEARS)


def mla_shapes(d: ModelDims) -> dict[str, tuple]:
    """One MLA layer's attention tensors, in model order: megatron's name after `self_attention.` -> its shape
    (HF's are the same tensors). q through its rank-q_lora_rank latent (its norm between) or a plain q projection;
    the shared k/v latent plus the RoPE key; per head k_nope and v out of the latent; v's head dim is head_dim.
    The one statement of these shapes: the converter's, the planner's counts and the names below read it."""
    h, heads, qk = d.hidden_size, d.num_heads, d.qk_nope_dim + d.qk_rope_dim
    q = {"linear_q_down_proj.weight": (d.q_lora_rank, h), "q_layernorm.weight": (d.q_lora_rank,),
         "linear_q_up_proj.weight": (heads * qk, d.q_lora_rank)} if d.q_lora_rank else \
        {"linear_q_proj.weight": (heads * qk, h)}
    return q | {"linear_kv_down_proj.weight": (d.kv_lora_rank + d.qk_rope_dim, h),
                "kv_layernorm.weight": (d.kv_lora_rank,),
                "linear_kv_up_proj.weight": (heads * (d.qk_nope_dim + d.head_dim), d.kv_lora_rank),
                "linear_proj.weight": (h, heads * d.head_dim)}


def mla_attention_names(dims: ModelDims) -> list[str]:
    """One MLA layer's attention parameters (suffixes), in model order."""
    return [f"self_attention.{n}" for n in mla_shapes(dims)]


_TOP_MAP = {
    "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
    "decoder.final_layernorm.weight": ["model.norm.weight"],
    "output_layer.weight": ["lm_head.weight"],
}
_VALUE_HEAD_MAP = {"output_layer.weight": ["score.weight"], "output_layer.bias": ["score.bias"]}


def _shared_expert_map(dims: ModelDims) -> dict:
    """megatron's shared expert (`mlp.shared_experts.*`, a dense MLP's layout; its sigmoid gate [1, hidden]
    replicated) -> the family's HF names (Qwen2-MoE: `mlp.shared_expert.*` and `mlp.shared_expert_gate`)."""
    if not dims.shared_expert_ffn:
        return {}
    h = f"mlp.{_moe_hf(dims).shared}"
    out = {"mlp.shared_experts.linear_fc1.weight": [f"{h}.gate_proj.weight", f"{h}.up_proj.weight"],
           "mlp.shared_experts.linear_fc2.weight": [f"{h}.down_proj.weight"]}
    if dims.shared_expert_gate:
        out["mlp.shared_experts.gate_weight"] = [f"{h}_gate.weight"]
    return out


def megatron_param_names(dims: ModelDims, te_fused_norms: bool = False) -> list[str]:
    """Every (global-layer) megatron parameter name of the full model, in model order."""
    names = ["embedding.word_embeddings.weight"]
    for layer in range(dims.num_layers):
        p = f"decoder.layers.{layer}."
        if dims.mla:  # megatron's MLA layer keeps its input norm apart (no fused linear_qkv)
            names.append(p + "input_layernorm.weight")
            names += [p + n for n in mla_attention_names(dims)]
        else:
            names.append(p + ("self_attention.linear_qkv.layer_norm_weight" if te_fused_norms else "input_layernorm.weight"))
            names.append(p + "self_attention.linear_qkv.weight")
            if dims.qkv_bias:
                names.append(p + "self_attention.linear_qkv.bias")
            if dims.qk_norm:
                names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
            names.append(p + "self_attention.linear_proj.weight")
        if dims.is_moe_layer(layer):  # megatron keeps a separate pre-MLP norm in front of the router
            names.append(p + "pre_mlp_layernorm.weight")
            names.append(p + "mlp.router.weight")
            if dims.expert_bias:  # a fp32 buffer, not a parameter: global_named_parameters yields it too
                names.append(p + ROUTER_BIAS)
            for e in range(dims.num_experts):
                names += [p + expert_param_name(e, fc, dims.grouped_experts) for fc in ("linear_fc1", "linear_fc2")]
            names += [p + n for n in _shared_expert_map(dims)]
            continue
        names.append(p + ("mlp.linear_fc1.layer_norm_weight" if te_fused_norms and not dims.mla
                          else "pre_mlp_layernorm.weight"))
        names.append(p + "mlp.linear_fc1.weight")
        names.append(p + "mlp.linear_fc2.weight")
    names.append("decoder.final_layernorm.weight")
    if dims.value_head:
        names += ["output_layer.weight", "output_layer.bias"]
    elif not dims.tied_embeddings:
        names.append("output_layer.weight")
    return names


def hf_names(mcore_name: str, dims: ModelDims) -> list[str]:
    """The HF tensor names that make up one megatron parameter (global layer index)."""
    if mcore_name.startswith(VISION_PREFIX):  # the vision tower keeps HF's names (models/vision.py)
        return [mcore_name]
    m = _LAYER_RE.match(mcore_name)
    if m:
        layer, suffix = m.groups()
        e = parse_expert(suffix)
        if e:
            return hf_expert_names(f"model.layers.{layer}.{_moe_hf(dims).block}.experts.", e[0], dims.model_type, e[1])
        if suffix == "mlp.router.weight":  # the router [experts, hidden]
            return [f"model.layers.{layer}.{_moe_hf(dims).block}.gate.weight"]
        if suffix == ROUTER_BIAS and dims.expert_bias:  # [experts], fp32
            return [f"model.layers.{layer}.{_moe_hf(dims).block}.gate.{HF_ROUTER_BIAS}"]
        shared = _shared_expert_map(dims).get(suffix)
        if shared:
            return [f"model.layers.{layer}.{h}" for h in shared]
        if dims.mla and suffix in _MLA_MAP:
            return [f"model.layers.{layer}.{_MLA_MAP[suffix][0]}"]
        if suffix not in _LAYER_MAP:
            raise KeyError(f"no HF mapping for megatron parameter {mcore_name!r}")
        return [f"model.layers.{layer}.{s}" for s in _LAYER_MAP[suffix]]
    if dims.value_head and mcore_name in _VALUE_HEAD_MAP:
        return list(_VALUE_HEAD_MAP[mcore_name])
    if mcore_name == "output_layer.weight" and dims.tied_embeddings:
        return ["model.embed_tokens.weight"]
    if mcore_name in _TOP_MAP:
        return list(_TOP_MAP[mcore_name])
    raise KeyError(f"no HF mapping for megatron parameter {mcore_name!r}")


def _moe_hf(dims: ModelDims) -> MoeFamily:
    if dims.model_type not in MOE_FAMILIES:
        raise KeyError(f"{dims.model_type} has no routed experts")
    return MOE_FAMILIES[dims.model_type]


def hf_expert_names(base: str, expert: int, model_type: str = "qwen3_moe", fc: Optional[str] = None) -> list[str]:
    """HF names of routed expert `expert` under `base` ("model.layers.L.mlp.experts."): gate, up, down
    (`fc`: only those of megatron's linear_fc1 or linear_fc2)."""
    proj = MOE_FAMILIES[model_type].proj
    return [f"{base}{expert}.{h}.weight" for f in ((fc,) if fc else ("linear_fc1", "linear_fc2")) for h in proj[f]]


def is_hf_moe_tensor(hf_name: str) -> bool:
    """A HF router (its weight or its correction bias) or routed-expert tensor (of any MoE family)."""
    return any(f".{f.block}.experts." in hf_name or hf_name.endswith(f".{f.block}.gate.weight")
               or hf_name.endswith(f".{f.block}.gate.{HF_ROUTER_BIAS}") for f in MOE_FAMILIES.values())


def routed_expert(mcore_name: str) -> Optional[int]:
    """The global expert index of a routed expert's megatron parameter; None for any other parameter."""
    m = _LAYER_RE.match(mcore_name)
    e = parse_expert(m.group(2)) if m else None
    return e[0] if e else None


def megatron_name(hf_name: str, dims: ModelDims, te_fused_norms: bool = False) -> str:
    """The megatron parameter (global layer index) that a HF tensor belongs to."""
    if dims.vision and hf_name.startswith(VISION_PREFIX):
        return hf_name
    m = _HF_LAYER_RE.match(hf_name)
    if m:
        layer, suffix = m.groups()
        e = _HF_EXPERT_RE.match(suffix)
        if e and dims.model_type in MOE_FAMILIES and e.group(1) == _moe_hf(dims).block:
            fc = next((f for f, proj in _moe_hf(dims).proj.items() if e.group(3) in proj), None)
            if fc is not None:
                return f"decoder.layers.{layer}.{expert_param_name(int(e.group(2)), fc, dims.grouped_experts)}"
        if dims.model_type in MOE_FAMILIES and suffix == f"{_moe_hf(dims).block}.gate.weight":
            return f"decoder.layers.{layer}.mlp.router.weight"
        if dims.expert_bias and suffix == f"{_moe_hf(dims).block}.gate.{HF_ROUTER_BIAS}":
            return f"decoder.layers.{layer}.{ROUTER_BIAS}"
        shared = next((m for m, hs in _shared_expert_map(dims).items() if suffix in hs), None)
        if shared:
            return f"decoder.layers.{layer}.{shared}"
        if dims.is_moe_layer(int(layer)) and suffix == "post_attention_layernorm.weight":
            return f"decoder.layers.{layer}.pre_mlp_layernorm.weight"
        if dims.mla:  # megatron's MLA layer spec names its norms apart (no fused linear_qkv / linear_fc1 norm)
            if suffix == "input_layernorm.weight":
                return f"decoder.layers.{layer}.input_layernorm.weight"
            if suffix == "post_attention_layernorm.weight":
                return f"decoder.layers.{layer}.pre_mlp_layernorm.weight"
            mla = next((m for m, hs in _MLA_MAP.items() if suffix in hs), None)
            if mla:
                return f"decoder.layers.{layer}.{mla}"
        for msuffix, sources in _LAYER_MAP.items():
            is_norm = "layernorm" in suffix
            if suffix in sources and (not is_norm or msuffix.endswith("layer_norm_weight") == te_fused_norms):
                return f"decoder.layers.{layer}.{msuffix}"
        raise KeyError(f"no megatron mapping for HF tensor {hf_name!r}")
    if dims.value_head:
        for k, v in _VALUE_HEAD_MAP.items():
            if hf_name in v:
                return k
    for k, v in _TOP_MAP.items():
        if hf_name in v:
            return k
    raise KeyError(f"no megatron mapping for HF tensor {hf_name!r}")


def global_param_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """`decoder.layers.{i}.x` of a pipeline stage whose first layer is `layer_offset` -> global name; a
    routed expert's local index i on an expert-parallel rank whose first expert is `expert_offset` ->
    its global index."""
    m = _LAYER_RE.match(local_name)
    if not m:
        return local_name
    suffix = m.group(2)
    e = parse_expert(suffix)
    if e:
        suffix = expert_param_name(e[0] + expert_offset, e[1], e[2])
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{suffix}"


# ---- tensor layouts -----------------------------------------------------------------------------


def layer_offset(chunk) -> int:
    """Global index of a megatron model chunk's first transformer layer (its pipeline stage's offset)."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    return (layers[0].layer_number - 1) if layers is not None and len(layers) else 0


def _expert_offsets(chunk) -> dict:
    """Local layer index -> global index of its first local expert (megatron's MoELayer knows it)."""
    out = {}
    for name, mod in chunk.named_modules():
        indices = getattr(mod, "local_expert_indices", None)
        m = re.search(r"decoder\.layers\.(\d+)\.mlp$", name)
        if indices and m:
            out[int(m.group(1))] = indices[0]
    return out


def global_namer(chunk):
    """A function: a parameter name local to this megatron model chunk -> its global name (layer and expert
    indices made global)."""
    off, experts = layer_offset(chunk), _expert_offsets(chunk)

    def name_of(local: str) -> str:
        local = local.removeprefix("module.")
        m = _LAYER_RE.match(local)
        return global_param_name(local, off, experts.get(int(m.group(1)), 0) if m else 0)

    return name_of


def local_named_weights(chunk):
    """(local name, tensor) of every weight of one megatron model chunk: its parameters, then the routers'
    expert_bias buffers (model weights that no optimizer moves: loaded, exported, synced to vLLM and
    fingerprinted with the rest)."""
    yield from chunk.named_parameters()
    for name, b in chunk.named_buffers():
        if name.endswith(ROUTER_BIAS):
            yield name, b


def global_named_parameters(chunk):
    """(global megatron name, tensor) of every weight of one megatron model chunk (local_named_weights, the
    layer and expert indices made global)."""
    name_of = global_namer(chunk)
    for name, p in local_named_weights(chunk):
        yield name_of(name), p


def _kind(mcore_name: str, dims: ModelDims) -> str:
    if mcore_name.startswith(VISION_PREFIX):  # the vision tower: whole on every TP rank
        return "replicated"
    m = _LAYER_RE.match(mcore_name)
    e = parse_expert(m.group(2)) if m else None
    if e:  # an expert's fc1 is column-parallel ([gate; up] per rank), its fc2 row-parallel
        return "fc1" if e[1] == "linear_fc1" else "row"
    if mcore_name.endswith("linear_qkv.weight") or mcore_name.endswith("linear_qkv.bias"):
        return "qkv"
    if dims.mla and any(mcore_name.endswith(f"self_attention.{c}.weight") for c in MLA_COLUMN_LINEARS):
        return "column"
    if mcore_name.endswith("linear_fc1.weight"):
        return "fc1"
    if mcore_name.endswith("linear_proj.weight") or mcore_name.endswith("linear_fc2.weight"):
        return "row"
    if mcore_name == "embedding.word_embeddings.weight" or (mcore_name == "output_layer.weight" and not dims.value_head):
        return "vocab"
    return "replicated"


def tp_split_dim(mcore_name: str, dims: ModelDims) -> Optional[int]:
    """Which dim of the megatron tensor TP splits (None: replicated)."""
    return {"qkv": 0, "fc1": 0, "vocab": 0, "column": 0, "row": 1, "replicated": None}[_kind(mcore_name, dims)]


def _pad_vocab(t: torch.Tensor, dims: ModelDims) -> torch.Tensor:
    import torch

    if t.shape[0] == dims.padded_vocab_size:
        return t
    pad = t.new_zeros((dims.padded_vocab_size - t.shape[0],) + tuple(t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def hf_to_megatron_shard(mcore_name: str, hf: Mapping[str, torch.Tensor], dims: ModelDims,
                         tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
    """Build TP rank `tp_rank`'s shard of megatron parameter `mcore_name` from its HF tensors
    (`hf` maps each name in `hf_names(mcore_name)` to the full HF tensor)."""
    import torch

    srcs = [hf[n] for n in hf_names(mcore_name, dims)]
    kind = _kind(mcore_name, dims)
    if kind == "replicated":
        return srcs[0].clone()
    if kind == "row":
        return srcs[0].chunk(tp_size, dim=1)[tp_rank].clone()
    if kind == "column":
        return srcs[0].chunk(tp_size, dim=0)[tp_rank].clone()
    if kind == "vocab":
        return _pad_vocab(srcs[0], dims).chunk(tp_size, dim=0)[tp_rank].clone()
    if kind == "fc1":
        gate, up = srcs
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    # qkv: interleave per query group, then take this rank's contiguous groups
    q, k, v = srcs
    g, hpg, d = dims.num_kv_heads, dims.heads_per_group, dims.head_dim
    if g % tp_size:
        raise ValueError(f"tp={tp_size} does not divide num_key_value_heads={g}")
    tail = tuple(q.shape[1:])
    qg = q.reshape((g, hpg * d) + tail)
    kg = k.reshape((g, d) + tail)
    vg = v.reshape((g, d) + tail)
    full = torch.cat([qg, kg, vg], dim=1)  # [g, (hpg+2)*d, ...]
    per = g // tp_size
    return full[tp_rank * per:(tp_rank + 1) * per].reshape((-1,) + tail).clone()


def megatron_shards_to_hf(mcore_name: str, shards: list[torch.Tensor], dims: ModelDims,
                          copy: bool = True) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron_shard`: all TP shards (rank order) of one megatron parameter ->
    {hf_name: full HF tensor}. A tied `output_layer.weight` maps to the embedding name.
    copy=False: return views of the shards where the layout allows (one shard: everything but
    q/k/v), for a caller that only reads the result before the shards change (weight sync)."""
    import torch

    names = hf_names(mcore_name, dims)
    kind = _kind(mcore_name, dims)
    one = len(shards) == 1

    def cat(dim):
        return shards[0] if one else torch.cat(shards, dim=dim)

    if kind == "replicated":
        return {names[0]: shards[0].clone() if copy else shards[0]}
    if kind == "row":
        t = cat(1)
        return {names[0]: t.clone() if copy and one else t}
    if kind == "column":
        t = cat(0)
        return {names[0]: t.clone() if copy and one else t}
    if kind == "vocab":
        t = cat(0)[: dims.vocab_size]
        return {names[0]: t.clone() if copy else t}
    if kind == "fc1":
        if one:
            gate, up = shards[0].chunk(2, dim=0)
            return {names[0]: gate.clone() if copy else gate, names[1]: up.clone() if copy else up}
        halves = [s.chunk(2, dim=0) for s in shards]
        return {names[0]: torch.cat([h[0] for h in halves], 0), names[1]: torch.cat([h[1] for h in halves], 0)}
    g, hpg, d = dims.num_kv_heads, dims.heads_per_group, dims.head_dim
    full = cat(0)
    tail = tuple(full.shape[1:])
    grouped = full.reshape((g, (hpg + 2) * d) + tail)
    q = grouped[:, : hpg * d].reshape((-1,) + tail)
    k = grouped[:, hpg * d: (hpg + 1) * d].reshape((-1,) + tail)
    v = grouped[:, (hpg + 1) * d:].reshape((-1,) + tail)
    if not copy:
        return {names[0]: q, names[1]: k, names[2]: v}
    return {names[0]: q.clone(), names[1]: k.clone(), names[2]: v.clone()}


def megatron_shard_hf_slices(mcore_name: str, shard: torch.Tensor, dims: ModelDims, tp_rank: int,
                             tp_size: int) -> list[tuple[str, tuple, torch.Tensor]]:
    """Where TP rank `tp_rank`'s shard lands in the full HF tensors: [(hf_name, index, values)] such
    that `hf[hf_name][index]` (viewed as `values.shape` when the block is contiguous and shaped
    differently) equals `values`. Over all ranks the entries fill every HF tensor exactly
    (`megatron_shards_to_hf` without the gather: each rank writes its own part in place). A
    replicated param is the same on every rank: one rank's entry covers it."""
    names = hf_names(mcore_name, dims)
    kind = _kind(mcore_name, dims)
    r = tp_rank
    if kind == "replicated":
        return [(names[0], (slice(None),), shard)]
    if kind == "row":
        k = shard.shape[1]
        return [(names[0], (slice(None), slice(r * k, (r + 1) * k)), shard)]
    if kind == "column":
        n = shard.shape[0]
        return [(names[0], (slice(r * n, (r + 1) * n),), shard)]
    if kind == "vocab":
        n = shard.shape[0]
        lo, hi = r * n, min((r + 1) * n, dims.vocab_size)
        return [(names[0], (slice(lo, hi),), shard[: hi - lo])] if hi > lo else []
    if kind == "fc1":
        h = shard.shape[0] // 2
        rows = (slice(r * h, (r + 1) * h),)
        return [(names[0], rows, shard[:h]), (names[1], rows, shard[h:])]
    g, hpg, d = dims.num_kv_heads, dims.heads_per_group, dims.head_dim
    per = g // tp_size  # query groups on this rank
    tail = tuple(shard.shape[1:])
    grouped = shard.reshape((per, (hpg + 2) * d) + tail)
    return [(names[0], (slice(r * per * hpg * d, (r + 1) * per * hpg * d),), grouped[:, : hpg * d]),
            (names[1], (slice(r * per * d, (r + 1) * per * d),), grouped[:, hpg * d: (hpg + 1) * d]),
            (names[2], (slice(r * per * d, (r + 1) * per * d),), grouped[:, (hpg + 1) * d:])]


def hf_to_megatron_full(mcore_name: str, hf: Mapping[str, torch.Tensor], dims: ModelDims, tp_size: int = 1) -> torch.Tensor:
    """The concatenation of all TP shards (what a TP-gather would produce at this tp_size)."""
    import torch

    dim = tp_split_dim(mcore_name, dims)
    if dim is None:
        return hf_to_megatron_shard(mcore_name, hf, dims)
    return torch.cat([hf_to_megatron_shard(mcore_name, hf, dims, r, tp_size) for r in range(tp_size)], dim=dim)
