"""Build megatron-core GPTModel chunks (an LM head, or a value head for critics and reward models) from a HuggingFace
llama / qwen2 / mistral / qwen3 config, and load HF safetensors weights into whatever TP/PP/VPP layout this
rank holds (through parallel/weight_mapping.py).

Local (pure megatron-core) layer spec on CPU; the Transformer Engine spec when TE and a GPU exist.
Dropout is off in every model built here (PPO log-probs must be deterministic).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch

from megappo.parallel.device import transformer_engine_problem
from megappo.parallel.layout import ParallelLayout
from megappo.parallel.weight_mapping import LORA_COLUMN_TARGETS, MLA_WITHOUT_TE, ModelDims, global_named_parameters, \
    hf_names, hf_to_megatron_shard, language_config, rope_theta, transformer_config_kwargs


def use_transformer_engine(device: str, want: Optional[bool] = None, packed: bool = False, lora=None,
                          mla: bool = False) -> bool:
    """Whether the engine builds TE's layer spec (model.transformer_engine). None: on GPU when TE is usable
    (the local spec otherwise, said once), and never for packed rows (`packed`: pack_sequences, whose
    attention is the local spec's; TE's needs the THD path, not wired) nor for a LoRA (`lora`: a
    models.lora.LoraConfig) that TE's spec cannot take: a column-parallel target (TE fuses linear_qkv's /
    linear_fc1's input norm into the linear) or routed experts (TE's grouped GEMM); True: TE, or a one-line
    error naming what is missing; False: the local spec. Never on CPU (TE has no CPU kernels), nor for
    multi-latent attention (`mla`: TE's MLA spec fuses the latent norms into the up projections and keeps the
    down projections whole on every rank; megappo's weight mapping is the local spec's)."""
    if mla:
        if want:
            raise ValueError(MLA_WITHOUT_TE)
        return False
    lora_local = lora is not None and (lora.experts or bool(set(lora.target_modules) & set(LORA_COLUMN_TARGETS)))
    if want is None and (packed or lora_local):
        return False
    if want is False or device != "cuda":
        if want:
            raise ValueError("model.transformer_engine=true needs resources.device=cuda (TE has no CPU kernels); "
                             "leave it null")
        return False
    problem = transformer_engine_problem()
    if problem is None:
        return True
    if want:
        raise RuntimeError(f"model.transformer_engine=true but Transformer Engine is not usable ({problem}): "
                           "install it as requirements-gpu-te.txt says (`make install-gpu`) or leave "
                           "model.transformer_engine null")
    import warnings

    warnings.warn(f"Transformer Engine not usable ({problem}): megatron's local layer spec instead "
                  "(slower; model.transformer_engine=true makes this an error)", stacklevel=2)
    return False


def gpu_build_kwargs(on_gpu: bool, use_te: bool, rope_fusion_available: Optional[bool] = None,
                     grad_accum_fusion_available: Optional[bool] = None) -> dict:
    """TransformerConfig's placement and fusion switches. CPU: built on the host, every fused kernel off
    (they are CUDA kernels). GPU: weights allocated on the device at once (no host copy per rank; the
    HF weights are copied in afterwards), megatron's jit-fused bias-dropout-add and SwiGLU, TE's fused
    RoPE when TE is in use and has it, fused weight-gradient accumulation only with apex's CUDA
    extension (megatron's own ColumnParallelLinear, the output layer, raises without it)."""
    if not on_gpu:
        return dict(use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
                    masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
                    bias_dropout_fusion=False)
    if rope_fusion_available is None:
        from megatron.core.models.common.embeddings import rope_utils

        rope_fusion_available = getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None
    if grad_accum_fusion_available is None:
        from megatron.core.tensor_parallel import layers

        grad_accum_fusion_available = bool(getattr(layers, "_grad_accum_fusion_available", False))
    return dict(use_cpu_initialization=False, gradient_accumulation_fusion=use_te and grad_accum_fusion_available,
                bias_activation_fusion=True, masked_softmax_fusion=False,  # TE's attention has its own
                persist_layer_norm=False, apply_rope_fusion=use_te and rope_fusion_available,
                bias_dropout_fusion=True)


def load_hf_config(model_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_path))


def build_transformer_config(hf_config, layout: ParallelLayout, *, device: str = "cpu",
                             params_dtype: Optional[torch.dtype] = None, recompute: bool = False,
                             sequence_parallel: bool = False, batch_p2p_comm: Optional[bool] = None,
                             use_te: bool = False, moe: Optional[dict] = None):
    """megatron TransformerConfig for a HF config under `layout`. bf16 on GPU, fp32 on CPU by default.
    `moe`: TransformerConfig fields overriding the MoE defaults of weight_mapping.transformer_config_kwargs."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = device == "cuda"
    dtype = params_dtype or (torch.bfloat16 if on_gpu else torch.float32)
    if batch_p2p_comm is None:
        # gloo + interleaved schedule with batch_p2p_comm=True gives silently wrong results (docs/ENVIRONMENT.md)
        batch_p2p_comm = on_gpu
    kw = transformer_config_kwargs(hf_config, grouped_gemm=use_te)  # TE's spec: the experts as one grouped GEMM
    if kw.get("num_moe_experts"):
        kw.update(moe or {})
    kw.update(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.virtual_pp,
        # megatron's MoE layer trains at tp > 1 only with sequence parallelism (moe_layer.py raises otherwise)
        sequence_parallel=(sequence_parallel or bool(kw.get("num_moe_experts"))) and layout.tp > 1,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.tp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        autocast_dtype=dtype if dtype != torch.float32 else None,
        perform_initialization=False,  # weights come from the HF checkpoint
        **gpu_build_kwargs(on_gpu, use_te),
        batch_p2p_comm=batch_p2p_comm,
        calculate_per_token_loss=True,  # the engine normalises by the caller's global count itself
        attention_softmax_in_fp32=True,
    )
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if kw["autocast_dtype"] is None:
        kw.pop("autocast_dtype")
    if kw.pop("multi_latent_attention", False):  # DeepSeek-V3: the MLA fields weight_mapping set
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**kw)
    return TransformerConfig(**kw)


def _mla_core_attention(cls):
    """megatron's local core attention under MLA: MLASelfAttention passes k_channels / v_channels, which the
    local DotProductAttention (and so PackedCausalAttention) does not take; its head sizes come from the
    tensors, its output width from kv_channels (= v's head dim)."""
    class MLACoreAttention(cls):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    MLACoreAttention.__name__ = f"MLA{cls.__name__}"
    return MLACoreAttention


def _mla_attention(cls):
    """megatron's MLASelfAttention under its local spec at TP > 1 with sequence parallelism: the kv down
    projection is a ColumnParallelLinear, whose output megatron gathers over TP and splits into the latent
    (scattered back to this rank's rows) and the RoPE key k_pos_emb, which every TP rank then uses whole, for
    its own heads. The gather's backward keeps each rank's own gradient of k_pos_emb: the other ranks' heads'
    part is lost (measured on the tiny DeepSeek-V3 at TP2: the layers' gradients off TP1's by 1% to 21%, the loss
    equal). Here the gathered projection is cut to this rank's rows, as megatron's duplicated-linear (TE) path
    has it: megatron then gathers k_pos_emb over the sequence, whose backward sums the ranks' gradients."""
    from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                        scatter_to_sequence_parallel_region)

    class MLASelfAttentionSP(cls):
        def _qkv_down_projection(self, hidden_states):
            q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
            whole = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
            if kv_combined.size(-1) != whole and self.config.sequence_parallel:
                kv_combined = scatter_to_sequence_parallel_region(
                    gather_from_tensor_model_parallel_region(kv_combined))
            return q_compressed, kv_combined

    MLASelfAttentionSP.__name__ = f"{cls.__name__}SP"
    return MLASelfAttentionSP


def _mla_without_q_lora():
    """MLASelfAttention for q_lora_rank None (DeepSeek-V2-Lite style): megatron's local spec resolves the
    kv latent's norm only beside a q one, or asks TE for a fused norm + linear; keep kv_layernorm, no q norm."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megappo.parallel.cpu_compat import SequenceParallelTorchNorm

    class MLASelfAttentionNoQLora(MLASelfAttention):
        def _resolve_qk_norm_config(self, submodules):
            return dict(linear_q_proj=ColumnParallelLinear, linear_q_up_proj=IdentityOp,
                        linear_kv_up_proj=ColumnParallelLinear, q_layernorm=IdentityOp,
                        kv_layernorm=submodules.kv_layernorm)

    return MLASelfAttentionNoQLora, SequenceParallelTorchNorm


def _local_layer(spec, config, packed: bool):
    """Patch one layer spec of megatron's local (no TE) spec in place for what megappo runs on CPU."""
    attn = spec.submodules.self_attention.submodules
    if packed:  # packed rows: attention within each row's span (models/packed_attention.py)
        from megappo.models.packed_attention import PackedCausalAttention

        attn.core_attention = PackedCausalAttention
    mla = getattr(config, "multi_latent_attention", False)
    if mla:
        attn.core_attention = _mla_core_attention(attn.core_attention)
        if config.q_lora_rank is None:
            spec.submodules.self_attention.module, norm = _mla_without_q_lora()
            attn.kv_layernorm = norm  # megatron's local norm would be TE's fused one; ours takes SP too
        spec.submodules.self_attention.module = _mla_attention(spec.submodules.self_attention.module)
    if config.sequence_parallel:
        from megappo.parallel.cpu_compat import SequenceParallelTorchNorm

        spec.submodules.input_layernorm = SequenceParallelTorchNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
        if config.qk_layernorm:  # per-head norms see whole sequences, but their grads are summed over TP
            if mla:  # either way (finalize_model_grads); MLA's latent norms run on this rank's rows
                attn.kv_layernorm = SequenceParallelTorchNorm
                if config.q_lora_rank is not None:
                    attn.q_layernorm = SequenceParallelTorchNorm
            else:
                attn.q_layernorm = attn.k_layernorm = SequenceParallelTorchNorm
    return spec


def _block_spec(config, use_te: bool, packed: bool, vp_stage):
    """The layer spec(s) of one model chunk: one spec for a dense model (megatron repeats it), a block
    spec (one per layer of this chunk: dense or routed experts, config.moe_layer_freq) for a MoE model,
    or whenever the local spec's final norm must allow sequence parallelism."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if config.num_moe_experts:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                           vp_stage=vp_stage)
        if not use_te:
            block.layer_specs = [_local_layer(s, config, packed) for s in block.layer_specs]
            if config.sequence_parallel:
                from megappo.parallel.cpu_compat import SequenceParallelTorchNorm

                block.layer_norm = SequenceParallelTorchNorm
        return block
    if use_te:
        # causal attention (the spec's default): the engine right-aligns every row, so no mask tensor is
        # needed and TE may pick its flash / fused kernels (an `arbitrary` mask forces unfused attention;
        # `padding_causal` with left padding is silently wrong in TE's cuDNN backend, which keeps only
        # the lengths and assumes right padding)
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    spec = _local_layer(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm),
                        config, packed)
    if config.sequence_parallel:  # sequence parallel on the local spec: our norms everywhere
        from megappo.parallel.cpu_compat import SequenceParallelTorchNorm

        return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                          layer_norm=SequenceParallelTorchNorm)
    return spec


class ValueHead(torch.nn.Module):
    """Critic head: hidden -> 1, replicated on every TP rank. Init: normal(std=1/(hidden+1)), bias 0
    (OpenRLHF's value head): a fresh critic's values start near 0, so early advantages are the returns
    and not per-token noise (std 1/sqrt(hidden+1) gave values of +-1 on SmolLM2-135M with returns in
    [0, 1]: explained variance -15 for 20 steps). Called like megatron's output layer:
    (hidden [s,b,h]) -> ([s,b,1], None)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool = False, dtype=torch.float32, seed: int = 0):
        super().__init__()
        # built on the CPU like the rest of the model (use_cpu_initialization); the engine moves it
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device="cpu"))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device="cpu"))
        self.sequence_parallel = sequence_parallel
        gen = torch.Generator().manual_seed(seed)  # identical on every rank
        with torch.no_grad():
            self.weight.copy_(torch.randn(1, hidden_size, generator=gen, device="cpu") / (hidden_size + 1))

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def build_gpt_chunks(hf_config, config, layout: ParallelLayout, value_head: bool = False, seed: int = 0,
                     use_te: bool = False, packed: bool = False, freeze_vision: bool = False) -> list:
    """This rank's GPTModel chunks (one per virtual pipeline stage), where `config` places them (the host
    with use_cpu_initialization, the current GPU otherwise; the caller moves what is left on the host),
    with TE's layer spec when `use_te` (use_transformer_engine); `packed`: attention for packed rows. A
    vision-language model's chunks are models/vision_gpt.VisionLanguageGPT (M-RoPE; the vision tower on the
    first stage, frozen when `freeze_vision`)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel

    dims = ModelDims.from_hf_config(hf_config, tp=layout.tp, value_head=value_head)
    layout.validate(dims.num_heads, dims.num_kv_heads, dims.num_layers, num_experts=dims.num_experts)
    if dims.num_experts:
        from megappo.parallel import cpu_compat

        cpu_compat.patch_moe_alltoall()
        cpu_compat.eager_expert_bias()
    chunks = []
    for vp in range(layout.num_model_chunks):
        vp_stage = vp if layout.virtual_pp else None
        pre = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        layer_spec = _block_spec(config, use_te, packed, vp_stage)
        cls, vision = GPTModel, {}
        if dims.vision:
            from megappo.models.vision_gpt import VisionLanguageGPT

            cls, vision = VisionLanguageGPT, dict(vision_config=hf_config.vision_config, freeze_vision=freeze_vision)
        model = cls(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=dims.padded_vocab_size,
            max_sequence_length=language_config(hf_config).max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=dims.tied_embeddings,
            position_embedding_type="mrope" if dims.vision else "rope",
            rotary_base=rope_theta(hf_config),
            rotary_percent=dims.rotary_percent,  # GLM-4.5: the first half of each head, NeoX halves
            vp_stage=vp_stage,
            **vision,
        )
        model.model_type = ModelType.encoder_or_decoder
        model.vp_stage = vp_stage
        if value_head and post:
            model.output_layer = ValueHead(dims.hidden_size, config.sequence_parallel, config.params_dtype, seed)
        if layout.cp > 1:  # megappo's split gives each token its own position (workers/megatron_step.packed_rope):
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

            for m in model.modules():  # the whole RoPE table, never megatron's CP slice of it (YaRN's included)
                if isinstance(m, RotaryEmbedding):
                    m.cp_group = None
        _cast_params(model, config.params_dtype)
        mark_tensor_parallel_params(model)
        if dims.num_experts:
            mark_expert_params(model)
        chunks.append(model)
    return chunks


def _cast_params(chunk, dtype: torch.dtype) -> None:
    """Every param in the model's dtype, as megatron's Float16Module leaves a GPU model. The local spec's
    norms (torch RMSNorm) ignore config.params_dtype and stay fp32: a bf16 model would then hold two
    dtypes, and megatron-core 0.16.1's DistributedOptimizer maps model params to the wrong main params
    in a mixed group (a critic's checkpoint fails: "output with shape [1] doesn't match [hidden]").
    Params only: buffers (RoPE frequencies) keep their precision."""
    for p in chunk.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def mark_tensor_parallel_params(chunk) -> None:
    """megatron sets `tensor_model_parallel` / `partition_dim` on TP-split weights only inside its weight
    init; with `perform_initialization=False` (weights come from HF) they would be missing and the grad
    norm would count only TP rank 0's shards. Set them here."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding, set_tensor_model_parallel_attributes)

    for mod in chunk.modules():
        dim = 0 if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)) else \
            1 if isinstance(mod, RowParallelLinear) else None
        w = getattr(mod, "weight", None)
        if dim is not None and isinstance(w, torch.nn.Parameter) and not getattr(w, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(w, is_parallel=True, dim=dim, stride=1)


def mark_expert_params(chunk) -> None:
    """Routed experts' params as expert-parallel (`allreduce=False`) at every EP size. megatron marks them
    only at EP > 1 (or expert TP != TP), and its optimizer is then a ChainedOptimizer [dense, experts]
    whose checkpoint keys (`chained_0.` / `chained_1.`) would differ from EP 1's single optimizer, so a
    checkpoint could not resume at another EP. At EP 1 the expert groups are the dense ones (expert DP =
    DP, expert TP = TP): the same reductions, in a second optimizer."""
    for name, p in chunk.named_parameters():
        if ".mlp.experts." in name:
            p.allreduce = False


class SafetensorsReader:
    """Lazy reader over a HF model dir (single file or sharded index): get(name) -> tensor."""

    def __init__(self, model_dir):
        from safetensors import safe_open

        d = Path(model_dir)
        index = d / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(d.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors under {d}")
            weight_map = {}
            for f in files:
                with safe_open(str(f), "pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        self._map = weight_map
        self._dir = d
        self._handles = {}
        self._open = safe_open

    def keys(self):
        return self._map.keys()

    def __contains__(self, name):
        return name in self._map

    def get(self, name) -> torch.Tensor:
        f = self._map[name]
        if f not in self._handles:
            self._handles[f] = self._open(str(self._dir / f), "pt")
        return self._handles[f].get_tensor(name)


@torch.no_grad()
def load_hf_weights(chunks, model_dir, dims: ModelDims, tp_rank: int, tp_size: int,
                    get_tensor: Optional[Callable[[str], torch.Tensor]] = None) -> list[str]:
    """Copy HF weights into this rank's shards of every chunk. Returns the megatron names left at
    their init (only the critic's value head, when the HF dir has no `score` tensor)."""
    reader = None if get_tensor else SafetensorsReader(model_dir)
    get = get_tensor or reader.get
    available = (lambda n: True) if get_tensor else (lambda n: n in reader)
    if dims.tied_embeddings is False and not dims.value_head and reader is not None \
            and "lm_head.weight" not in reader and "model.embed_tokens.weight" in reader:
        raise ValueError("HF checkpoint has no lm_head.weight and is not tied")
    skipped = []
    for chunk in chunks:
        for name, param in global_named_parameters(chunk):
            srcs = hf_names(name, dims)
            if not all(available(s) for s in srcs):
                if dims.value_head and name.startswith("output_layer."):
                    skipped.append(name)
                    continue
                raise KeyError(f"HF checkpoint {model_dir} lacks {[s for s in srcs if not available(s)]} for {name}")
            shard = hf_to_megatron_shard(name, {s: get(s) for s in srcs}, dims, tp_rank, tp_size)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: HF-derived shard {tuple(shard.shape)} != model param {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))
    return skipped
