"""megappo plan: numbers against a hand calculation, shipped configs fit, impossible layouts refused."""

import copy
import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import run_cli

from megappo.config import load_config
from megappo.memory_model import plan
from megappo.param_counts import total_params
from megappo.planner import with_pool

REPO = Path(__file__).resolve().parents[1]
GB = 1024**3


def test_7b_matches_hand_calculation():
    # Llama-2-7B shapes, TP4 x PP1 x DP2, every role resident (the config offloads the critic to fit)
    cfg = load_config(REPO / "configs/ppo_7b.yaml", ["critic.offload=false"])
    # One decoder layer, h=4096, 32 heads = 32 kv heads of 128, ffn 11008:
    #   qkv 4096*(32+2*32)*128 = 50,331,648; proj 4096*4096 = 16,777,216;
    #   SwiGLU 3*4096*11008 = 135,266,304; two RMSNorms 8,192      -> 202,383,360 per layer
    # 32 layers / tp 4 = 1,619,066,880; embedding and (untied) output layer, vocab 32000 (already a
    # multiple of 128): 32000*4096/4 = 32,768,000 each; final norm 4,096 (replicated)
    params = 32 * 202_383_360 // 4 + 2 * 32_768_000 + 4_096
    assert params == 1_684_606_976
    result = plan(cfg)
    actor = result["roles"]["actor"]
    assert actor["params_per_gpu_m"] == round(params / 1e6, 1)
    # bf16 weights 2 B, fp32 grad buffer 4 B, fp32 main params + Adam m, v = 12 B sharded over dp=2
    assert actor["weights_gb"] == round(2 * params / GB, 2)
    assert actor["grads_gb"] == round(4 * params / GB, 2)
    assert actor["optimizer_gb"] == round(12 * params / 2 / GB, 2)
    ref = result["roles"]["ref"]
    assert ref["weights_gb"] == round(2 * params / GB, 2) and ref["grads_gb"] == 0 and ref["optimizer_gb"] == 0
    # the critic swaps the 32000-row output layer for a 1 x 4096 value head
    critic_params = params - 32_768_000 + 4_096
    assert result["roles"]["critic"]["params_per_gpu_m"] == round(critic_params / 1e6, 1)
    # rollout phase = everything resident (no offload; the trained roles' allocators keep their activation
    # peak cached) + vLLM's 0.4 of the 79.6 GiB + 3 GiB + a 0.6 GiB CUDA context per process (actor+rollout+ref,
    # critic): 78.5 GiB, past the 95% of the GPU a plan may use
    assert result["usable_gpu_gb"] == round(0.95 * 79.6, 2) and not result["fits"]
    resident = (2 + 4 + 6) * params / GB + (2 + 4 + 6) * critic_params / GB + 2 * params / GB
    activations = result["roles"]["actor"]["activations_gb"] + result["roles"]["critic"]["activations_gb"]
    assert result["processes_per_gpu"] == 2
    assert abs(result["phases_gb"]["rollout"] - (resident + activations + 0.4 * 79.6 + 3.0 + 2 * 0.6)) < 0.02
    assert result["peak_gpu_gb"] == max(result["phases_gb"].values())
    # weight sync: the actor's TP4 into rollout TP2 is not sliced: every weight whole into every rollout GPU (the
    # plan said the TP2 slice); at rollout TP4 each rollout GPU gets its quarter
    total = 32 * 202_383_360 + 2 * 32000 * 4096 + 4096
    assert result["total_params_b"] == round(total / 1e9, 3)
    assert result["weight_sync"]["bytes_per_gpu"] == 2 * total and not result["weight_sync"]["sliced"]
    sliced = plan(load_config(REPO / "configs/ppo_7b.yaml", ["critic.offload=false", "rollout.tp=4"]))["weight_sync"]
    assert sliced["sliced"] and sliced["bytes_per_gpu"] == int(2 * total / 4)


def test_offload_frees_the_role_outside_its_phase():
    cfg = load_config(REPO / "configs/ppo_7b.yaml", ["critic.offload=false"])
    base = plan(cfg)
    cfg.critic.offload = True
    off = plan(cfg)
    freed = base["roles"]["critic"]["freed_by_offload_gb"]
    assert abs((base["phases_gb"]["rollout"] - off["phases_gb"]["rollout"]) - freed) < 0.02
    assert abs(base["phases_gb"]["critic_update"] - off["phases_gb"]["critic_update"]) < 0.02


def test_shipped_70b_fits_80gb():
    cfg = load_config(REPO / "configs/ppo_70b.yaml")
    result = plan(cfg)
    assert result["gpus"] == 64 and result["gpu_mem_gb"] == 79.6  # GiB, as an 80 GB GPU reports it
    assert result["fits"] and result["peak_gpu_gb"] <= 0.95 * 79.6
    # the weight sync: vLLM's weights awake (no KV cache yet) + the offloaded actor's weights only (no grads,
    # no optimizer states) + two 256 MB resharder buckets + overhead (3 GB + 2 CUDA contexts)
    sync = result["roles"]["actor"]["weights_gb"] + result["roles"]["rollout"]["weights_gb"] + 0.5 + 3.0 + 2 * 0.6
    assert abs(result["phases_gb"]["weight_sync"] - sync) < 0.02 and sync < 80
    # sleep level 1 would keep vLLM's weights in pinned host memory too: 8 GPUs x 16.4 GB more per node
    cfg.rollout.sleep_level = 1
    level1 = plan(cfg)
    assert abs(level1["host_gb_per_node"] - result["host_gb_per_node"] - 8 * result["roles"]["rollout"]["weights_gb"]) < 0.2
    # every role offloaded: host holds bf16 weights (2 B) of all three + fp32 main/Adam (12 B / dp) of
    # actor and critic; grads are dropped, not copied
    r = result["roles"]
    n_actor, n_critic, n_ref = (r[k]["params_per_gpu_m"] * 1e6 for k in ("actor", "critic", "ref"))
    host = (2 * (n_actor + n_critic + n_ref) + 12 * (n_actor + n_critic) / 4) / 1024**3  # DP4
    assert abs(result["host_offload_gb_per_gpu"] - host) < 0.05, (result["host_offload_gb_per_gpu"], host)
    assert abs(result["host_offload_gb_per_node"] - 8 * result["host_offload_gb_per_gpu"]) < 0.1


def _plan_cli(*args):
    """`megappo plan ARGS` run in this process (cli_helpers.run_cli: no 2 s of imports in a new interpreter)."""
    rc, out, err = run_cli("plan", *args)
    return subprocess.CompletedProcess(["megappo", "plan", *args], rc, out, err)


def test_impossible_70b_layout_refused_with_reason():
    flat = [f"{r}.parallel.{k}=1" for r in ("actor", "critic", "ref") for k in ("tp", "pp")]
    res = _plan_cli("--config", "configs/ppo_70b.yaml", "--nodes", "1", "--gpus-per-node", "8", "--json", *flat)
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["fits"] is False and out["peak_gpu_gb"] > 80
    assert out["layout"]["actor"] == "TP1xPP1xDP8"
    # 70.6B params on one GPU: 2 B/param bf16 weights alone are 131 GB
    assert out["roles"]["actor"]["weights_gb"] > 130
    reason = res.stderr.strip().splitlines()
    assert len(reason) == 1 and reason[0].startswith("layout does not fit: the ")
    assert "GiB per GPU but the GPU has 79.6 GiB, 75.62 of them usable (5% kept free)" in reason[0]


def test_refusal_suggests_nearest_fitting_layout():
    res = _plan_cli("--config", "configs/ppo_7b.yaml", "critic.offload=false",
                    *[f"{r}.parallel.tp=2" for r in ("actor", "critic", "ref")])
    assert res.returncode == 1
    assert "nearest layout that fits: tp=" in res.stderr
    # with --nodes the dp of every role refills the new pool
    cfg = with_pool(load_config(REPO / "configs/ppo_13b.yaml"), nodes=4, gpus_per_node=8, gpu_mem_gb=None)
    assert cfg.actor.parallel.dp == 4 and cfg.resources.nodes == 4


def test_host_memory_for_offload_checked_against_the_node():
    small = _plan_cli("--config", "configs/ppo_70b.yaml", "--host-mem-gb", "256", "--json")
    assert small.returncode == 1
    out = json.loads(small.stdout)
    assert out["fits"] and not out["host_fits"]  # the GPUs are fine, the host is not
    assert f"need {out['host_gb_per_node']:.0f} GB of pinned host memory" in small.stderr
    # on GPU a checkpoint's snapshot (the actor's and critic's weights + optimizer states) is pinned too
    roles = out["roles"]
    snapshot = sum(roles[r]["weights_gb"] + roles[r]["optimizer_gb"] for r in ("actor", "critic"))
    assert abs(out["host_save_snapshot_gb_per_gpu"] - snapshot) < 0.05
    assert abs(out["host_gb_per_node"] - 8 * (out["host_offload_gb_per_gpu"] + snapshot)) < 0.5
    assert "256 GB" in small.stderr
    big = _plan_cli("--config", "configs/ppo_70b.yaml", "--host-mem-gb", "1024", "--json")
    assert big.returncode == 0 and json.loads(big.stdout)["host_fits"]


def test_mixture_of_experts_per_ep_rank_against_hand_calculation():
    """Qwen3-30B-A3B (configs/ppo_qwen3_30b_a3b.yaml, TP1 x PP2 x DP4 x EP4) and Mixtral-8x7B shapes: the
    published totals, experts split over ep, expert optimizer states over dp / ep; a layout that does not
    fit is refused with the nearest one that does (an ep among the choices)."""
    cfg = load_config(REPO / "configs/ppo_qwen3_30b_a3b.yaml")
    # per layer: q 2048x4096, k/v 2048x512 each, o 4096x2048, norms 2x2048, q/k norms 2x128;
    # router 128x2048; 128 experts x 3 x 2048 x 768
    attn = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 2048 + 2 * 128
    router, experts = 128 * 2048, 128 * 3 * 2048 * 768
    total = 48 * (attn + router + experts) + 2 * 151936 * 2048 + 2048
    result = plan(cfg)
    assert result["total_params_b"] == round(total / 1e9, 3) and 30.4 < total / 1e9 < 30.6  # "30B-A3B"
    actor = result["roles"]["actor"]
    expert_per_gpu = 24 * experts // 4  # 24 layers per stage, experts over ep 4 (tp 1)
    assert actor["expert_params_per_gpu_m"] == round(expert_per_gpu / 1e6, 1)
    dense = actor["params_per_gpu_m"] * 1e6 - expert_per_gpu
    # optimizer: 12 B per param, dense sharded over dp 4, experts over dp / ep = 1
    assert abs(actor["optimizer_gb"] - 12 * (dense / 4 + expert_per_gpu) / GB) < 0.02
    assert result["fits"] and result["weight_sync"]["experts_per_rollout_gpu"] == 48 * 128

    proc = _plan_cli("--config", "configs/ppo_qwen3_30b_a3b.yaml", "actor.micro_batch_size=2", "actor.parallel.pp=1",
                     "critic.parallel.pp=1", "ref.parallel.pp=1", "actor.parallel.ep=8", "critic.parallel.ep=8",
                     "ref.parallel.ep=8")
    # (at micro-batch 2 the shipped TP1xPP2xEP4 needs 77.8 GiB, past 95% of 79.6: the expert TP2 layout fits)
    assert proc.returncode == 1 and "nearest layout that fits: tp=2 pp=1 dp=4 ep=4" in proc.stderr, proc.stderr

    mixtral = load_config(REPO / "configs/ppo_7b.yaml", [
        "model.arch.family=mixtral", "model.arch.num_experts=8", "model.arch.num_experts_per_tok=2",
        "model.arch.intermediate_size=14336", "model.arch.num_kv_heads=8", "actor.parallel.ep=2",
        "critic.parallel.ep=2", "ref.parallel.ep=2"])
    assert round(plan(mixtral)["total_params_b"], 1) == 46.7  # Mixtral-8x7B


def test_lora_frozen_base_no_reference_copy_against_hand_calculation():
    """actor.lora (issue #40): the actor's base frozen (weights only), adapters trained, no ref model."""
    full = plan(load_config(REPO / "configs/ppo_7b.yaml"))
    lora = plan(load_config(REPO / "configs/ppo_7b.yaml", ["actor.lora.rank=16"]))
    # Llama-2-7B at TP4, rank 16, every target: A [r, in] and B [out, r], the split one over tp
    # qkv (column) 16*(4096 + 12288/4); proj (row) 16*(4096/4 + 4096); fc1 (column) 16*(4096 + 22016/4);
    # fc2 (row) 16*(11008/4 + 4096); 32 layers
    k = 32 * 16 * ((4096 + 12288 // 4) + (4096 // 4 + 4096) + (4096 + 22016 // 4) + (11008 // 4 + 4096))
    base = full["roles"]["actor"]["params_per_gpu_m"] * 1e6
    a = lora["roles"]["actor"]
    assert abs(a["params_per_gpu_m"] * 1e6 - (base + k)) < 1e5
    assert a["grads_gb"] == round(4 * k / GB, 2) and a["optimizer_gb"] == round(12 * k / 2 / GB, 2)  # dp 2
    assert "ref" not in lora["roles"] and "ref_log_prob" not in lora["phases_gb"]
    assert a["weights_gb"] + a["grads_gb"] + a["optimizer_gb"] < 0.2 * (
        full["roles"]["actor"]["weights_gb"] + full["roles"]["actor"]["grads_gb"] + full["roles"]["actor"]["optimizer_gb"])
    for phase, gb in lora["phases_gb"].items():  # the same layout: every phase needs less
        assert gb < full["phases_gb"][phase], phase


def _count_adapters(rank, world, port, path, lora_rank, targets=None):
    from megappo.models.gpt import build_gpt_chunks, build_transformer_config, load_hf_config
    from megappo.models.lora import LoraConfig, apply_lora, lora_parameters
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import destroy, init_distributed, init_megatron

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout(tp=world)
    init_megatron(layout)
    hf_config = load_hf_config(path)
    chunks = build_gpt_chunks(hf_config, build_transformer_config(hf_config, layout), layout)
    apply_lora(chunks, LoraConfig(rank=lora_rank, **({"target_modules": targets} if targets else {})))
    n = sum(p.numel() for p in lora_parameters(chunks))
    destroy()
    return n


def test_lora_adapter_count_equals_apply_lora_on_the_tiny_model(tiny_assets):
    """The planner's adapter parameters per GPU are the real apply_lora's, at TP1 and TP2 (A / B split)."""
    from megappo.parallel.launch import spawn_local
    from megappo.param_counts import lora_params

    path = str(tiny_assets["tiny-llama"])
    cfg = load_config(REPO / "configs/ppo_tiny.yaml", [f"model.path={path}", "actor.lora.rank=4"], validate=False)
    for tp in (1, 2):
        counts = spawn_local(_count_adapters, tp, path, 4, timeout=300)
        assert counts == [sum(lora_params(cfg.model.arch, cfg.actor.lora, tp=tp))] * tp, (tp, counts)


def test_mla_lora_adapter_count_equals_apply_lora(tiny_assets):
    """LoRA on multi-latent attention's projections (and its dense layers' MLP): the planner's adapter parameters per
    GPU are apply_lora's on the tiny DeepSeek-V3 at TP2 (every MLA projection column-parallel: B split)."""
    from megappo.parallel.launch import spawn_local
    from megappo.param_counts import lora_params

    path = str(tiny_assets["tiny-deepseek_v3"])
    targets = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
               "linear_fc1", "linear_fc2"]
    cfg = load_config(REPO / "configs/grpo_deepseek_v3.yaml", ["actor.lora.rank=4",
                                                               f"actor.lora.target_modules=[{','.join(targets)}]"])
    hf = json.loads((tiny_assets["tiny-deepseek_v3"] / "config.json").read_text())
    a = cfg.model.arch
    a.hidden_size, a.intermediate_size, a.num_layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    a.num_attention_heads, a.head_dim, a.first_k_dense_replace = hf["num_attention_heads"], hf["v_head_dim"], \
        hf["first_k_dense_replace"]
    a.q_lora_rank, a.kv_lora_rank = hf["q_lora_rank"], hf["kv_lora_rank"]
    a.qk_nope_head_dim, a.qk_rope_head_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    a.num_experts, a.num_kv_heads = hf["n_routed_experts"], hf["num_attention_heads"]
    a.moe_intermediate_size = hf["moe_intermediate_size"]
    a.shared_expert_intermediate_size = hf["n_shared_experts"] * hf["moe_intermediate_size"]  # its fc1 / fc2 adapted too
    counts = spawn_local(_count_adapters, 2, path, 4, targets, timeout=300)
    assert counts == [sum(lora_params(a, cfg.actor.lora, tp=2))] * 2, counts


def _count_moe_adapters(rank, world, port, path, lora_rank):
    from megappo.models.gpt import build_gpt_chunks, build_transformer_config, load_hf_config
    from megappo.models.lora import LoraConfig, apply_lora, iter_lora_modules
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import destroy, init_distributed, init_megatron

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout(dp=2, ep=2)
    init_megatron(layout)
    hf_config = load_hf_config(path)
    chunks = build_gpt_chunks(hf_config, build_transformer_config(hf_config, layout), layout)
    apply_lora(chunks, LoraConfig(rank=lora_rank, experts=True))
    counts = [0, 0]  # dense, routed experts'
    for name, m in iter_lora_modules(chunks):
        counts[".experts." in name] += m.lora_A.numel() + m.lora_B.numel()
    destroy()
    return counts


def test_expert_lora_adapter_count_equals_apply_lora_at_ep2(tiny_assets):
    """With actor.lora.experts the planner's (dense, expert) adapter parameters per GPU are apply_lora's on the
    tiny Qwen3-MoE at DP2 x EP2 (each rank's 2 of the 4 experts of layers 1-3, layer 0's dense MLP)."""
    from megappo.parallel.launch import spawn_local
    from megappo.param_counts import lora_params

    path = str(tiny_assets["tiny-qwen3_moe"])
    cfg = load_config(REPO / "configs/ppo_tiny_moe.yaml", [f"model.path={path}", "actor.lora.rank=4",
                                                            "actor.lora.experts=true"], validate=False)
    counts = spawn_local(_count_moe_adapters, 2, path, 4, timeout=300)
    want = list(lora_params(cfg.model.arch, cfg.actor.lora, ep=2))
    assert counts == [want, want] and want[1] > 0, (counts, want)


def test_moe_activations_and_actor_logits_against_hand_calculation():
    """Qwen3-30B-A3B (#43): one MoE layer's full activations carry its top-8 routed copies of each token, and
    the actor's last stage its logits over the R response columns at the measured 16 B (24 with entropy)."""
    cfg = load_config(REPO / "configs/ppo_qwen3_30b_a3b.yaml", ["actor.micro_batch_size=2"])
    r = plan(cfg)["roles"]
    s, b, h = 2048, 2, 2048
    per_token = 15 * h + 8 * (4 * h + 6 * 768)  # attention + norms, 8 routed copies (expert FFN 768)
    critic = 2 * (24 * 2 * s * b * h + per_token * s * b)  # recompute: 24 layer inputs + one full layer, 2 in flight
    assert r["critic"]["activations_gb"] == round(critic / GB, 2)
    logits = 1024 * b * 151936 * 16  # R x b x V (a multiple of 128 already)
    assert r["actor"]["activations_gb"] == round((critic + logits) / GB, 2)
    cfg.actor.entropy_coeff = 0.001
    assert plan(cfg)["roles"]["actor"]["activations_gb"] == round((critic + logits * 24 // 16) / GB, 2)
    shipped = plan(load_config(REPO / "configs/ppo_qwen3_30b_a3b.yaml"))
    assert shipped["fits"] and shipped["peak_gpu_gb"] <= 80 - 5  # the config's stated margin


def test_adapter_sync_plans_the_adapters_in_peft_layout_against_hand_calculation():
    """rollout.lora_sync=adapter: the plan's weight sync is the adapter in peft's layout, not the model."""
    merged = plan(load_config(REPO / "configs/ppo_7b.yaml", ["actor.lora.rank=16", "rollout.tp=1"]))
    adapter = plan(load_config(REPO / "configs/ppo_7b.yaml", ["actor.lora.rank=16", "rollout.tp=1",
                                                              "rollout.lora_sync=adapter", "rollout.sleep_level=1"]))
    # Llama-2-7B, rank 16, peft's modules: q/k/v/o 16*(4096+4096) each; gate/up 16*(4096+11008) each;
    # down 16*(11008+4096); 32 layers, bf16
    per_layer = 4 * 16 * (4096 + 4096) + 3 * 16 * (4096 + 11008)
    assert adapter["weight_sync"]["sends"] == "adapters" and merged["weight_sync"]["sends"] == "weights"
    assert adapter["weight_sync"]["bytes_per_gpu"] == 2 * 32 * per_layer
    assert merged["weight_sync"]["bytes_per_gpu"] == 2 * (32 * 202_383_360 + 2 * 32000 * 4096 + 4096)  # every weight
    assert adapter["weight_sync"]["bytes_per_gpu"] < 0.01 * merged["weight_sync"]["bytes_per_gpu"]


def _count_peft_adapter(rank, world, port, path, lora_rank, experts):
    from megappo.models.gpt import build_gpt_chunks, build_transformer_config, load_hf_config
    from megappo.models.lora import LoraConfig, apply_lora
    from megappo.models.lora_peft import gather_hf_lora
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import destroy, init_distributed, init_megatron
    from megappo.parallel.model_dims import ModelDims

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout(dp=2, ep=2) if experts else ParallelLayout(tp=world)
    init_megatron(layout)
    hf_config = load_hf_config(path)
    chunks = build_gpt_chunks(hf_config, build_transformer_config(hf_config, layout), layout)
    apply_lora(chunks, LoraConfig(rank=lora_rank, experts=experts))
    hf = gather_hf_lora(chunks, ModelDims.from_hf_config(hf_config, tp=layout.tp), everywhere=True)
    destroy()
    return sum(a.numel() + b.numel() for a, b in hf.values())


def test_adapter_sync_count_equals_the_gathered_peft_adapter(tiny_assets):
    """The planner's adapter-sync parameters are what gather_hf_lora (the adapter sync's payload) holds: the tiny
    Llama at TP2 and the tiny Qwen3-MoE with expert adapters at DP2 x EP2."""
    from megappo.parallel.launch import spawn_local
    from megappo.param_counts import adapter_sync_params

    for name, base, experts in (("tiny-llama", "ppo_tiny.yaml", False), ("tiny-qwen3_moe", "ppo_tiny_moe.yaml", True)):
        path = str(tiny_assets[name])
        cfg = load_config(REPO / "configs" / base, [f"model.path={path}", "actor.lora.rank=4",
                                                    f"actor.lora.experts={str(experts).lower()}"], validate=False)
        counts = spawn_local(_count_peft_adapter, 2, path, 4, experts, timeout=300)
        assert counts == [adapter_sync_params(cfg.model.arch, cfg.actor.lora)] * 2, (name, counts)


def test_a_distillation_teacher_is_a_frozen_role_of_its_own_shapes():
    """teacher.model: its own worker group (one more process per GPU), frozen weights of teacher.arch's shapes at
    its own layout (2 B/param: Llama-2-70B's shapes at TP8, hand-computed), resident in every phase unless
    offloaded, with a teacher_log_prob phase of its own."""
    seventy = ["teacher.arch.hidden_size=8192", "teacher.arch.intermediate_size=28672", "teacher.arch.num_layers=80",
               "teacher.arch.num_attention_heads=64", "teacher.arch.num_kv_heads=8", "teacher.arch.vocab_size=32000"]
    base = plan(load_config(REPO / "configs/ppo_7b.yaml", []))
    cfg = load_config(REPO / "configs/ppo_7b.yaml", ["teacher.model=/models/teacher", "teacher.parallel.tp=8",
                                                       "teacher.parallel.dp=1", *seventy])
    got = plan(cfg)
    # one layer: qkv 8192*(64+2*8)*128 = 83,886,080; proj 8192*8192 = 67,108,864; SwiGLU 3*8192*28672 =
    # 704,643,072; norms 16,384 -> 855,654,400; 80 of them / 8, embedding + output 32000*8192/8 each, final norm
    params = 80 * 855_654_400 // 8 + 2 * 32000 * 8192 // 8 + 8192
    teacher = got["roles"]["teacher"]
    assert teacher["params_per_gpu_m"] == round(params / 1e6, 1) and teacher["grads_gb"] == 0
    assert teacher["weights_gb"] == round(2 * params / GB, 2) and got["layout"]["teacher"] == "TP8xPP1xDP1"
    assert got["processes_per_gpu"] == base["processes_per_gpu"] + 1
    assert abs(got["phases_gb"]["rollout"] - base["phases_gb"]["rollout"] - 2 * params / GB - 0.6) < 0.02
    assert "teacher_log_prob" in got["phases_gb"] and "teacher_log_prob" not in base["phases_gb"]
    cfg.teacher.offload = True
    off = plan(cfg)
    assert abs(off["phases_gb"]["rollout"] - base["phases_gb"]["rollout"] - 0.6) < 0.02  # only its CUDA context


def test_a_frozen_roles_forward_peak_is_planned_in_its_phase_and_unfused_mla_counts_its_scores():
    """A frozen role (the reference here) holds its forward's peak in its own phase only (its logits: R x b x V / tp
    at 10 B each, plus one layer; the workers empty its cache after it): the ref_log_prob phase grows by exactly that,
    every other phase is unchanged. Multi-latent attention runs unfused on megatron's local spec: each layer keeps
    its s x s scores (5 a s^2 b / tp bytes), so DeepSeek-V3's plan grows with the square of the length and a length
    that does not fit is refused (flash attention's families grow linearly)."""
    from megappo.parallel.weight_mapping import padded_vocab_size
    from megappo.memory_model import FORWARD_LOGIT_BYTES, forward_bytes

    cfg = load_config(REPO / "configs/ppo_7b.yaml", ["critic.offload=false"])
    got = plan(cfg)
    ref = got["roles"]["ref"]
    a, par, b = cfg.model.arch, cfg.ref.parallel, cfg.ref.log_prob_micro_batch_size
    s, R = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens, cfg.rollout.max_new_tokens
    vocab = padded_vocab_size(a.vocab_size, par.tp)  # megatron's padded vocabulary (the mapping's rule)
    by_hand = R * b * vocab // par.tp * FORWARD_LOGIT_BYTES + 34 * a.hidden_size * s * b // par.tp
    assert forward_bytes(cfg, cfg, cfg.ref, par) == by_hand and ref["activations_gb"] == round(by_hand / GB, 2)
    cfg.ref.offload = True  # offloaded: its weights leave the other phases, its own phase is weights + forward
    off = plan(cfg)
    assert abs(off["phases_gb"]["ref_log_prob"] - got["phases_gb"]["ref_log_prob"]) < 0.02
    assert abs(got["phases_gb"]["rollout"] - off["phases_gb"]["rollout"] - ref["weights_gb"]) < 0.02  # no forward

    def actor_activations(config, length):
        c = load_config(REPO / "configs" / config, [f"data.max_prompt_length={length // 2}",
                                                    f"rollout.max_new_tokens={length // 2}"], validate=False)
        return plan(c)["roles"]["actor"]["activations_gb"], c

    (short, _), (long, _) = (actor_activations("grpo_deepseek_v3.yaml", n) for n in (4096, 8192))
    dense_short, _ = actor_activations("ppo_7b.yaml", 4096)
    dense_long, _ = actor_activations("ppo_7b.yaml", 8192)
    # linear with flash attention (twice the length, twice the bytes); superlinear under unfused MLA
    assert abs(dense_long - 2 * dense_short) <= 0.02 + 0.01 * dense_long and long - 2 * short > 0.25 * long
    _, huge = actor_activations("grpo_deepseek_v3.yaml", 65536)
    assert not plan(huge)["fits"]


def test_a_teacher_is_planned_from_its_own_config_json_and_may_have_a_pool_of_its_own(tmp_path, tiny_assets):
    """teacher.model without teacher.arch: its config.json's shapes (a 70B teacher of a 7B student planned as 70B,
    the same figures as teacher.arch gives), not the student's; no teacher.parallel: the actor's layout (the demo's
    2-worker pool took a teacher only with dp written out); resources.teacher_workers: the teacher on GPUs of its
    own, out of the training pool's phases, its pool planned apart."""
    from megappo.config import ConfigError

    teacher = tmp_path / "llama70b"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096}))
    seventy = ["teacher.arch.hidden_size=8192", "teacher.arch.intermediate_size=28672", "teacher.arch.num_layers=80",
               "teacher.arch.num_attention_heads=64", "teacher.arch.num_kv_heads=8", "teacher.arch.vocab_size=32000"]
    layout = ["teacher.parallel.tp=8", "teacher.parallel.dp=1"]
    by_arch = plan(load_config(REPO / "configs/ppo_7b.yaml", ["teacher.model=/models/teacher", *layout, *seventy]))
    by_dir = plan(load_config(REPO / "configs/ppo_7b.yaml", [f"teacher.model={teacher}", *layout]))
    assert by_dir["roles"]["teacher"] == by_arch["roles"]["teacher"] and by_dir["phases_gb"] == by_arch["phases_gb"]
    with pytest.raises(ConfigError, match="set teacher.arch"):
        plan(load_config(REPO / "configs/ppo_7b.yaml", ["teacher.model=/models/teacher", *layout]))

    tiny = load_config(REPO / "configs/ppo_tiny.yaml", [f"teacher.model={tiny_assets['tiny-llama']}"])
    assert dict(tiny.teacher.parallel) == {"tp": 1, "pp": 1, "dp": 2, "vpp": None, "ep": 1, "cp": 1}  # the actor's

    own = load_config(REPO / "configs/ppo_7b.yaml", [f"teacher.model={teacher}", "resources.teacher_workers=8",
                                                     "teacher.parallel.tp=8", "teacher.parallel.dp=1"])
    got, base = plan(own), plan(load_config(REPO / "configs/ppo_7b.yaml", []))
    assert "teacher" not in got["roles"] and got["phases_gb"] == base["phases_gb"]  # the train pool as without one
    pool = got["teacher_pool"]
    assert pool["gpus"] == 8 and pool["weights_gb"] == by_dir["roles"]["teacher"]["weights_gb"] and pool["fits"]
    own.resources.teacher_workers, own.teacher.parallel.tp = 1, 1  # 70B's bf16 weights on one 80 GB GPU
    assert not plan(own)["teacher_pool"]["fits"] and not plan(own)["fits"]
    for overrides, line in ((["resources.teacher_workers=2"], "set teacher.model"),
                            ([f"teacher.model={teacher}", "resources.teacher_workers=3", "teacher.parallel.tp=8",
                              "teacher.parallel.dp=1"], "does not divide the pool's 3 workers (resources.teacher_workers)")):
        with pytest.raises(ConfigError, match=line.replace("(", r"\(").replace(")", r"\)")):
            load_config(REPO / "configs/ppo_7b.yaml", overrides)


def test_shared_experts_are_counted_as_dense_parameters(tiny_assets):
    """Qwen2-MoE's shared expert (gate/up/down split over tp like a dense MLP) and its [1, hidden] gate
    (replicated): the tiny model's count equals transformers' numel, Qwen1.5-MoE-A2.7B's is its published 14.3B."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = tiny_assets["tiny-qwen2_moe"]
    hf = AutoConfig.from_pretrained(src)
    arch = [f"model.arch.{k}={v}" for k, v in dict(
        family="qwen2_moe", hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads, vocab_size=hf.vocab_size, tie_word_embeddings=hf.tie_word_embeddings,
        qkv_bias=True, num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=hf.norm_topk_prob,
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size).items()]
    arch += [f"{r}.parallel.{k}={v}" for r in ("actor", "critic", "ref") for k, v in (("tp", 2), ("dp", 4))]
    cfg = load_config(REPO / "configs/ppo_7b.yaml", ["model.path=null", *arch])
    numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    assert total_params(cfg) == numel
    no_shared = load_config(REPO / "configs/ppo_7b.yaml", ["model.path=null", *arch,
                                                          "model.arch.shared_expert_intermediate_size=0"])
    layers = hf.num_hidden_layers
    assert total_params(cfg) - total_params(no_shared) == layers * (3 * hf.hidden_size * hf.shared_expert_intermediate_size
                                                                    + hf.hidden_size)
    a27b = load_config(REPO / "configs/ppo_7b.yaml", [  # Qwen1.5-MoE-A2.7B's config.json
        "model.arch.family=qwen2_moe", "model.arch.hidden_size=2048", "model.arch.intermediate_size=5632",
        "model.arch.num_layers=24", "model.arch.num_attention_heads=16", "model.arch.num_kv_heads=16",
        "model.arch.vocab_size=151936", "model.arch.qkv_bias=true", "model.arch.num_experts=60",
        "model.arch.num_experts_per_tok=4", "model.arch.moe_intermediate_size=1408",
        "model.arch.norm_topk_prob=false", "model.arch.shared_expert_intermediate_size=5632",
        "actor.parallel.ep=2", "critic.parallel.ep=2", "ref.parallel.ep=2"])
    assert round(total_params(a27b) / 1e9, 1) == 14.3


def _hf_weights(model) -> int:
    """What a checkpoint of `model` holds for vLLM: its parameters and a sigmoid router's correction bias (a
    persistent buffer)."""
    return sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))


def test_glm45_dense_first_layers_and_shared_experts_against_transformers(tiny_assets):
    """glm4_moe: the first first_k_dense_replace layers dense, n_shared_experts x moe_intermediate_size beside the
    routed ones, q/k norms: the tiny model's count equals transformers' weights (its parameters and the router's
    correction bias, a buffer vLLM loads and the sync sends); GLM-4.5-Air's shapes give its 106B, GLM-4.5's 352.8B (its published 355B also
    counts the MTP layer megappo skips); configs/grpo_glm45_air.yaml fits its 4 x 8 H200."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(tiny_assets["tiny-glm4_moe"])
    arch = [f"model.arch.{k}={v}" for k, v in dict(
        family="glm4_moe", hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads, head_dim=hf.head_dim,
        num_kv_heads=hf.num_key_value_heads, vocab_size=hf.vocab_size, tie_word_embeddings=hf.tie_word_embeddings,
        qkv_bias=hf.attention_bias, qk_norm=hf.use_qk_norm, num_experts=hf.n_routed_experts,
        num_experts_per_tok=hf.num_experts_per_tok, moe_intermediate_size=hf.moe_intermediate_size,
        shared_expert_intermediate_size=hf.n_shared_experts * hf.moe_intermediate_size,
        first_k_dense_replace=hf.first_k_dense_replace).items()]
    arch += [f"{r}.parallel.{k}={v}" for r in ("actor", "critic", "ref") for k, v in (("tp", 2), ("dp", 4))]
    cfg = load_config(REPO / "configs/ppo_7b.yaml", ["model.path=null", *arch])
    assert total_params(cfg) == _hf_weights(AutoModelForCausalLM.from_config(hf))

    air = load_config(REPO / "configs/grpo_glm45_air.yaml")
    assert round(total_params(air) / 1e9) == 107 and plan(air)["fits"]
    full = load_config(REPO / "configs/grpo_glm45_air.yaml", [  # GLM-4.5 (355B-A32B)'s config.json
        "model.arch.hidden_size=5120", "model.arch.intermediate_size=12288", "model.arch.moe_intermediate_size=1536",
        "model.arch.num_layers=92", "model.arch.num_experts=160", "model.arch.shared_expert_intermediate_size=1536",
        "model.arch.first_k_dense_replace=3", "model.arch.qk_norm=true"])
    assert round(total_params(full) / 1e9, 1) == 352.8


def test_deepseek_v3_multi_latent_attention_and_its_kv_cache(tiny_assets):
    """deepseek_v3: MLA's projections and latent norms, the dense first layers, the shared expert: the tiny
    model's count equals transformers' weights (both q forms; the correction bias included); DeepSeek-V3's shapes give 671.0B (its 685B on the
    hub counts the MTP layer); configs/grpo_deepseek_v3.yaml fits 16 x 8 H200 with rollout TP16, whose MLA KV
    cache is one (kv_lora_rank + RoPE dims) latent per layer on every TP rank."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("tiny-deepseek_v3", "tiny-deepseek_v3_lite"):
        hf = AutoConfig.from_pretrained(tiny_assets[name])
        arch = [f"model.arch.{k}={v}" for k, v in dict(
            family="deepseek_v3", hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads, head_dim=hf.v_head_dim,
            num_kv_heads=hf.num_attention_heads, vocab_size=hf.vocab_size, num_experts=hf.n_routed_experts,
            num_experts_per_tok=hf.num_experts_per_tok, moe_intermediate_size=hf.moe_intermediate_size,
            shared_expert_intermediate_size=hf.n_shared_experts * hf.moe_intermediate_size,
            first_k_dense_replace=hf.first_k_dense_replace, q_lora_rank=hf.q_lora_rank or 0,
            kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim).items()]
        arch += [f"{r}.parallel.{k}={v}" for r in ("actor", "critic", "ref") for k, v in (("tp", 2), ("dp", 4))]
        cfg = load_config(REPO / "configs/ppo_7b.yaml", ["model.path=null", *arch])
        assert total_params(cfg) == _hf_weights(AutoModelForCausalLM.from_config(hf)), name

    v3 = load_config(REPO / "configs/grpo_deepseek_v3.yaml")
    result = plan(v3)
    assert round(total_params(v3) / 1e9, 1) == 671.0 and result["fits"] and result["gpus"] == 128
    rollout = result["roles"]["rollout"]
    assert rollout["kv_cache_bytes_per_token"] == 2 * 61 * (512 + 64)  # per GPU, whatever rollout.tp
    assert rollout["kv_cache_tokens"] >= rollout["kv_cache_tokens_needed"]
    assert not plan(load_config(REPO / "configs/grpo_deepseek_v3.yaml", ["rollout.tp=8"]))["fits"]  # 158 GB of weights



# ---- the figures docs/moe.md and docs/multi-node.md publish, as the planner computes them now ---------------------
# Each published pool is read from the doc (nodes, layout, peak) and planned again: plan() at that pool and layout in
# CI; the `--smallest` search itself (no fewer nodes fit, whatever the layout) where it is one node long, and for
# every pool in the long tier (a search tries every layout of every smaller pool).
LAYOUT = r"TP(\d+)xPP(\d+)xDP(\d+)(?:xEP(\d+))?"
POOL = rf"(?P<nodes>\d+) nodes?, (?P<layout>{LAYOUT}), (?P<peak>[\d.]+) GiB"
GLM45 = ["model.arch.hidden_size=5120", "model.arch.intermediate_size=12288", "model.arch.moe_intermediate_size=1536",
         "model.arch.num_layers=92", "model.arch.num_experts=160", "model.arch.shared_expert_intermediate_size=1536",
         "model.arch.first_k_dense_replace=3", "model.arch.qk_norm=true"]  # GLM-4.5 (355B-A32B)'s config.json
# docs/multi-node.md's table of smallest pools: (how the row's first cell starts, config, the full fine-tuning
# column's overrides, the LoRA column's)
LORA16 = ["actor.lora.rank=16"]
TABLE = [("`ppo_70b.yaml` (PPO", "ppo_70b.yaml", [], LORA16),
         ("`ppo_70b.yaml` as GRPO", "ppo_70b.yaml", ["critic.enable=false", "algorithm.adv_estimator=grpo"],
          ["critic.enable=false", "algorithm.adv_estimator=grpo", *LORA16]),
         ("`grpo_qwen3_235b_a22b.yaml` (H200)", "grpo_qwen3_235b_a22b.yaml", [],
          [*LORA16, "actor.lora.target_modules=[linear_qkv,linear_proj]"]),
         ("the same with every expert adapted", "grpo_qwen3_235b_a22b.yaml", None, [*LORA16, "actor.lora.experts=true"])]


def _doc(name: str) -> str:
    """A doc's text with its line breaks as spaces (a sentence may wrap anywhere)."""
    return " ".join((REPO / "docs" / name).read_text().split())


def _layout(tp, pp, dp, ep) -> str:
    return f"TP{tp}xPP{pp}xDP{dp}" + (f"xEP{ep}" if ep > 1 else "")


def _at(cfg, nodes: int, layout: str):
    """cfg on `nodes` nodes with actor, critic and ref at `layout` (as --smallest sets the layout it reports)."""
    import copy
    import re

    from megappo.config.validate import validate_config

    tp, pp, dp, ep = (int(g or 1) for g in re.fullmatch(LAYOUT, layout).groups())
    cfg = copy.deepcopy(cfg)
    cfg.resources.nodes = nodes
    for r in ("actor", "critic", "ref"):
        cfg[r].parallel.tp, cfg[r].parallel.pp, cfg[r].parallel.dp, cfg[r].parallel.ep = tp, pp, dp, ep
    validate_config(cfg)
    return cfg


def _glm_air_and_deepseek_v3_figures() -> None:
    """docs/moe.md's plans of configs/grpo_glm45_air.yaml and configs/grpo_deepseek_v3.yaml on their own pools."""
    moe = _doc("moe.md")
    for name in ("grpo_glm45_air.yaml", "grpo_deepseek_v3.yaml"):
        cfg = load_config(REPO / "configs" / name)
        p, r, par = plan(cfg), cfg.resources, cfg.actor.parallel
        assert p["fits"]
        pool = f"{r.nodes} x {r.workers_per_node} H200, {_layout(par.tp, par.pp, par.dp, par.ep)}"
        if name == "grpo_glm45_air.yaml":
            want = [f"GRPO on {pool}, rollout TP{cfg.rollout.tp} (planned: {p['total_params_b']:.1f}B, peak "
                    f"{p['peak_gpu_gb']:.1f} GB at {p['peak_phase']})"]
        else:
            at_actor_tp = plan(load_config(REPO / "configs" / name, [f"rollout.tp={par.tp}"]))
            assert not at_actor_tp["fits"]
            want = [f"{pool} ({cfg.model.arch.num_layers} layers: no PP divides them), rollout TP{cfg.rollout.tp} "
                    f"({at_actor_tp['roles']['rollout']['weights_gb']:.0f} GB of bf16 weights per GPU at TP{par.tp} "
                    "does not fit",
                    f"planned {p['total_params_b']:.1f}B, peak {p['peak_gpu_gb']:.1f} GB at {p['peak_phase']}, MLA KV "
                    f"cache {p['roles']['rollout']['kv_cache_bytes_per_token'] / 1024:.1f} KiB per token per GPU; "
                    "`--smallest` finds no fewer nodes"]
        for fragment in want:
            assert fragment in moe, fragment


def _published_pools() -> list:
    """(config, the published smallest pool: a re.Match of POOL) for each filled cell of docs/multi-node.md's table,
    then GLM-4.5's in docs/moe.md."""
    import re

    rows = [[c.strip().replace("**", "") for c in line.strip("|").split("|")]
            for line in (REPO / "docs/multi-node.md").read_text().splitlines() if line.startswith("| ")]
    pools = []
    for start, name, full, lora in TABLE:
        (cells,) = [row for row in rows if row[0].startswith(start)]
        for overrides, cell in ((full, cells[1]), (lora, cells[2])):
            assert (overrides is None) == (cell == ""), (start, cell)
            if overrides is not None:
                pools.append((load_config(REPO / "configs" / name, overrides), re.fullmatch(POOL, cell)))
    glm = re.search(rf"GLM-4.5-355B's shapes: `--smallest` (?P<nodes>\d+) x 8 H200 at (?P<layout>{LAYOUT}) "
                    r"\(peak (?P<peak>[\d.]+) GB\)", _doc("moe.md"))
    pools.append((load_config(REPO / "configs/grpo_glm45_air.yaml", GLM45), glm))
    assert all(m for _, m in pools), [m for _, m in pools]
    return pools


def _check_pools(search_all: bool) -> None:
    """Each published pool fits at its layout with its peak; `search_all` (else: 1-node pools only): --smallest
    finds exactly it. Then the LoRA figures below the table, from the 235B's two LoRA pools."""
    from megappo.param_counts import lora_params
    from megappo.planner import smallest

    pools = _published_pools()
    for cfg, m in pools:
        # every config offloads its roles (the table says so once): the pools below keep that
        assert cfg.actor.offload and cfg.resources.workers_per_node == 8
        result = plan(_at(cfg, int(m["nodes"]), m["layout"]))
        assert result["fits"] and f"{result['peak_gpu_gb']:.1f}" == m["peak"], (m[0], result["peak_gpu_gb"])
        if search_all or m["nodes"] == "1":
            f = smallest(cfg)
            assert (f["nodes"], _layout(f["tp"], f["pp"], f["dp"], f["ep"]), f"{f['peak_gpu_gb']:.1f}") == \
                (int(m["nodes"]), m["layout"], m["peak"]), (m[0], f)
    # the 235B's LoRA pools: attention only, then the experts too
    (attention, experts) = [_at(c, int(m["nodes"]), m["layout"]) for c, m in pools[-3:-1]]
    lora = [plan(attention), plan(experts)]
    adapters = lora_params(experts.model.arch, experts.actor.lora, ep=experts.actor.parallel.ep)[1]
    text = _doc("multi-node.md")
    for fragment in (f"the expert adapters at r=16 add {adapters / 1e9:.2f} B parameters per GPU",
                     f"update phase goes from {lora[0]['phases_gb']['actor_update']:.1f} to "
                     f"{lora[1]['phases_gb']['actor_update']:.1f} GB",
                     f"the weight sync of the offloaded actor: {lora[0]['peak_gpu_gb']:.1f} -> "
                     f"{lora[1]['peak_gpu_gb']:.1f} GB"):
        assert fragment in text, fragment
    assert lora[0]["peak_phase"] == lora[1]["peak_phase"] == "weight_sync"


def test_published_plans_are_the_planners():
    """Every figure docs/moe.md and docs/multi-node.md publish from `megappo plan` / `--smallest` is the planner's
    now: GLM-4.5-Air's and DeepSeek-V3's own pools, the smallest pools of the table and GLM-4.5's at their layouts
    (the 1-node ones found by the search itself), the LoRA figures below the table."""
    _glm_air_and_deepseek_v3_figures()
    _check_pools(search_all=False)


@pytest.mark.long  # 96 s (379 s on a loaded machine): --smallest searches every layout of every smaller pool; CI plans
# each published pool at its layout
def test_published_smallest_pools_are_what_the_search_finds():
    from megappo.planner import smallest

    _check_pools(search_all=True)
    v3 = load_config(REPO / "configs/grpo_deepseek_v3.yaml")
    assert smallest(v3)["nodes"] == v3.resources.nodes  # docs/moe.md: "`--smallest` finds no fewer nodes"


# ---- context parallel (issue #72): a rank holds s / cp tokens of each sample ----------------------------------------
QWEN_64K, V3_64K = "configs/grpo_qwen3_30b_a3b_64k.yaml", "configs/grpo_deepseek_v3_64k.yaml"


def _cp(cfg, cp: int, dp: int, nodes: int | None = None):
    cfg = copy.deepcopy(cfg)
    for r in ("actor", "critic", "ref"):
        cfg[r].parallel.cp, cfg[r].parallel.dp = cp, dp
    if nodes:
        cfg.resources.nodes = nodes
    return cfg


def test_context_parallel_splits_a_ranks_tokens_and_shards_the_optimizer_against_hand_calculation():
    """Qwen3-30B-A3B at 64k tokens, TP4 x DP2 x EP2, at CP2 and CP4 (the pool grows): each rank's per-token
    activations halve with cp; the attention's gathered K/V stay s x kv_dim per layer (all-gathered), SDPA's additive
    mask is 2 B x L x cp*L, the bool mask L x cp*L, one at a time (L = s / cp); weights and grads are whole on every CP
    rank, the optimizer's state sharded over dp * cp (experts over dp * cp / ep)."""
    from megappo.memory_model import activation_terms

    base = load_config(REPO / QWEN_64K)
    s, got = 65536, {}
    for cp in (2, 4):
        cfg = _cp(base, cp, 2, nodes=cp)
        par, actor = cfg.actor.parallel, cfg.actor
        t = activation_terms(cfg, actor, par, lm_head=True)
        L = s // cp
        kv = 2 * cp * L * 2 * (4 // par.tp) * 128  # k and v: 4 kv heads of 128 over tp 4, bf16, cp*L gathered tokens
        bias, masks = 2 * L * cp * L, L * cp * L  # each attention call builds its own from the chunk table
        per_token = 15 * 2048 + 8 * (4 * 2048 + 6 * 768)  # the routed MLP's (top-8) beside attention's 15 h
        layers = 48 * 2 * L * 2048 // 4 + per_token * L // 4 + kv + bias  # full recompute: inputs + one layer
        # the LM head on the rank's response columns (every column past the 1,024-token prompt), the busiest rank's
        c = s // (2 * cp)
        columns = max(sum(max(0, min((k + 1) * c, s) - max(k * c, 1024)) for k in (r, 2 * cp - 1 - r))
                      for r in range(cp))
        logits = columns * 151936 // 4 * 16
        got_terms = (t["tokens_per_gpu"], t["cp_kv_per_layer"], t["cp_bias_per_layer"], t["cp_masks"])
        assert got_terms == (L, kv, bias, masks)
        assert (t["layers"], t["logits"]) == (layers, logits)
        p = plan(cfg)
        assert p["roles"]["actor"]["activations_gb"] == round((layers + masks + logits) / GB, 2)
        got[cp] = (t, p["roles"]["actor"], cfg)
    (t2, m2, c2), (t4, m4, c4) = got[2], got[4]
    assert t4["tokens_per_gpu"] * 2 == t2["tokens_per_gpu"] and t4["cp_kv_per_layer"] == t2["cp_kv_per_layer"]
    # the per-token terms halve (what is left of a layer when the attention's K/V and mask are taken out)
    assert 2 * (t4["layers"] - t4["cp_kv_per_layer"] - t4["cp_bias_per_layer"]) == \
        t2["layers"] - t2["cp_kv_per_layer"] - t2["cp_bias_per_layer"]
    assert m2["weights_gb"] == m4["weights_gb"] and m2["grads_gb"] == m4["grads_gb"]
    from megappo.param_counts import stage_split

    dense, experts = stage_split(c4, 4, 1, 2, "lm")
    assert m4["optimizer_gb"] == round(12 * (dense / (2 * 4) + experts / (2 * 4 // 2)) / GB, 2)
    assert abs(2 * m4["optimizer_gb"] - m2["optimizer_gb"]) < 0.02


def test_max_len_grows_with_cp_and_is_the_longest_that_fits():
    """DeepSeek-V3 at TP8 x DP16 x EP16: without CP megatron's local MLA keeps each layer's s x s scores, with it the
    CP attention runs fused: the longest sample that fits grows with cp (16, 32, 64 nodes) up to the model's
    positions; one token more does not fit."""
    from megappo.planner import max_len, with_length

    base = load_config(REPO / V3_64K)
    found = {cp: max_len(_cp(base, cp, 16, nodes=16 * cp)) for cp in (1, 2, 4)}
    assert found[1]["tokens"] < found[2]["tokens"] < found[4]["tokens"] == 163840, found
    assert found[4]["bound"] == "positions" and found[2]["bound"] == "memory"
    assert found[2]["layout"] == "TP8xCP2xPP1xDP16xEP16" and found[1]["layout"] == "TP8xPP1xDP16xEP16"
    at = _cp(base, 2, 16)
    assert plan(with_length(at, found[2]["tokens"], True))["fits"]
    assert not plan(with_length(at, found[2]["tokens"] + 1, True))["fits"]
    doc = _doc("multi-node.md")
    for fragment in (f"CP1 on 16 nodes {found[1]['tokens']:,} tokens", f"CP2 on 32 nodes {found[2]['tokens']:,} tokens",
                     f"CP4 on 64 nodes the model's {found[4]['tokens']:,} positions"):
        assert fragment in doc, fragment


def test_smallest_chooses_cp_for_a_64k_target_and_bad_lengths_get_one_line(capsys):
    """--smallest --seq-len: the config's tp / pp / ep at cp 1, 2, 4, ... on the fewest nodes. Qwen3-30B-A3B's 64k
    recipe written at CP1 (TP4 x DP8 x EP2 on its 4 nodes): no cp fits fewer nodes, and on 4 the search picks a
    cp > 1 where CP1 does not fit. Bad lengths get one line naming the fix."""
    import argparse

    from megappo.planner import _with_cp, add_arguments, main, smallest

    cfg = _cp(load_config(REPO / QWEN_64K), 1, 8)
    found = smallest(cfg, cps=(1, 2, 4, 8))
    assert found["cp"] > 1 and (found["tp"], found["pp"], found["ep"]) == (4, 1, 2), found
    at = copy.deepcopy(cfg)
    at.resources.nodes = found["nodes"]
    assert not plan(_with_cp(at, 1))["fits"]
    got = plan(_with_cp(at, found["cp"]))
    assert got["fits"] and got["peak_gpu_gb"] == found["peak_gpu_gb"]
    assert (f"smallest pool: {found['nodes']} node(s) x 8 GPUs, actor TP4xCP{found['cp']}xPP1xDP{found['dp']}xEP2 "
            f"offloaded, peak {found['peak_gpu_gb']:.1f} GB at 65,536 tokens") in _doc("multi-node.md")

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, fix in ((["--seq-len", "512"], "must be above data.max_prompt_length=1024"),
                      (["--seq-len", "200000"], "at most the model's 163840 positions"),
                      (["--max-len", "--smallest"], "drop --smallest / --seq-len"),
                      (["--max-len", "actor.parallel.cp=1", "ref.parallel.cp=1", "actor.parallel.dp=32",
                        "ref.parallel.dp=32", "actor.micro_batch_size=1", "data.max_prompt_length=32768"],
                       "not even a 32769-token sample fits at TP8xPP1xDP32xEP16")):
        assert main(parser.parse_args(["--config", str(REPO / V3_64K), *argv])) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fix in err[0], (argv, err)


def test_the_64k_recipes_fit_as_the_docs_say():
    """configs/grpo_qwen3_30b_a3b_64k.yaml and grpo_deepseek_v3_64k.yaml: valid, 64k-token samples at CP > 1 that
    fit, and their plans and longest samples as docs/multi-node.md records them."""
    from megappo.planner import max_len

    doc = _doc("multi-node.md")
    for name in (QWEN_64K, V3_64K):
        cfg = load_config(REPO / name)
        p, m = plan(cfg), max_len(cfg)
        assert p["fits"] and p["sample_tokens"] == 65536 and cfg.actor.parallel.cp > 1 and m["tokens"] > 65536
        par = cfg.actor.parallel
        layout = f"TP{par.tp}xCP{par.cp}xPP{par.pp}xDP{par.dp}xEP{par.ep}"
        assert p["layout"]["actor"] == layout
        for fragment in (f"peak {p['peak_gpu_gb']:.1f} GB ({p['peak_phase']}): fits",
                         f"longest sample at {layout}: {m['tokens']:,} tokens"):
            assert fragment in doc, (name, fragment)
    # Qwen's pool without CP (TP4 x DP8 x EP8) holds 64k too: the docs compare the two
    no_cp = load_config(REPO / QWEN_64K, [f"{r}.parallel.{k}={v}" for r in ("actor", "ref")
                                          for k, v in (("cp", 1), ("dp", 8), ("ep", 8))])
    p, m = plan(no_cp), max_len(no_cp)
    assert p["layout"]["actor"] == "TP4xPP1xDP8xEP8" and p["fits"]
    assert f"at TP4xDP8xEP8: peak {p['peak_gpu_gb']:.1f} GB, at most {m['tokens']:,} tokens" in doc


# ---- a vision-language model's vision tower (megappo/vision_memory.py) --------------------------------------------
# Qwen2.5-VL-7B's config.json, as published (its checkpoint is not at hand offline): the vision tower's and the
# language model's shapes
QWEN25_VL_7B = {"model_type": "qwen2_5_vl", "tie_word_embeddings": False,
                "vision_config": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                      out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                      in_chans=3, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
                "text_config": dict(model_type="qwen2_5_vl_text", hidden_size=3584, intermediate_size=18944,
                                    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                    vocab_size=152064, max_position_embeddings=128000,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                     "mrope_section": [16, 24, 24]})}


def test_the_vision_towers_parameters_are_the_modules_own():
    """The planner's tower + merger count is the sum of the module's own tensors (models/vision.vision_tensors, built
    on the meta device) for the tiny tower and Qwen2.5-VL-7B's; with its language model it is the published
    checkpoint's total (Qwen2.5-VL-7B-Instruct's safetensors: 8,292,166,656 parameters, 0.68B of them the tower's)."""
    import math

    from omegaconf import OmegaConf
    from transformers import Qwen2_5_VLConfig

    from megappo.assets import VISION_SHAPES
    from megappo.config.schema import ArchConfig
    from megappo.config.validate import arch_from_hf
    from megappo.models.vision import vision_tensors
    from megappo.vision_memory import vision_params

    for vc in (dict(VISION_SHAPES, out_hidden_size=128), QWEN25_VL_7B["vision_config"]):
        shapes = vision_tensors(Qwen2_5_VLConfig(vision_config=vc))
        assert vision_params(vc) == sum(math.prod(s) for s in shapes.values()), vc
    cfg = load_config(REPO / "configs/grpo_tiny_vl.yaml", validate=False)
    cfg.model.arch = OmegaConf.merge(OmegaConf.structured(ArchConfig), arch_from_hf(QWEN25_VL_7B))
    assert total_params(cfg) + vision_params(QWEN25_VL_7B["vision_config"]) == 8_292_166_656


def test_the_vision_towers_activations_are_what_autograd_keeps():
    """A trained tower's activations per patch (vision_memory.patch_bytes) are the bytes autograd keeps of the tiny
    tower in bf16 (the distinct storages besides its parameters), for one image of several windows and for two
    images of other shapes; a frozen tower keeps none."""
    import torch

    from megappo.assets import VISION_SHAPES
    from megappo.models.vision import vision_tower
    from megappo.vision_memory import patch_bytes
    from transformers import Qwen2_5_VLConfig

    vc = dict(VISION_SHAPES, out_hidden_size=128)
    tower = vision_tower(Qwen2_5_VLConfig(vision_config=vc).vision_config, torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in tower.parameters()}

    def kept(grids) -> tuple[int, int]:
        grids = torch.tensor(grids)
        n = int(grids.prod(-1).sum())
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            tower(torch.randn(n, 3 * 2 * 14 * 14, dtype=torch.bfloat16), grid_thw=grids)
        return n, sum(storages.values())

    for grids in ([[1, 16, 16]], [[1, 8, 8], [1, 4, 12]]):
        n, got = kept(grids)
        assert got == n * patch_bytes(vc, trained=True), (grids, got, n * patch_bytes(vc, trained=True))
    tower.requires_grad_(False)
    assert kept([[1, 16, 16]])[1] == 0


def test_a_vision_language_model_is_planned_with_its_tower(tmp_path):
    """Qwen2.5-VL-7B (its config.json at model.path): the tower's parameters join the first stage whole at every
    tp and pp (not divided by tp), with grads and Adam only when trained (not model.freeze_vision); the reference
    holds its weights; vLLM splits it over rollout TP. Its activations grow with the image tokens and the micro-batch's
    rows, not with tp; a frozen tower (freeze_vision, LoRA) counts one block's. A bad image-token count: one line."""
    from omegaconf import OmegaConf

    from megappo.config.schema import ArchConfig
    from megappo.config.validate import arch_from_hf
    from megappo.memory_model import role_memory
    from megappo.config import ConfigError
    from megappo.vision_memory import image_tokens, patch_bytes, vision_params

    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps(QWEN25_VL_7B))
    vc = QWEN25_VL_7B["vision_config"]
    v = vision_params(vc)

    base = load_config(REPO / "configs/grpo_tiny_vl.yaml", ["resources.workers_per_node=8", "rollout.tp=2"],
                       validate=False)
    base.model.arch = OmegaConf.merge(OmegaConf.structured(ArchConfig), arch_from_hf(QWEN25_VL_7B))

    def at(path, tp=1, pp=1, **keys):
        cfg = copy.deepcopy(base)
        cfg.model.path = str(path)
        for r in ("actor", "ref"):
            cfg[r].parallel.tp, cfg[r].parallel.pp = tp, pp
        for k, value in keys.items():
            OmegaConf.update(cfg, k.replace("__", "."), value)
        return with_pool(cfg, None, None, None)

    text, vl = tmp_path / "text", tmp_path / "vl"  # no config.json at hand: the language model alone
    for tp, pp in ((1, 1), (2, 1), (2, 2)):
        t, m = role_memory(at(text, tp, pp), "actor"), role_memory(at(vl, tp, pp), "actor")
        dp = 8 // (tp * pp)
        # at pp 2 the text model's worst stage is the last (the first's layers + the final norm, hidden_size more);
        # with the tower it is the first
        dv = v - (QWEN25_VL_7B["text_config"]["hidden_size"] if pp > 1 else 0)
        assert m.params_per_gpu - t.params_per_gpu == dv and m.vision_trained and t.vision_params == 0, (tp, pp)
        assert (m.weights_gb - t.weights_gb, m.grads_gb - t.grads_gb, m.optimizer_gb - t.optimizer_gb) == \
            pytest.approx((2 * dv / GB, 4 * dv / GB, 12 * dv / dp / GB)), (tp, pp)
        frozen = role_memory(at(vl, tp, pp, model__freeze_vision=True), "actor")
        assert (frozen.weights_gb, frozen.grads_gb, frozen.optimizer_gb) == \
            pytest.approx((m.weights_gb, 4 * (m.params_per_gpu - v) / GB, 12 * (m.params_per_gpu - v) / dp / GB))
        ref, ref_t = role_memory(at(vl, tp, pp), "ref"), role_memory(at(text, tp, pp), "ref")
        assert (ref.weights_gb - ref_t.weights_gb, ref.grads_gb) == pytest.approx((2 * dv / GB, 0.0))
    p, p_t = plan(at(vl)), plan(at(text))
    assert p["roles"]["rollout"]["weights_gb"] - p_t["roles"]["rollout"]["weights_gb"] == \
        pytest.approx(2 * v / 2 / GB, abs=0.01)
    assert p["total_params_b"] == round(8_292_166_656 / 1e9, 3)

    def vision(tp=1, **keys):
        return role_memory(at(vl, tp, **keys), "actor").terms["vision"]

    cfg = at(vl)
    # null data.max_image_tokens: every prompt token an image's, spatial_merge_size^2 patches each; pp 1: one
    # micro-batch in flight
    patches = cfg.actor.micro_batch_size * vc["spatial_merge_size"] ** 2 * cfg.data.max_prompt_length
    assert vision() == patches * patch_bytes(vc, trained=True)
    assert vision(data__max_image_tokens=32) == 2 * vision(data__max_image_tokens=16) > 0
    assert vision(actor__micro_batch_size=2 * cfg.actor.micro_batch_size) == 2 * vision() == 2 * vision(tp=2)
    assert vision(model__freeze_vision=True) == vision(actor__lora__rank=8) == patches * patch_bytes(vc, False)
    with pytest.raises(ConfigError, match=r"^data.max_image_tokens=-1 must be in 0\.\.\d+ .*or null"):
        image_tokens(at(vl, data__max_image_tokens=-1))
