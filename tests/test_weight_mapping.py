"""weight_mapping: HF <-> megatron names and TP shard layouts (pure functions, no processes)."""

import pytest
import torch

from megappo.parallel import weight_mapping as wm
from megappo.assets import TINY_SHAPES


def dims(tp=1, qkv_bias=True, tied=False, value_head=False, qk_norm=False):
    return wm.ModelDims(model_type="qwen3" if qk_norm else "qwen2", hidden_size=8, ffn_hidden_size=12, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=2, vocab_size=10,
                        padded_vocab_size=wm.padded_vocab_size(10, tp, 4), tied_embeddings=tied, qkv_bias=qkv_bias,
                        value_head=value_head, qk_norm=qk_norm)


def hf_tensors(d):
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(d.vocab_size, d.hidden_size, generator=g),
         "model.norm.weight": torch.randn(d.hidden_size, generator=g),
         "lm_head.weight": torch.randn(d.vocab_size, d.hidden_size, generator=g)}
    for i in range(d.num_layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = torch.randn(d.num_heads * d.head_dim, d.hidden_size, generator=g)
        t[p + "self_attn.k_proj.weight"] = torch.randn(d.num_kv_heads * d.head_dim, d.hidden_size, generator=g)
        t[p + "self_attn.v_proj.weight"] = torch.randn(d.num_kv_heads * d.head_dim, d.hidden_size, generator=g)
        for n in "qkv":
            t[p + f"self_attn.{n}_proj.bias"] = torch.randn(t[p + f"self_attn.{n}_proj.weight"].shape[0], generator=g)
        t[p + "self_attn.o_proj.weight"] = torch.randn(d.hidden_size, d.num_heads * d.head_dim, generator=g)
        t[p + "mlp.gate_proj.weight"] = torch.randn(d.ffn_hidden_size, d.hidden_size, generator=g)
        t[p + "mlp.up_proj.weight"] = torch.randn(d.ffn_hidden_size, d.hidden_size, generator=g)
        t[p + "mlp.down_proj.weight"] = torch.randn(d.hidden_size, d.ffn_hidden_size, generator=g)
        t[p + "input_layernorm.weight"] = torch.randn(d.hidden_size, generator=g)
        t[p + "post_attention_layernorm.weight"] = torch.randn(d.hidden_size, generator=g)
        if d.qk_norm:
            t[p + "self_attn.q_norm.weight"] = torch.randn(d.head_dim, generator=g)
            t[p + "self_attn.k_norm.weight"] = torch.randn(d.head_dim, generator=g)
    return t


def test_padded_vocab_does_not_depend_on_tp():
    # multiple of lcm(128, tp): the same global embedding shape at every power-of-two TP, so a
    # checkpoint saved at one TP loads at another (megatron-LM's 128*tp rule gives 32256 at TP4)
    for tp in (1, 2, 4, 8):
        assert wm.padded_vocab_size(1000, tp) == 1024
        assert wm.padded_vocab_size(32000, tp) == 32000
        assert wm.padded_vocab_size(151936, tp) == 151936  # 1187 * 128
    assert wm.padded_vocab_size(1025, 2) == 1152
    assert wm.padded_vocab_size(1000, 3) == 1152  # lcm(128, 3) = 384; 3 * 384


def test_qkv_shard_is_grouped_q_k_v_per_query_group():
    d = dims(tp=2)
    hf = hf_tensors(d)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    s0 = wm.hf_to_megatron_shard(name, hf, d, 0, 2)
    s1 = wm.hf_to_megatron_shard(name, hf, d, 1, 2)
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    # group g holds q heads [2g, 2g+1] (head_dim 2 -> rows 4g:4g+4), then k_g, v_g
    assert torch.equal(s0, torch.cat([q[0:4], k[0:2], v[0:2]]))
    assert torch.equal(s1, torch.cat([q[4:8], k[2:4], v[2:4]]))


def test_fc1_shard_is_gate_then_up_of_this_rank():
    d = dims(tp=2)
    hf = hf_tensors(d)
    s1 = wm.hf_to_megatron_shard("decoder.layers.0.mlp.linear_fc1.weight", hf, d, 1, 2)
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(s1, torch.cat([gate[6:], up[6:]]))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["qwen2", "qwen3"])
def test_round_trip_every_param_at_tp_1_2(qk_norm):
    for tp in (1, 2):
        d = dims(tp=tp, qk_norm=qk_norm)
        hf = hf_tensors(d)
        back = {}
        names = wm.megatron_param_names(d)
        assert len(names) == 1 + 2 * (9 if qk_norm else 7) + 2
        for name in names:
            shards = [wm.hf_to_megatron_shard(name, hf, d, r, tp) for r in range(tp)]
            if wm.tp_split_dim(name, d) is None:
                assert all(torch.equal(s, shards[0]) for s in shards)
            back.update(wm.megatron_shards_to_hf(name, shards, d))
        assert back.keys() == hf.keys()
        for k in hf:
            assert torch.equal(back[k], hf[k]), k


def test_vocab_padding_rows_are_zero_and_dropped_on_the_way_back():
    d = dims(tp=2)  # vocab 10 padded to 12 (a multiple of lcm(4, 2)): rank 1 holds rows 6..11
    hf = hf_tensors(d)
    s1 = wm.hf_to_megatron_shard("embedding.word_embeddings.weight", hf, d, 1, 2)
    assert s1.shape == (6, 8) and torch.equal(s1[:4], hf["model.embed_tokens.weight"][6:]) and not s1[4:].any()


def test_names_both_ways_tied_te_and_value_head():
    d = dims(qk_norm=True)
    assert wm.megatron_name("model.layers.1.self_attn.k_norm.weight", d) == "decoder.layers.1.self_attention.k_layernorm.weight"
    assert wm.tp_split_dim("decoder.layers.1.self_attention.q_layernorm.weight", d) is None  # replicated
    for name in wm.megatron_param_names(d):
        for hf_name in wm.hf_names(name, d):
            assert wm.megatron_name(hf_name, d) == name
    te = wm.megatron_param_names(d, te_fused_norms=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert wm.megatron_name("model.layers.0.input_layernorm.weight", d, te_fused_norms=True) == \
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    tied = dims(tied=True)
    assert "output_layer.weight" not in wm.megatron_param_names(tied)
    assert wm.hf_names("output_layer.weight", tied) == ["model.embed_tokens.weight"]
    vh = dims(value_head=True)
    assert wm.hf_names("output_layer.weight", vh) == ["score.weight"]
    assert wm.tp_split_dim("output_layer.weight", vh) is None
    assert wm.global_param_name("decoder.layers.1.mlp.linear_fc2.weight", 2) == "decoder.layers.3.mlp.linear_fc2.weight"


def test_transformer_config_kwargs_from_tiny_qwen2_config():
    from transformers import Qwen2Config

    cfg = Qwen2Config(**TINY_SHAPES, vocab_size=1000, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
    kw = wm.transformer_config_kwargs(cfg)
    assert kw["num_query_groups"] == 2 and kw["kv_channels"] == 32 and kw["add_qkv_bias"] is True
    assert kw["layernorm_epsilon"] == 1e-6 and kw["gated_linear_unit"] and kw["normalization"] == "RMSNorm"
    assert kw["hidden_dropout"] == 0.0 and kw["attention_dropout"] == 0.0
    assert wm.rope_theta(cfg) == 1e6
    assert wm.ModelDims.from_hf_config(cfg, tp=2).tied_embeddings
    assert not wm.ModelDims.from_hf_config(cfg, tp=2, value_head=True).tied_embeddings


def test_transformer_config_kwargs_from_tiny_qwen3_config():
    """Qwen3: q/k norms on, and head_dim taken as written (64 here, not hidden / heads = 32)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(**TINY_SHAPES, head_dim=64, vocab_size=1000, rms_norm_eps=1e-6, tie_word_embeddings=True)
    kw = wm.transformer_config_kwargs(cfg)
    assert kw["qk_layernorm"] is True and kw["kv_channels"] == 64 and kw["add_qkv_bias"] is False
    assert wm.ModelDims.from_hf_config(cfg).qk_norm and not wm.ModelDims.from_hf_config(cfg).qkv_bias
    with pytest.raises(ValueError, match="use_sliding_window"):
        wm.transformer_config_kwargs(Qwen3Config(**TINY_SHAPES, vocab_size=1000, use_sliding_window=True))
    with pytest.raises(ValueError, match="choose one of llama, qwen2, mistral, qwen3"):
        wm.ModelDims.from_hf_dict({"model_type": "gemma3"})


def test_shard_hf_slices_fill_every_hf_tensor_exactly():
    # each rank writing its own shard in place (the resharder's shared-memory slots) builds the same
    # full HF tensors as gathering all shards and converting (megatron_shards_to_hf)
    for tp in (1, 2):
        d = dims(tp=tp)
        hf = hf_tensors(d)
        out = {k: torch.full_like(v, float("nan")) for k, v in hf.items()}
        for name in wm.megatron_param_names(d):
            for r in range(tp if wm.tp_split_dim(name, d) is not None else 1):
                shard = wm.hf_to_megatron_shard(name, hf, d, r, tp)
                for hf_name, idx, values in wm.megatron_shard_hf_slices(name, shard, d, r, tp):
                    dst = out[hf_name][idx]
                    (dst if dst.shape == values.shape else dst.view(values.shape)).copy_(values)
        for k in hf:
            assert torch.equal(out[k], hf[k]), (tp, k)  # no NaN left: every element written



def test_qwen3_moe_dims_names_and_router_config():
    """transformers' MoE-layer rule ((i+1) % decoder_sparse_step == 0, minus mlp_only_layers) as an explicit
    per-layer list; per-expert HF names <-> megatron SequentialMLP names with the GLOBAL expert index; the
    router math that equals transformers' (norm_topk_prob)."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**{**TINY_SHAPES, "num_hidden_layers": 6}, vocab_size=1000, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=2, mlp_only_layers=[3],
                         norm_topk_prob=True)
    d = wm.ModelDims.from_hf_config(cfg)
    assert d.moe_layers == (False, True, False, False, False, True) and d.num_experts == 8 and d.qk_norm
    kw = wm.transformer_config_kwargs(cfg)
    assert kw["moe_layer_freq"] == [0, 1, 0, 0, 0, 1] and kw["num_moe_experts"] == 8 and kw["moe_router_topk"] == 2
    assert kw["moe_router_pre_softmax"] is False and kw["moe_aux_loss_coeff"] == 0.0  # renormalised top-k, no aux loss
    cfg.norm_topk_prob = False
    assert wm.transformer_config_kwargs(cfg)["moe_router_pre_softmax"] is True  # softmax over all, not renormalised
    names = wm.megatron_param_names(d)
    assert "decoder.layers.1.mlp.router.weight" in names and "decoder.layers.0.mlp.router.weight" not in names
    assert "decoder.layers.5.mlp.experts.local_experts.7.linear_fc2.weight" in names
    assert wm.hf_names("decoder.layers.5.mlp.experts.local_experts.7.linear_fc1.weight", d) == [
        "model.layers.5.mlp.experts.7.gate_proj.weight", "model.layers.5.mlp.experts.7.up_proj.weight"]
    for name in names:  # both ways, the MoE layer's pre-MLP norm included
        for hf_name in wm.hf_names(name, d):
            assert wm.megatron_name(hf_name, d) == name, hf_name
    # expert-parallel rank 1 of 2 holds experts 4..7 as local 0..3; pipeline stage 2 starts at layer 4
    assert wm.global_param_name("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", 4, 4) == \
        "decoder.layers.5.mlp.experts.local_experts.6.linear_fc1.weight"
    assert wm.global_param_name("decoder.layers.1.mlp.router.weight", 4, 4) == "decoder.layers.5.mlp.router.weight"
    with pytest.raises(ValueError, match="num_experts and num_experts_per_tok"):
        wm.ModelDims.from_hf_dict({**cfg.to_dict(), "num_local_experts": None})


def test_te_grouped_experts_names_map_like_sequential_mlp():
    """TEGroupedMLP (moe_grouped_gemm=True) names its experts `mlp.experts.linear_fc1.weight{i}` (TE's
    GroupedLinear, megatron-core 0.19.2 moe/experts.py): the same HF tensors, global index and TP shards
    as SequentialMLP's `local_experts.{i}.linear_fc1.weight`, both ways."""
    import dataclasses

    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**{**TINY_SHAPES, "num_hidden_layers": 2}, vocab_size=1000, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64)
    seq = wm.ModelDims.from_hf_config(cfg, tp=2)
    grouped = dataclasses.replace(seq, grouped_experts=True)
    names = wm.megatron_param_names(grouped)
    experts = [n for n in names if ".mlp.experts." in n]
    assert len(experts) == 2 * 4 * 2 and "decoder.layers.1.mlp.experts.linear_fc2.weight3" in experts
    assert not any("local_experts" in n for n in names)
    assert [n for n in names if ".mlp.experts." not in n] == [n for n in wm.megatron_param_names(seq)
                                                              if ".mlp.experts." not in n]
    assert wm.hf_names("decoder.layers.1.mlp.experts.linear_fc1.weight3", grouped) == [
        "model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"]
    for name in names:
        for hf_name in wm.hf_names(name, grouped):
            assert wm.megatron_name(hf_name, grouped) == name, hf_name
    assert wm.routed_expert("decoder.layers.1.mlp.experts.linear_fc2.weight3") == 3
    assert wm.parse_expert("mlp.experts.linear_fc1.weight12") == (12, "linear_fc1", True)
    assert wm.parse_expert("mlp.experts.local_experts.12.linear_fc1.weight") == (12, "linear_fc1", False)
    assert wm.parse_expert("mlp.linear_fc1.weight") is None
    # expert-parallel rank 1 of 2: local weight1 is global expert 3; the stage offset moves the layer
    assert wm.global_param_name("decoder.layers.0.mlp.experts.linear_fc1.weight1", 1, 2) == \
        "decoder.layers.1.mlp.experts.linear_fc1.weight3"
    # the same shards: fc1 [gate; up] of this rank (column-parallel), fc2 split along its input (row-parallel)
    hf = {n: torch.randn(64, 128) if "down_proj" not in n else torch.randn(128, 64)  # ffn 64, hidden 128
          for n in wm.hf_expert_names("model.layers.1.mlp.experts.", 3)}
    for fc in ("linear_fc1", "linear_fc2"):
        a, b = (f"decoder.layers.1.{wm.expert_param_name(3, fc, g)}" for g in (False, True))
        assert wm.tp_split_dim(a, seq) == wm.tp_split_dim(b, grouped) == (0 if fc == "linear_fc1" else 1)
        for rank in (0, 1):
            torch.testing.assert_close(wm.hf_to_megatron_shard(b, hf, grouped, rank, 2),
                                       wm.hf_to_megatron_shard(a, hf, seq, rank, 2), rtol=0, atol=0)
