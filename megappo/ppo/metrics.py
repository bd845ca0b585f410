"""Per-step PPO metrics, computed on the driver from the step's batch and the workers' update metrics.

Names follow open-instruct's PPO (docs in the seed; definitions here where they leave room):

  episode                    responses trained on so far (steps x data.train_batch_size x rollout.n)
  lr                         the actor's learning rate at this step
  epoch                      prompts trained on so far / dataset size (2.7 = 70% into the third pass)
  objective/kl               mean over responses of the summed per-token KL(pi_old || ref) (algorithm.kl_penalty)
  objective/scores           mean final score (rule reward (+ RM score), non-stop penalty applied)
  objective/rlhf_reward      objective/scores + objective/non_score_reward
  objective/non_score_reward mean over responses of -beta * summed KL (0 when the KL is not in the reward)
  objective/entropy          mean over responses of the summed per-token entropy of pi_old
  objective/loss             loss/policy_avg + loss/value_avg (actor and critic have their own optimizers;
                             without a critic: loss/policy_avg, and loss/value_avg is not logged)
  objective/verifiable_correct_rate  fraction of responses whose rule score is the full score
  loss/policy_avg, loss/value_avg    mean PPO clipped policy / value loss over the step's mini-batches
  policy/approxkl_avg        mean of 0.5 * (logp - logp_old)^2 over the updates (k2; actor/approx_kl);
                             actor/ppo_kl is verl's: mean of logp_old - logp (k1)
  policy/clipfrac_avg        fraction of tokens where the policy ratio was clipped
  policy/entropy_avg         token-mean entropy of pi_old over the response tokens (both entropies are
                             absent with actor.use_rollout_log_probs: no pi_old forward)
  val/sequence_lengths       mean response length (tokens) of this step's rollouts
  val/num_stop_token_ids     number of this step's responses that ended with a stop token
  time/from_scratch, time/training   seconds since fit() started / this step's seconds

Plus: timing/* (seconds only, one per phase; timing/save_s is what the step waited for checkpoints: a
save's tensor copy, and the previous step's background save finishing its files; 0 when neither; and
timing/rollout_overlap_frac, a ratio of two of them), tokens/{actor,critic}_real, _computed, _padded_batch
(the update's tokens: real ones, what the micro-batches computed, the padded batch; what padding cost),
perf/{actor,critic}_peak_rss_gb (the largest DP rank's peak resident memory since its process started, the
hybrid engine's vLLM included) and _peak_device_memory_gb (torch's peak allocated on its GPU; not on CPU),
dynamic_sampling/* (algorithm.filter_groups: rounds, groups_drawn, groups_varied, groups_topped_up; fully_async:
groups_dropped, no rounds), eval/*
(validation), the workers' actor/*, critic/* update metrics as
they come (critic/* only when there is a critic), advantages/{mean,max,min} over the response tokens,
and rollout/*:

  rollout/logprob_diff_mean, _max   |log p_vLLM - log p_Megatron| over the sampled tokens (pi_old vs
                             the sampler: in sync mode the numeric gap of two engines on the same
                             weights, ~1e-6 in fp32; in async mode also one step of policy lag).
                             Without a pi_old forward (actor.use_rollout_log_probs, actor.proximal=
                             loglinear): _mean only, measured by the update's first optimizer step on
                             its mini-batch (the weights that sampled, in sync mode)
  rollout/token_mult_prob_error  mean over tokens of exp|log p_vLLM - log p_Megatron| = the
                             token-level probability ratio's distance from 1 (1.0 = identical; 1.01
                             = the engines disagree by ~1% on a typical token's probability)
  rollout/tis_weight_mean, tis_capped_frac  truncated importance weights min(pi_old / pi_rollout, 2)
  rollout/weights_fingerprint_ok  1 when vLLM's weights matched the trainer's after the sync
  rollout/weights_fingerprint_vision_tensors  a vision-language model: its vision tower's tensors among them
  multi-turn (agent/loop.agent_metrics): rollout/turns_mean, tool_calls_mean, tool_call_rate (share of
  samples that called a tool), tool_call_valid_rate, tool_errors, tool_timeouts, tokens_model,
  tokens_tool; timing/tool_s (summed over calls; calls of a turn run concurrently). With rollout.agent the
  gateway counts the calls the model wrote, the unreadable ones and the tokens between model turns
  (gateway/agents._trajectory); the agent's own tool errors, timeouts and time are not seen (0)
  your own agent (rollout.agent, agent/loop._own_agent_metrics): rollout/agent_sessions, agent_requests_mean,
  agent_segments_mean, agent_segment_rows, agent_fallbacks (re-rendered requests), agent_errors,
  agent_timeouts, agent_own_prompt; timing/agent_s_{mean,p50,p95,max} (a session's wall time) and
  timing/agent_request_s_{p50,p95,max} (each request's latency: agent/loop.request_latency_metrics)
"""

from __future__ import annotations

from typing import Mapping

import torch

from megappo.agent.loop import agent_metrics, request_latency_metrics
from megappo.ppo import core_algos as algos
from megappo.ppo.losses import compute_importance_weights, logprob_parity

OPEN_INSTRUCT_KEYS = (
    "episode", "lr", "epoch", "objective/kl", "objective/scores", "objective/rlhf_reward",
    "objective/non_score_reward", "objective/entropy", "objective/loss", "objective/verifiable_correct_rate",
    "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg",
    "val/sequence_lengths", "val/num_stop_token_ids", "time/from_scratch", "time/training",
)
# the console's line per step (label, key): what a newcomer watches; every metric goes to metrics.jsonl and
# TensorBoard (utils/tracking.py)
CONSOLE_KEYS = (
    ("score", "objective/scores"), ("correct", "objective/verifiable_correct_rate"),
    ("eval_correct", "eval/verifiable_correct_rate"), ("kl", "objective/kl"), ("pg_loss", "loss/policy_avg"),
    ("vf_loss", "loss/value_avg"), ("len", "response_length/mean"), ("staleness", "async/sample_staleness_mean"),
    ("routes", "actor/moe_route_agreement"), ("s/step", "timing/step_s"),
)


def kl_metrics(old_log_probs: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor, beta: float,
               kind: str) -> dict:
    """objective/kl (+ the reward terms with beta) when the KL is not applied in the reward."""
    seq_kl = (algos.kl_penalty(old_log_probs, ref_log_prob, kind) * mask).sum(-1)
    return {"objective/kl": seq_kl.mean().item(), "objective/kl_coef": beta,
            "objective/non_score_reward": (-beta * seq_kl).mean().item()}


def distill_metrics(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> dict:
    """On-policy distillation over the trained tokens: distill/reverse_kl, the per-token mean of
    log pi_student - log pi_teacher on the sampled tokens (a Monte-Carlo estimate of KL(student || teacher));
    distill/reverse_kl_seq, its sum per sequence averaged over sequences; the two models' mean log-probs."""
    m = mask.float()
    d = (student_log_probs - teacher_log_probs) * m
    tokens = m.sum().clamp(min=1)
    return {"distill/reverse_kl": (d.sum() / tokens).item(), "distill/reverse_kl_seq": d.sum(-1).mean().item(),
            "distill/teacher_logprob_mean": ((teacher_log_probs * m).sum() / tokens).item(),
            "distill/student_logprob_mean": ((student_log_probs * m).sum() / tokens).item()}


def rollout_parity_metrics(batch) -> dict:
    """vLLM's sampling log-probs vs the trainer's pi_old on the same tokens. Sync mode: the numeric gap
    between the two engines on identical weights; async mode: that plus one step of policy lag."""
    b = batch.batch
    if "rollout_log_probs" not in b or "old_log_probs" not in b:
        return {}
    if not b["response_mask"].any():
        return {}
    parity = logprob_parity(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    _, tis = compute_importance_weights(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    return {**{k: v.item() for k, v in parity.items()}, **tis}


def data_metrics(batch) -> dict:
    """Shapes of the step's data: lengths, stops, advantages, returns, values (verl's critic/* set)."""
    b = batch.batch
    mask = b["response_mask"].to(torch.float32)
    lengths = mask.sum(-1)
    R = b["responses"].shape[1]
    out = {
        "val/sequence_lengths": lengths.mean().item(),
        "val/num_stop_token_ids": float(b["stopped"].sum().item()) if "stopped" in b else float("nan"),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/clip_ratio": (lengths >= R).float().mean().item(),
        "prompt_length/mean": (b["attention_mask"][:, :-R].sum(-1).float()).mean().item(),
    }
    if "entropy" in b:
        out["objective/entropy"] = (b["entropy"] * mask).sum(-1).mean().item()
        out["policy/entropy_avg"] = algos.masked_mean(b["entropy"], mask).item()
    prefixes = {"advantages": "advantages", "returns": "critic/returns", "values": "critic/values"}
    for key, prefix in prefixes.items():
        if key in b and (key == "advantages" or "values" in b):  # returns/values: only with a critic
            v = b[key][mask.bool()]
            if not v.numel():  # no trained token in the step (e.g. every sample's agent failed)
                continue
            out[f"{prefix}/mean"] = v.mean().item()
            out[f"{prefix}/max"] = v.max().item()
            out[f"{prefix}/min"] = v.min().item()
    if "values" in b and "returns" in b and mask.any():
        ret, val = b["returns"][mask.bool()], b["values"][mask.bool()]
        out["critic/vf_explained_var"] = (1 - (ret - val).var() / (ret.var() + 1e-8)).item()
    return out


def step_metrics(*, step: int, batch, reward_metrics: Mapping, kl: Mapping, actor: Mapping, critic: Mapping,
                 prompts_per_step: int, responses_per_step: int, dataset_size: int, step_s: float,
                 since_start_s: float, pi_old_recomputed: bool = True) -> dict:
    """The open-instruct set for one step (+ data/parity metrics and the workers' update metrics).
    `pi_old_recomputed` false: old_log_probs are the sampler's own, so the parity metrics come from the
    update's first step (PolicyLoss.parity_in_update), not from comparing the sampler with itself."""
    parity = rollout_parity_metrics(batch) if pi_old_recomputed else {}
    m = {**data_metrics(batch), **parity, **agent_metrics(batch.batch),
         **request_latency_metrics(batch.non_tensor_batch), **dict(reward_metrics), **dict(kl),
         **dict(actor), **dict(critic)}
    scores = m["objective/scores"]
    m.setdefault("objective/kl", 0.0)
    m.setdefault("objective/non_score_reward", 0.0)
    m["objective/rlhf_reward"] = scores + m["objective/non_score_reward"]
    m["loss/policy_avg"] = float(actor.get("actor/pg_loss", float("nan")))
    m["objective/loss"] = m["loss/policy_avg"]
    if critic:  # no critic (GRPO, RLOO, ...): no value loss to report
        m["loss/value_avg"] = float(critic.get("critic/vf_loss", 0.0))
        m["objective/loss"] += m["loss/value_avg"]
    m["policy/approxkl_avg"] = float(actor.get("actor/approx_kl", float("nan")))
    m["policy/clipfrac_avg"] = float(actor.get("actor/pg_clipfrac", float("nan")))
    m["lr"] = float(actor.get("actor/lr", float("nan")))
    m["episode"] = step * responses_per_step
    m["epoch"] = step * prompts_per_step / max(dataset_size, 1)
    m["time/training"] = step_s
    m["time/from_scratch"] = since_start_s
    return m


def eval_metrics(batch, reward_metrics: Mapping) -> dict:
    mask = batch.batch["response_mask"].to(torch.float32)
    return {"eval/scores": reward_metrics["objective/scores"],
            "eval/verifiable_correct_rate": reward_metrics["objective/verifiable_correct_rate"],
            "eval/sequence_lengths": mask.sum(-1).mean().item(),
            "eval/stop_rate": reward_metrics.get("reward/stop_rate", float("nan")),
            "eval/num_prompts": float(len(batch))}
