"""ONE source of truth for HuggingFace <-> Megatron-core names and tensor layouts (llama / qwen2 /
mistral / qwen3 families). Pure functions over single tensors, so a converter or a resharder can stream one
parameter at a time. Used by models/gpt.py (HF load), the checkpoint converter and the resharder.

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
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Optional

if TYPE_CHECKING:  # torch is imported where a tensor is built: the config schema reads this module's
    import torch   # supported families, and the driver validates its config before Ray (and torch) start

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral")

# LoRA (models/lora.py, config actor.lora): megatron's fused / parallel linears an adapter may wrap, by how
# their weight is split over TP (column: along the output; row: along the input), and the inits of A
LORA_COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
LORA_ROW_TARGETS = ("linear_proj", "linear_fc2")
LORA_TARGETS = LORA_COLUMN_TARGETS + LORA_ROW_TARGETS
LORA_INITS = ("kaiming", "gaussian")
DEFAULT_VOCAB_DIVISOR = 128


@dataclass(frozen=True)
class MoeFamily:
    """One mixture-of-experts family: its HF tensor names and its config.json keys. ModelDims reads a
    config.json through it, config/validate.py writes model.arch as one, the weight mapping names tensors by
    it: a new MoE family is one row of MOE_FAMILIES (and its name in SUPPORTED_MODEL_TYPES)."""

    block: str  # the HF module holding the router (`{block}.gate`) and the experts (`{block}.experts.{e}.`)
    proj: dict  # megatron expert linear -> its HF projections in merge order (fc1 = [gate; up], fc2 = down)
    experts_keys: tuple  # config.json keys of the routed expert count, the first the family's own
    ffn_key: str  # config.json key of one expert's FFN size
    sparse_layers: bool  # routed layers by decoder_sparse_step / mlp_only_layers (else every layer)
    norm_topk_prob: Optional[bool] = None  # the family's fixed top-k renormalisation; None: config.json's
    refused: tuple = ()  # (config.json key, what a non-zero value means): refused when set

    def dims(self, hf_config) -> dict:
        """ModelDims' expert fields from a HF config of this family."""
        mt = hf_config.model_type
        experts = next((getattr(hf_config, k) for k in self.experts_keys if getattr(hf_config, k, None)), None)
        if not experts or not getattr(hf_config, "num_experts_per_tok", None):
            raise ValueError(f"a {mt} config needs {self.experts_keys[0]} and num_experts_per_tok (its config.json)")
        for key, why in self.refused:
            if getattr(hf_config, key, 0):
                raise ValueError(f"{mt} {key} > 0 ({why}) is not supported; set 0")
        layers = hf_config.num_hidden_layers
        if self.sparse_layers:  # transformers' rule (Qwen3MoeDecoderLayer): (i+1) % step == 0, except mlp_only_layers
            step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
            moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        else:
            moe_layers = (True,) * layers
        norm = self.norm_topk_prob if self.norm_topk_prob is not None else bool(getattr(hf_config, "norm_topk_prob", False))
        return dict(num_experts=int(experts), moe_topk=int(hf_config.num_experts_per_tok),
                    moe_ffn_hidden_size=int(getattr(hf_config, self.ffn_key)), norm_topk_prob=norm,
                    moe_layers=moe_layers)

    def hf_keys(self, num_experts: int, topk: int, ffn: int, decoder_sparse_step: int = 1,
                mlp_only_layers=(), norm_topk_prob: bool = False) -> dict:
        """The config.json keys this family reads (`dims`), from the fields of a config's model.arch."""
        d = {self.experts_keys[0]: num_experts, "num_experts_per_tok": topk, self.ffn_key: ffn}
        if self.ffn_key == "intermediate_size":  # experts of the dense FFN size: model.arch's intermediate_size
            del d[self.ffn_key]
        if self.sparse_layers:
            d.update(decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers))
        if self.norm_topk_prob is None:
            d["norm_topk_prob"] = norm_topk_prob
        return d


MOE_FAMILIES = {
    "qwen3_moe": MoeFamily("mlp", {"linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"]},
                           experts_keys=("num_experts", "num_local_experts"), ffn_key="moe_intermediate_size",
                           sparse_layers=True),
    # every layer routed; softmax over all experts, top-k renormalised; experts of intermediate_size
    "mixtral": MoeFamily("block_sparse_moe", {"linear_fc1": ["w1", "w3"], "linear_fc2": ["w2"]},
                         experts_keys=("num_local_experts",), ffn_key="intermediate_size", sparse_layers=False,
                         norm_topk_prob=True, refused=(("router_jitter_noise", "random routing in training"),)),
}


def num_routed_experts(hf_config) -> int:
    """The routed expert count of a HF config (0: dense), read by its family's keys."""
    fam = MOE_FAMILIES.get(getattr(hf_config, "model_type", None))
    return int(next((getattr(hf_config, k) for k in fam.experts_keys if getattr(hf_config, k, None)), 0) or 0) if fam else 0


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """Round the vocab up to a multiple of lcm(divisible_by, tp).

    Megatron-LM pads to divisible_by * tp, which makes the embedding's global shape depend on TP
    (32000 rows at TP2, 32256 at TP4), so a dist checkpoint saved at one TP no longer loads at
    another. lcm keeps the padded size the same for every power-of-two TP up to divisible_by."""
    multiple = math.lcm(divisible_by, tp)
    return ((vocab_size + multiple - 1) // multiple) * multiple


def rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type not in ("default", None):
        raise ValueError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(hf_config, "rope_theta", 10000.0))


@dataclass(frozen=True)
class ModelDims:
    """A model's shapes, from a HF config (+ TP size for the padded vocab): the one description of them
    that the weight mapping, the engine, the converter and the config checks all use."""

    model_type: str
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    value_head: bool = False  # critic: output_layer is the [1, hidden] value head
    qk_norm: bool = False  # qwen3: RMSNorm over each query / key head before RoPE
    # mixture of experts (qwen3_moe); num_experts 0: dense
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple = ()  # per layer: True where the MLP is the routed experts
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities (softmax over the k)
    grouped_experts: bool = False  # experts named as TE's TEGroupedMLP names them (expert_param_name)

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @classmethod
    def from_hf_config(cls, hf_config, tp: int = 1, value_head: bool = False,
                       vocab_divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> "ModelDims":
        mt = hf_config.model_type
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} not supported; choose one of {', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        qkv_bias = mt == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
        if mt != "qwen2" and getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        moe = MOE_FAMILIES[mt].dims(hf_config) if mt in MOE_FAMILIES else {}
        return cls(
            model_type=mt,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            padded_vocab_size=padded_vocab_size(hf_config.vocab_size, tp, vocab_divisible_by),
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head,
            qkv_bias=qkv_bias,
            value_head=value_head,
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            **moe,
        )

    @classmethod
    def from_hf_dict(cls, raw: dict, tp: int = 1, value_head: bool = False) -> "ModelDims":
        """From a HF config.json read as a dict (no transformers import)."""
        import types

        return cls.from_hf_config(types.SimpleNamespace(**raw), tp=tp, value_head=value_head)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def transformer_config_kwargs(hf_config) -> dict:
    """The megatron TransformerConfig fields that describe a HF llama/qwen2/mistral/qwen3 model (dropout
    off: every PPO model runs without dropout). Device/precision/fusion fields are set by the caller."""
    import torch.nn.functional as F

    dims = ModelDims.from_hf_config(hf_config)
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} not supported (SwiGLU/silu only)")
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True) \
            and hf_config.model_type in ("mistral", "mixtral"):
        raise ValueError(f"{hf_config.model_type} sliding_window attention is not supported; set sliding_window=None")
    if hf_config.model_type in ("qwen3", "qwen3_moe") and getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"{hf_config.model_type} use_sliding_window=True is not supported; set use_sliding_window=false")
    moe = {}
    if dims.num_experts:
        moe = dict(
            num_moe_experts=dims.num_experts,
            moe_router_topk=dims.moe_topk,
            moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
            moe_layer_freq=[int(m) for m in dims.moe_layers],  # explicit: megatron's int rule is i % N == 0
            # transformers: softmax over all experts in fp32, top-k, then (norm_topk_prob) renormalised over
            # the k. megatron: pre_softmax=False is a softmax over the top-k logits, the same numbers.
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not dims.norm_topk_prob,
            moe_router_dtype="fp32",
            # RL fine-tuning keeps the pretrained routing: no load-balancing or z-loss term (as slime's RL
            # recipes: --moe-aux-loss-coeff 0); megatron's defaults would add an aux loss to the PPO loss
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,  # SequentialMLP: megatron's local spec on CPU
            # alltoall: ranks of an expert-parallel group may hold different token counts (the engine cuts
            # each micro-batch to its longest row; allgather needs equal counts). On CPU with
            # parallel/cpu_compat.py's patch_moe_alltoall.
            moe_token_dispatcher_type="alltoall",
        )
    return dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        ffn_hidden_size=dims.ffn_hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        **moe,
    )


# ---- names --------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
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
_TOP_MAP = {
    "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
    "decoder.final_layernorm.weight": ["model.norm.weight"],
    "output_layer.weight": ["lm_head.weight"],
}
_VALUE_HEAD_MAP = {"output_layer.weight": ["score.weight"], "output_layer.bias": ["score.bias"]}


def megatron_param_names(dims: ModelDims, te_fused_norms: bool = False) -> list[str]:
    """Every (global-layer) megatron parameter name of the full model, in model order."""
    names = ["embedding.word_embeddings.weight"]
    for layer in range(dims.num_layers):
        p = f"decoder.layers.{layer}."
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
            for e in range(dims.num_experts):
                names += [p + expert_param_name(e, fc, dims.grouped_experts) for fc in ("linear_fc1", "linear_fc2")]
            continue
        names.append(p + ("mlp.linear_fc1.layer_norm_weight" if te_fused_norms else "pre_mlp_layernorm.weight"))
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
    m = _LAYER_RE.match(mcore_name)
    if m:
        layer, suffix = m.groups()
        e = parse_expert(suffix)
        if e:
            return hf_expert_names(f"model.layers.{layer}.{_moe_hf(dims).block}.experts.", e[0], dims.model_type, e[1])
        if suffix == "mlp.router.weight":  # the router [experts, hidden]
            return [f"model.layers.{layer}.{_moe_hf(dims).block}.gate.weight"]
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
    """A HF router or routed-expert tensor (of any MoE family)."""
    return any(f".{f.block}.experts." in hf_name or hf_name.endswith(f".{f.block}.gate.weight")
               for f in MOE_FAMILIES.values())


def routed_expert(mcore_name: str) -> Optional[int]:
    """The global expert index of a routed expert's megatron parameter; None for any other parameter."""
    m = _LAYER_RE.match(mcore_name)
    e = parse_expert(m.group(2)) if m else None
    return e[0] if e else None


def megatron_name(hf_name: str, dims: ModelDims, te_fused_norms: bool = False) -> str:
    """The megatron parameter (global layer index) that a HF tensor belongs to."""
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
        if dims.is_moe_layer(int(layer)) and suffix == "post_attention_layernorm.weight":
            return f"decoder.layers.{layer}.pre_mlp_layernorm.weight"
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


def global_named_parameters(chunk):
    """(global megatron name, param) for one megatron model chunk (layer and expert indices made global)."""
    name_of = global_namer(chunk)
    for name, p in chunk.named_parameters():
        yield name_of(name), p


def _kind(mcore_name: str, dims: ModelDims) -> str:
    m = _LAYER_RE.match(mcore_name)
    e = parse_expert(m.group(2)) if m else None
    if e:  # an expert's fc1 is column-parallel ([gate; up] per rank), its fc2 row-parallel
        return "fc1" if e[1] == "linear_fc1" else "row"
    if mcore_name.endswith("linear_qkv.weight") or mcore_name.endswith("linear_qkv.bias"):
        return "qkv"
    if mcore_name.endswith("linear_fc1.weight"):
        return "fc1"
    if mcore_name.endswith("linear_proj.weight") or mcore_name.endswith("linear_fc2.weight"):
        return "row"
    if mcore_name == "embedding.word_embeddings.weight" or (mcore_name == "output_layer.weight" and not dims.value_head):
        return "vocab"
    return "replicated"


def tp_split_dim(mcore_name: str, dims: ModelDims) -> Optional[int]:
    """Which dim of the megatron tensor TP splits (None: replicated)."""
    return {"qkv": 0, "fc1": 0, "vocab": 0, "row": 1, "replicated": None}[_kind(mcore_name, dims)]


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


def iter_hf_to_megatron(get_hf, mcore_names: Iterable[str], dims: ModelDims, tp_rank: int, tp_size: int):
    """Stream (mcore_name, shard) for the given names; `get_hf(name)` returns one full HF tensor."""
    for name in mcore_names:
        hf = {n: get_hf(n) for n in hf_names(name, dims)}
        yield name, hf_to_megatron_shard(name, hf, dims, tp_rank, tp_size)
