"""Parameter counts of a config's model.arch, as `megappo plan` counts them (memory_model.py states the model):
per layer (attention, multi-latent attention, the MoE layers and their experts, shared experts), per GPU of the worst
pipeline stage, in all; LoRA's adapters and an adapter sync; vLLM's KV cache per token and the parameters every
rollout TP rank holds whole. Shapes only: no torch."""

from __future__ import annotations

import math

from megappo.config.validate import arch_as_hf
from megappo.parallel.weight_mapping import MLA_DOWN_LINEARS, MOE_FAMILIES, ModelDims, mla_shapes, padded_vocab_size


def _mla_shapes(a) -> dict[str, tuple]:
    """model.arch's multi-latent attention tensors (weight_mapping.mla_shapes, the one statement of them)."""
    return mla_shapes(ModelDims.from_hf_dict(arch_as_hf(a)))


def _mla_projections(a) -> dict[str, tuple[int, int]]:
    """Multi-latent attention's projections into and out of the latents, megatron's name -> (fan_in, fan_out)."""
    return {k.removesuffix(".weight"): (shape[1], shape[0]) for k, shape in _mla_shapes(a).items()
            if k.startswith("linear_") and k != "linear_proj.weight"}


def _mla_params(a) -> int:
    """Multi-latent attention's projections, latent norms and output projection."""
    return sum(math.prod(shape) for shape in _mla_shapes(a).values())


def rollout_whole_params(a) -> int:
    """Parameters every rollout TP rank holds whole: MLA's down projections (vLLM's replicated fused_qkv_a_proj
    / kv_a_proj_with_mqa: the tensors weight_mapping.whole_in_rollout names)."""
    if not a.kv_lora_rank:
        return 0
    shapes = _mla_shapes(a)
    return a.num_layers * sum(math.prod(shapes[f"{c}.weight"]) for c in MLA_DOWN_LINEARS if f"{c}.weight" in shapes)


def kv_cache_bytes_per_token(cfg) -> int:
    """vLLM's KV cache per token on one rollout GPU (2-byte cache): k and v of the kv heads split over rollout TP
    (replicated when TP exceeds them), or MLA's one latent (kv_lora_rank + the RoPE key) per layer on every rank."""
    a, tp = cfg.model.arch, cfg.rollout.tp
    if a.kv_lora_rank:
        return 2 * a.num_layers * (a.kv_lora_rank + a.qk_rope_head_dim)
    head_dim = a.head_dim or a.hidden_size // a.num_attention_heads
    return 2 * a.num_layers * 2 * max(1, a.num_kv_heads // tp) * head_dim


def _attention_params(a) -> int:
    """Attention + the two norms of one layer (+ q/k norms for qwen3)."""
    if a.kv_lora_rank:
        return _mla_params(a) + 2 * a.hidden_size
    head_dim = a.head_dim or a.hidden_size // a.num_attention_heads
    qkv = a.hidden_size * (a.num_attention_heads + 2 * a.num_kv_heads) * head_dim
    qkv_bias = (a.num_attention_heads + 2 * a.num_kv_heads) * head_dim if a.qkv_bias else 0
    proj = a.num_attention_heads * head_dim * a.hidden_size
    qk_norm = 2 * head_dim if a.family in ("qwen3", "qwen3_moe") or a.qk_norm else 0
    return qkv + qkv_bias + proj + 2 * a.hidden_size + qk_norm


def moe_layers(a) -> int:
    """How many layers are mixture-of-experts (transformers' rule: (i + 1) % step == 0, not in mlp_only_layers)."""
    if not a.num_experts or a.family not in MOE_FAMILIES:  # a dense family: ModelDims ignores experts too
        return 0
    if MOE_FAMILIES[a.family].first_dense_key:  # the first k dense (glm4_moe)
        return max(0, a.num_layers - a.first_k_dense_replace)
    if not MOE_FAMILIES[a.family].sparse_layers:  # every layer routed (mixtral)
        return a.num_layers
    dense = set(a.mlp_only_layers or [])
    return sum(1 for i in range(a.num_layers) if i not in dense and (i + 1) % max(1, a.decoder_sparse_step) == 0)


def expert_params_per_layer(a) -> int:
    if a.family not in MOE_FAMILIES:
        return 0
    ffn = getattr(a, MOE_FAMILIES[a.family].ffn_key)  # mixtral: experts of intermediate_size
    return a.num_experts * 3 * a.hidden_size * ffn


def shared_expert_params(a) -> tuple[int, int]:
    """(TP-split, replicated) parameters of one MoE layer's shared expert: its gate/up/down, and its sigmoid
    gate [1, hidden] where the family has one. Dense parameters: every token goes through them."""
    fam = MOE_FAMILIES.get(a.family)
    if fam is None or not fam.shared or not a.shared_expert_intermediate_size:
        return 0, 0
    return 3 * a.hidden_size * a.shared_expert_intermediate_size, a.hidden_size if fam.shared_gate else 0


def router_params(a) -> int:
    """One MoE layer's router: its [experts, hidden] weight, and a sigmoid router's correction bias [experts] (a
    buffer, frozen, but weights vLLM loads and the sync sends). Replicated over TP."""
    fam = MOE_FAMILIES.get(a.family)
    return a.num_experts * a.hidden_size + (a.num_experts if fam is not None and fam.expert_bias else 0)


def layer_params(cfg) -> int:
    """A dense layer's parameters."""
    a = cfg.model.arch
    return _attention_params(a) + 3 * a.hidden_size * a.intermediate_size


def stage_split(cfg, tp: int, pp: int, ep: int, head: str, first_stage: int = 0) -> tuple[int, int]:
    """(dense, expert) parameters on one GPU of the worst pipeline stage (head: 'lm' or 'value'); `first_stage`: dense
    parameters the first stage holds besides (a vision tower, whole on every TP rank)."""
    a = cfg.model.arch
    emb = padded_vocab_size(a.vocab_size, tp) * a.hidden_size // tp
    out = emb if head == "lm" else a.hidden_size  # value head is replicated [1, hidden]
    n_moe = moe_layers(a)
    per_stage = a.num_layers / pp
    moe_per_stage, dense_per_stage = n_moe / pp, (a.num_layers - n_moe) / pp
    shared, shared_replicated = shared_expert_params(a)
    dense = int(per_stage * _attention_params(a) + dense_per_stage * 3 * a.hidden_size * a.intermediate_size
                + moe_per_stage * shared) // tp \
        + int(moe_per_stage * (router_params(a) + shared_replicated))  # routers: replicated over tp
    experts = int(moe_per_stage * expert_params_per_layer(a)) // (tp * ep)
    if pp == 1:
        return dense + emb + first_stage + a.hidden_size + (0 if (head == "lm" and a.tie_word_embeddings) else out), \
            experts
    return max(dense + emb + first_stage, dense + a.hidden_size + out), experts  # first stage vs last stage


def total_params(cfg) -> int:
    a = cfg.model.arch
    emb = a.vocab_size * a.hidden_size
    n_moe = moe_layers(a)
    layers = (a.num_layers - n_moe) * layer_params(cfg) + n_moe * (
        _attention_params(a) + router_params(a) + expert_params_per_layer(a) + sum(shared_expert_params(a)))
    return emb * (1 if a.tie_word_embeddings else 2) + layers + a.hidden_size


def lora_rank(cfg) -> int:
    """actor.lora.rank (0: full fine-tuning)."""
    return int(getattr(getattr(cfg.actor, "lora", None), "rank", 0) or 0)


def lora_params(a, lora, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) adapter parameters on one GPU of a pipeline stage (layers / pp of them): A [r, in] and
    B [out, r] per targeted linear, the split one of the two divided by tp (a MoE layer's shared expert too, as
    a dense MLP; multi-latent attention's projections by their own shapes). Routed experts carry adapters
    only with lora.experts (each of the num_experts / ep local experts its fc1 / fc2's, split as a dense MLP's
    over expert TP = tp)."""
    r = int(lora.rank)
    head_dim = a.head_dim or a.hidden_size // a.num_attention_heads
    h, q = a.hidden_size, a.num_attention_heads * head_dim
    ffn = a.intermediate_size
    shapes = {"linear_qkv": (h, (a.num_attention_heads + 2 * a.num_kv_heads) * head_dim, "column"),
              "linear_proj": (q, h, "row"), "linear_fc1": (h, 2 * ffn, "column"), "linear_fc2": (ffn, h, "row")}
    if a.kv_lora_rank:  # multi-latent attention's projections, each column-parallel
        shapes.update({name: (i, o, "column") for name, (i, o) in _mla_projections(a).items()})
    n_moe = moe_layers(a)

    def per_linear(fan_in, fan_out, split) -> float:  # column: B split with the output; row: A with the input
        return r * (fan_in + fan_out / tp) if split == "column" else r * (fan_in / tp + fan_out)

    total = 0.0
    for name in lora.target_modules:
        layers = a.num_layers - n_moe if name in ("linear_fc1", "linear_fc2") else a.num_layers
        total += per_linear(*shapes[name]) * layers / pp
    fs = a.shared_expert_intermediate_size if n_moe else 0  # a MoE layer's shared expert: a dense MLP's adapters
    shared = {"linear_fc1": (h, 2 * fs, "column"), "linear_fc2": (fs, h, "row")}
    total += sum(per_linear(*shared[t]) for t in lora.target_modules if t in shared and fs) * n_moe / pp
    experts = 0.0
    if getattr(lora, "experts", False) and n_moe:
        f = getattr(a, MOE_FAMILIES[a.family].ffn_key)
        expert_shapes = {"linear_fc1": (h, 2 * f, "column"), "linear_fc2": (f, h, "row")}
        per_expert = sum(per_linear(*expert_shapes[t]) for t in lora.target_modules if t in expert_shapes)
        experts = per_expert * a.num_experts / ep * n_moe / pp
    return int(total), int(experts)


def adapter_sync_params(a, lora) -> int:
    """What rollout.lora_sync=adapter sends vLLM each step: the whole adapter in peft's layout
    (models/lora_peft.megatron_lora_to_hf), lora_params' count at TP1 plus A once more for each further HF module of a
    fused linear (q, k and v share linear_qkv's A; gate and up, linear_fc1's: every family here gates its MLP).
    Expert adapters are counted for completeness: the config refuses adapter sync with them today (vLLM's
    fused-MoE LoRA), and a MoE model's adapter sync targets attention only."""
    dense, experts = lora_params(a, lora)
    r, h, n_moe = int(lora.rank), a.hidden_size, moe_layers(a)
    extra = 2 * r * h * a.num_layers if "linear_qkv" in lora.target_modules else 0
    if "linear_fc1" in lora.target_modules:
        extra += r * h * (a.num_layers - n_moe)
        if getattr(lora, "experts", False) and n_moe:
            extra += r * h * a.num_experts * n_moe
    return dense + experts + extra
