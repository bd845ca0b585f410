"""What a model is, in the numbers megatron needs: `ModelDims` (read from a HF config), the families
megappo supports (dense and MoE: `MOE_FAMILIES`' HF names), the padded vocabulary, megatron's
TransformerConfig arguments, and the LoRA targets by how TP splits them. No torch: the config schema and
the driver read these before Ray (and torch) start. Names and tensor layouts are parallel/weight_mapping.py's.
The config.json keys vLLM's loaders read otherwise than transformers are written for vLLM by
conversion/vllm_config.py; what vLLM cannot build at all (qwen2_moe without q/k/v biases) is refused here,
where the config checks read it before anything runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe",
                         "deepseek_v3", "qwen2_5_vl")
MLA_MODEL_TYPES = ("deepseek_v3",)  # multi-latent attention (megatron's MLASelfAttention)
# vision-language models: model_type -> the family of its language model (config.json's text_config), whose tensors
# keep that family's names (`model.*`, `lm_head`); the vision tower's are `visual.*`, megatron's names too
# (models/vision.py holds HF's module under that attribute). M-RoPE's sections come from the text config.
VISION_MODEL_TYPES = {"qwen2_5_vl": "qwen2"}
VISION_PREFIX = "visual."
# DeepSeek-V3's router in config.json's keys, which transformers' DeepseekV3 computes whatever they say (megatron:
# MoeFamily.router / expert_bias); a config without them gets them for vLLM (conversion/vllm_config.py)
DEEPSEEK_V3_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# TE's MLA spec fuses the latent norms into the up projections and keeps the down projections whole: another mapping
MLA_WITHOUT_TE = ("model.transformer_engine=true is not supported for multi-latent attention (deepseek_v3): "
                  "megappo maps MLA on megatron's local spec; leave it null")

# multi-latent attention's projections in megatron's names, each column-parallel on megatron's local spec (split
# along the output); vLLM keeps the down projections whole on every rank
MLA_DOWN_LINEARS = ("linear_q_down_proj", "linear_kv_down_proj")
MLA_COLUMN_LINEARS = MLA_DOWN_LINEARS + ("linear_q_up_proj", "linear_q_proj", "linear_kv_up_proj")

# LoRA (models/lora.py, config actor.lora): megatron's fused / parallel linears an adapter may wrap, by how
# their weight is split over TP (column: along the output; row: along the input), and the inits of A.
# LORA_TARGETS (the default) is a GQA model's attention and MLP; under MLA its projections take linear_qkv's place.
LORA_COLUMN_TARGETS = ("linear_qkv", "linear_fc1")  # fused: q/k/v, gate/up
LORA_ROW_TARGETS = ("linear_proj", "linear_fc2")
LORA_TARGETS = LORA_COLUMN_TARGETS + LORA_ROW_TARGETS
LORA_MLA_TARGETS = MLA_COLUMN_LINEARS
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
    # a shared expert beside the routed ones (every token through it): its HF module under the layer's `mlp.`,
    # its FFN size's config.json key, and whether a sigmoid gate scales it (`mlp.{shared}_gate.weight` [1, H])
    shared: Optional[str] = None
    shared_ffn_key: str = ""
    shared_gate: bool = False
    # DeepSeek-style shared experts: `n_shared_experts` of the routed experts' FFN size, one MLP of their sum
    shared_count_key: str = ""
    # routed layers from `first_k_dense_replace` on (the first k dense), the DeepSeek / GLM rule
    first_dense_key: str = ""
    # the router: "softmax" (over all experts, top-k) or "sigmoid" (per expert; the top-k renormalised, times
    # routed_scaling_factor; n_group / topk_group limit the choice to the best groups), and whether the choice
    # adds the fp32 buffer `{block}.gate.e_score_correction_bias` (aux-loss-free balancing; frozen in RL)
    router: str = "softmax"
    expert_bias: bool = False

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
        if self.first_dense_key:
            k = int(getattr(hf_config, self.first_dense_key, 0) or 0)
            moe_layers = tuple(i >= k for i in range(layers))
        elif self.sparse_layers:  # transformers' rule (Qwen3MoeDecoderLayer): (i+1) % step == 0, except mlp_only_layers
            step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
            moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        else:
            moe_layers = (True,) * layers
        norm = self.norm_topk_prob if self.norm_topk_prob is not None else bool(getattr(hf_config, "norm_topk_prob", False))
        ffn = int(getattr(hf_config, self.ffn_key))
        if self.shared_count_key:
            shared = int(getattr(hf_config, self.shared_count_key, 0) or 0) * ffn
        else:
            shared = int(getattr(hf_config, self.shared_ffn_key, 0) or 0) if self.shared else 0
        topk = int(hf_config.num_experts_per_tok)
        router = dict(router_score=self.router, expert_bias=self.expert_bias)
        if self.router == "sigmoid":
            if not norm:  # megatron renormalises a sigmoid router's top-k whenever k > 1
                raise ValueError(f"{mt} norm_topk_prob=false with a sigmoid router is not supported (megatron-core "
                                 "always renormalises its top-k); set norm_topk_prob true")
            groups, group_topk = int(getattr(hf_config, "n_group", 1) or 1), int(getattr(hf_config, "topk_group", 1) or 1)
            if groups > 1 and topk != 2 * group_topk:  # HF scores a group by its top-2, megatron by top-(k / groups)
                raise ValueError(f"{mt} n_group={groups} with num_experts_per_tok={topk} != 2 * topk_group="
                                 f"{group_topk} is not supported (megatron scores a group by its top-(k/topk_group) "
                                 "experts, transformers and vLLM by its top-2)")
            router.update(moe_scaling=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
                          moe_groups=groups if groups > 1 else 0, moe_group_topk=group_topk if groups > 1 else 0)
        return dict(num_experts=int(experts), moe_topk=topk, moe_ffn_hidden_size=ffn, norm_topk_prob=norm,
                    moe_layers=moe_layers, shared_expert_ffn=shared, shared_expert_gate=bool(shared) and self.shared_gate,
                    **router)

    def hf_keys(self, num_experts: int, topk: int, ffn: int, decoder_sparse_step: int = 1,
                mlp_only_layers=(), norm_topk_prob: bool = False, shared_ffn: int = 0, first_dense: int = 0) -> dict:
        """The config.json keys this family reads (`dims`), from the fields of a config's model.arch."""
        d = {self.experts_keys[0]: num_experts, "num_experts_per_tok": topk, self.ffn_key: ffn}
        if self.shared_count_key:
            d[self.shared_count_key] = shared_ffn // ffn if ffn else 0
        elif self.shared:
            d[self.shared_ffn_key] = shared_ffn
        if self.first_dense_key:
            d[self.first_dense_key] = first_dense
        if self.ffn_key == "intermediate_size":  # experts of the dense FFN size: model.arch's intermediate_size
            del d[self.ffn_key]
        if self.sparse_layers:
            d.update(decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers))
        if self.norm_topk_prob is None:
            d["norm_topk_prob"] = norm_topk_prob
        return d


_DEEPSEEK_EXPERTS = MoeFamily("mlp", {"linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"]},
                              experts_keys=("n_routed_experts",), ffn_key="moe_intermediate_size", sparse_layers=False,
                              shared="shared_experts", shared_count_key="n_shared_experts",
                              first_dense_key="first_k_dense_replace", router="sigmoid", expert_bias=True)

MOE_FAMILIES = {
    "qwen3_moe": MoeFamily("mlp", {"linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"]},
                           experts_keys=("num_experts", "num_local_experts"), ffn_key="moe_intermediate_size",
                           sparse_layers=True),
    # every layer routed; softmax over all experts, top-k renormalised; experts of intermediate_size
    "mixtral": MoeFamily("block_sparse_moe", {"linear_fc1": ["w1", "w3"], "linear_fc2": ["w2"]},
                         experts_keys=("num_local_experts",), ffn_key="intermediate_size", sparse_layers=False,
                         norm_topk_prob=True, refused=(("router_jitter_noise", "random routing in training"),)),
    # Qwen1.5/2-MoE: qwen3_moe's routing (norm_topk_prob false in the released models) plus one shared expert
    # behind a sigmoid gate; q/k/v biases
    "qwen2_moe": MoeFamily("mlp", {"linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"]},
                           experts_keys=("num_experts",), ffn_key="moe_intermediate_size", sparse_layers=True,
                           shared="shared_expert", shared_ffn_key="shared_expert_intermediate_size",
                           shared_gate=True),
    # DeepSeek-V3's experts (V3 / R1 / V3.1, Kimi-K2; under multi-latent attention: ModelDims' MLA fields), which
    # GLM-4.5 / 4.6 / 4.5-Air share: the first k layers dense, then routed experts under a sigmoid router with the
    # e_score_correction_bias, routed_scaling_factor and n_group, n_shared_experts beside them (GLM adds q/k/v
    # biases, per-head q/k norms (use_qk_norm) and RoPE on half of each head (partial_rotary_factor))
    "deepseek_v3": _DEEPSEEK_EXPERTS,
    "glm4_moe": _DEEPSEEK_EXPERTS,
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


def rope_params(hf_config) -> dict:
    """The RoPE parameters: transformers 5's rope_parameters, else a checkpoint's rope_scaling ({} when none)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return params if isinstance(params, dict) else {}


def rope_type(hf_config) -> str:
    params = rope_params(hf_config)
    return params.get("rope_type", params.get("type", "default")) or "default"


def rope_theta(hf_config) -> float:
    """RoPE's base. Default RoPE everywhere; YaRN only under multi-latent attention (megatron's MLA applies it)."""
    hf_config = language_config(hf_config)
    allowed = ("default", "yarn") if getattr(hf_config, "model_type", None) in MLA_MODEL_TYPES else ("default",)
    if rope_type(hf_config) not in allowed:
        raise ValueError(f"rope_type {rope_type(hf_config)!r} is not supported (only {' and '.join(allowed)} RoPE)")
    theta = rope_params(hf_config).get("rope_theta")
    return float(theta if theta is not None else getattr(hf_config, "rope_theta", 10000.0))


def _mla_dims(hf_config) -> dict:
    """ModelDims' multi-latent-attention fields of a DeepSeek-V3 config, or a one-line refusal of what megatron
    would compute differently or the config contradicts."""
    mt = hf_config.model_type
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not getattr(hf_config, key, None):
            raise ValueError(f"a {mt} config needs {key} (its config.json; model.arch: kv_lora_rank, qk_nope_head_dim, "
                             "qk_rope_head_dim and head_dim = v_head_dim)")
    other = {k: v for k, v in ((k, getattr(hf_config, k, None)) for k in DEEPSEEK_V3_ROUTER)
             if v is not None and v != DEEPSEEK_V3_ROUTER[k]}
    if other:  # transformers ignores them, vLLM (and any reader of an export) routes by them
        raise ValueError(f"{mt} config.json needs topk_method 'noaux_tc' and scoring_func 'sigmoid' (DeepSeek-V3's "
                         f"router, which transformers computes whatever they say), not "
                         f"{', '.join(f'{k} {v!r}' for k, v in other.items())}; set them or drop them")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError(f"{mt} attention_bias=true is not supported (megatron's MLA has no projection biases)")
    if getattr(hf_config, "rope_interleave", True) is False:
        raise ValueError(f"{mt} rope_interleave=false is not supported (megatron's and vLLM's MLA rotate "
                         "interleaved pairs); set it true")
    return dict(q_lora_rank=int(getattr(hf_config, "q_lora_rank", None) or 0), kv_lora_rank=int(hf_config.kv_lora_rank),
                qk_nope_dim=int(hf_config.qk_nope_head_dim), qk_rope_dim=int(hf_config.qk_rope_head_dim))


def _mla_kwargs(dims: "ModelDims", hf_config) -> dict:
    """megatron's MLATransformerConfig fields of a DeepSeek-V3 model: the q/kv latent ranks and head dims, the
    a-layernorms (megatron's qk_layernorm: without it MLA silently drops them), kv_channels = v's head dim (the
    core attention's output), YaRN as the checkpoint sets it (megatron's softmax mscale^2 only with YaRN)."""
    params, yarn = rope_params(hf_config), rope_type(hf_config) == "yarn"
    return dict(multi_latent_attention=True, q_lora_rank=dims.q_lora_rank or None, kv_lora_rank=dims.kv_lora_rank,
                qk_head_dim=dims.qk_nope_dim, qk_pos_emb_head_dim=dims.qk_rope_dim, v_head_dim=dims.head_dim,
                qk_layernorm=True, rope_type="yarn" if yarn else "rope", rotary_base=rope_theta(hf_config),
                rotary_scaling_factor=float(params.get("factor", 1.0)) if yarn else 1.0,
                original_max_position_embeddings=int(params.get("original_max_position_embeddings", 4096)),
                beta_fast=float(params.get("beta_fast", 32)), beta_slow=float(params.get("beta_slow", 1)),
                mscale=float(params.get("mscale", 1.0)) if yarn else 1.0,
                mscale_all_dim=float(params.get("mscale_all_dim", 0.0) or 0.0) if yarn else 0.0)


def _namespace(d: dict):
    import types

    return types.SimpleNamespace(**d)


def language_config(hf_config):
    """A vision-language config's language model as a config of its text family (VISION_MODEL_TYPES): the text
    config's fields, the top level's tie_word_embeddings, and M-RoPE's rope type read as default RoPE (its sections
    are ModelDims.mrope_section). A text model's config is returned as it is."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in VISION_MODEL_TYPES:
        return hf_config
    text = hf_config.text_config
    fields = dict(text) if isinstance(text, dict) else text.to_dict()
    params = dict(rope_params(_namespace(fields)))
    if "mrope_section" not in params:
        raise ValueError(f"a {mt} config needs text_config.rope_parameters.mrope_section (M-RoPE's temporal, height "
                         "and width sections; rope_scaling.mrope_section in older config.json files)")
    if params.get("rope_type", params.get("type")) in ("mrope", "default", None):
        params["rope_type"] = "default"
    fields.update(model_type=VISION_MODEL_TYPES[mt], rope_parameters=params, rope_scaling=None,
                  mrope_section=list(params["mrope_section"]),
                  tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))
    return _namespace(fields)


def rotary_percent(hf_config) -> float:
    """The share of each head's dims RoPE rotates (the first ones, NeoX-style halves): partial_rotary_factor,
    at the top level or in rope_parameters (transformers 5), else 1."""
    value = getattr(hf_config, "partial_rotary_factor", None)
    if value is None:
        value = rope_params(hf_config).get("partial_rotary_factor")
    return float(value) if value is not None else 1.0


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
    shared_expert_ffn: int = 0  # the shared expert's FFN size (0: none; megatron's mlp.shared_experts)
    shared_expert_gate: bool = False  # a sigmoid gate [1, hidden] scales the shared expert (Qwen2-MoE)
    router_score: str = "softmax"  # MoeFamily.router
    expert_bias: bool = False  # the router's fp32 e_score_correction_bias buffer (megatron's router.expert_bias)
    moe_scaling: float = 1.0  # routed_scaling_factor: the renormalised top-k weights times this
    moe_groups: int = 0  # n_group > 1: group-limited top-k over moe_group_topk (topk_group) groups; 0: none
    moe_group_topk: int = 0
    rotary_percent: float = 1.0  # the share of each head RoPE rotates (GLM-4.5: partial_rotary_factor 0.5)
    # multi-latent attention (DeepSeek-V3; kv_lora_rank 0: none): q through a rank-q_lora_rank bottleneck (0: a
    # plain q_proj, V2-Lite style), k/v from one shared latent of kv_lora_rank plus a qk_rope_dim RoPE key; per
    # head q/k of qk_nope_dim + qk_rope_dim, v of v_head_dim (= head_dim)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    # multi-token-prediction layers a checkpoint stores after the decoder (`model.layers.{num_layers + i}.*`,
    # num_nextn_predict_layers): not part of the policy, skipped on import and not exported
    mtp_layers: int = 0
    # a vision-language model (VISION_MODEL_TYPES): its language model's M-RoPE sections (temporal, height, width
    # frequency pairs; () for a text model); the vision tower's tensors are VISION_PREFIX's
    mrope_section: tuple = ()

    @property
    def vision(self) -> bool:
        return bool(self.mrope_section)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def is_mtp_tensor(self, hf_name: str) -> bool:
        """A HF tensor of a multi-token-prediction layer (`model.layers.{num_layers + i}.`, i < mtp_layers)."""
        return any(hf_name.startswith(f"model.layers.{self.num_layers + i}.") for i in range(self.mtp_layers))

    @classmethod
    def from_hf_config(cls, hf_config, tp: int = 1, value_head: bool = False,
                       vocab_divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> "ModelDims":
        mt = hf_config.model_type
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} not supported; choose one of {', '.join(SUPPORTED_MODEL_TYPES)}")
        if mt in VISION_MODEL_TYPES:
            import dataclasses

            text = language_config(hf_config)
            return dataclasses.replace(cls.from_hf_config(text, tp, value_head, vocab_divisible_by), model_type=mt,
                                       mrope_section=tuple(text.mrope_section))
        quant = getattr(hf_config, "quantization_config", None)
        if quant:
            method = (quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)) or "a"
            raise ValueError(f"{mt}: a {method} quantized checkpoint (config.json quantization_config) is not supported; "
                             "convert it to bf16 first (DeepSeek-V3's FP8 weights: inference/fp8_cast_bf16.py in its "
                             "repository) and drop quantization_config")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        qkv_bias = mt == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
        if mt == "qwen2_moe":  # config.json's qkv_bias (true when absent, as in the released models)
            qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
            if not qkv_bias:
                raise ValueError("qwen2_moe with qkv_bias=false is not supported (vLLM's qwen2_moe always loads q/k/v "
                                 "biases); set qkv_bias true")
        if mt != "qwen2" and getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        moe = MOE_FAMILIES[mt].dims(hf_config) if mt in MOE_FAMILIES else {}
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        mla = _mla_dims(hf_config) if mt in MLA_MODEL_TYPES else {}
        if mla:  # keys of every head (num_query_groups = heads); head_dim is v's (megatron's kv_channels)
            kv_heads, head_dim = heads, int(hf_config.v_head_dim)
        return cls(
            model_type=mt,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            padded_vocab_size=padded_vocab_size(hf_config.vocab_size, tp, vocab_divisible_by),
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head,
            qkv_bias=qkv_bias,
            value_head=value_head,
            qk_norm=mt in ("qwen3", "qwen3_moe") or bool(getattr(hf_config, "use_qk_norm", False)),
            rotary_percent=rotary_percent(hf_config),
            mtp_layers=int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0),
            **moe,
            **mla,
        )

    @classmethod
    def from_hf_dict(cls, raw: dict, tp: int = 1, value_head: bool = False) -> "ModelDims":
        """From a HF config.json read as a dict (no transformers import)."""
        return cls.from_hf_config(_namespace(raw), tp=tp, value_head=value_head)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _sigmoid_router_kwargs(dims: ModelDims) -> dict:
    """DeepSeek-V3 / GLM-4.5's router in megatron's names: the expert bias enters the choice only; RL keeps it
    where pretraining left it (update rate 0, so megatron's finalize_model_grads adds exactly 0: it stays bit
    for bit, as slime's scripts run it); the top-k renormalised (megatron always does for a sigmoid router),
    then scaled; group-limited top-k when n_group > 1."""
    if dims.router_score != "sigmoid":
        return {}
    out = dict(moe_router_enable_expert_bias=dims.expert_bias, moe_router_bias_update_rate=0.0,
               moe_router_topk_scaling_factor=dims.moe_scaling if dims.moe_scaling != 1.0 else None)
    if dims.moe_groups:
        out.update(moe_router_num_groups=dims.moe_groups, moe_router_group_topk=dims.moe_group_topk)
    return out


def transformer_config_kwargs(hf_config, grouped_gemm: bool = False) -> dict:
    """The megatron TransformerConfig fields that describe a HF llama/qwen2/mistral/qwen3 model (dropout
    off: every PPO model runs without dropout). Device/precision/fusion fields are set by the caller.
    `grouped_gemm`: the routed experts as one grouped GEMM (TE's TEGroupedMLP, named as
    weight_mapping.expert_param_name's grouped form), which the caller asks for when it builds TE's layer spec;
    megatron-core 0.19.2's local spec has only SequentialMLP (a loop over the experts) whatever this says."""
    import torch.nn.functional as F

    dims = ModelDims.from_hf_config(hf_config)
    hf_config = language_config(hf_config)
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
            moe_router_score_function=dims.router_score,
            moe_router_pre_softmax=not dims.norm_topk_prob and dims.router_score == "softmax",
            moe_router_dtype="fp32",
            **_sigmoid_router_kwargs(dims),
            # RL fine-tuning keeps the pretrained routing: no load-balancing or z-loss term (as slime's RL
            # recipes: --moe-aux-loss-coeff 0); megatron's defaults would add an aux loss to the PPO loss
            moe_router_load_balancing_type="none",
            # the shared expert (every token; Qwen2-MoE: scaled by sigmoid(gate . x)), beside the routed ones
            **(dict(moe_shared_expert_intermediate_size=dims.shared_expert_ffn,
                    moe_shared_expert_gate=dims.shared_expert_gate) if dims.shared_expert_ffn else {}),
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=grouped_gemm,
            # alltoall: ranks of an expert-parallel group may hold different token counts (the engine cuts
            # each micro-batch to its longest row; allgather needs equal counts). On CPU with
            # parallel/cpu_compat.py's patch_moe_alltoall.
            moe_token_dispatcher_type="alltoall",
        )
    return dict(
        **(_mla_kwargs(dims, hf_config) if dims.mla else dict(qk_layernorm=dims.qk_norm)),
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
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        **(dict(mrope_section=list(dims.mrope_section)) if dims.vision else {}),
        **moe,
    )
