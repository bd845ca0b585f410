"""PPO math on the driver, written plainly (CleanRL style): masked statistics, the advantage estimators,
DAPO's group filter, KL estimators and KL in the reward. Pure torch: never imports Ray or Megatron.
The advantage estimators are one dict, `ADV_ESTIMATORS` (name -> function), at the end of their section.
The per-token losses the workers apply (clipped surrogate, value, entropy, their aggregation) are ppo/losses.py.

Shapes: B = batch (sequences), T = response length. Responses are right-padded and
`response_mask` [B, T] is 1 on response tokens, 0 on padding after the response end.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from megappo.config.schema import CHOICES, FILTER_GROUPS_METRICS

KL_KINDS = CHOICES["algorithm.kl_penalty"]
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # verl's estimator names


# ----------------------------------------------------------------------------- masked statistics
def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) over `dim` (all dims when None)."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over `dim`; 0 where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements (Bessel-corrected when `unbiased`)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n <= 1:
            return var
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked elements; padding is set to 0.

    With shift_mean=False the mean is added back (only the scale is normalised)."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


# ----------------------------------------------------------------------------- advantages
def compute_gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016), over the masked tokens only.

        delta_t = r_t + gamma * V_{t'} - V_t           (t' = the next token with mask 1; V after the end = 0)
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                             (returns: targets for the critic)

    Tokens with mask 0 are skipped, wherever they are: right padding after the response, or gaps in
    the middle (tool outputs, other turns of a multi-turn response: verl's convention); the recursion
    carries V and A across them. Returns are computed from the raw advantages; `whiten` then
    normalises the advantages over the mask.
    """
    mask = response_mask.to(values.dtype)
    rewards = token_level_rewards * mask
    values = values * mask
    T = rewards.shape[1]
    advantages_reversed = []
    last_gae = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # a masked token passes the next valid token's value and advantage through unchanged
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1) * mask
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _group_rows(index: Any) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, uid in enumerate(np.asarray(index, dtype=object).tolist()):
        groups[uid].append(i)
    return groups


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): per prompt group, A_i = (s_i - mean(s)) / (std(s) + eps).

    s_i is the summed reward of response i; `index` holds the prompt uid of each row. std is the
    unbiased std; a group of one gets mean 0, std 1. Broadcast over the response tokens.
    Returns (advantages, returns) with returns == advantages."""
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    for rows in _group_rows(index).values():
        s = scores[rows]
        if len(rows) == 1:
            mean, std = torch.zeros_like(s[0]), torch.ones_like(s[0])
        else:
            mean, std = s.mean(), s.std()
        advantages[rows] = (s - mean) / (std + epsilon) if norm_by_std else s - mean
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): A_i = s_i - mean_{j != i} s_j within the prompt group.

    A group of one has no baseline (A_i = s_i). Returns (advantages, returns == advantages)."""
    scores = token_level_rewards.sum(dim=-1)
    advantages = scores.clone()
    for rows in _group_rows(index).values():
        n = len(rows)
        if n > 1:
            s = scores[rows]
            advantages[rows] = s - (s.sum() - s) / (n - 1)
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): G_t = r_t + gamma * G_{t+1} (reset after the response end), A = whiten(G)."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = (token_level_rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    advantages = masked_whiten(returns, mask)
    return advantages, returns


def _group_baseline_advantage(scores: torch.Tensor, index: Any, baseline) -> torch.Tensor:
    """scores - baseline(group rows) per prompt group; a group of one has baseline 0."""
    advantages = scores.clone()
    for rows in _group_rows(index).values():
        if len(rows) > 1:
            advantages[rows] = scores[rows] - baseline(rows)
    return advantages


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025): A_i = s_i - mean of its prompt group, then whitened over the batch."""
    scores = token_level_rewards.sum(dim=-1)
    adv = _group_baseline_advantage(scores, index, lambda rows: scores[rows].mean())
    adv = masked_whiten(adv.unsqueeze(-1) * response_mask, response_mask) * response_mask
    return adv, adv


def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): A_t = G_t - b, G_t the reward-to-go, b the reward of the prompt's greedy
    response (`reward_baselines` [B], one per row). Returns G."""
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any, f_norm: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): A_i = alpha * (s_i - mean of its group) / f_norm with alpha = B / (number of
    rows with a non-zero score), which rescales the gradient when most rows score 0."""
    scores = token_level_rewards.sum(dim=-1)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    adv = alpha * _group_baseline_advantage(scores, index, lambda rows: scores[rows].mean()) / f_norm
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): the group baseline weighted by response length, b = sum(|o_j| s_j) / sum |o_j|."""
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    adv = _group_baseline_advantage(
        scores, index, lambda rows: (lengths[rows] * scores[rows]).sum() / lengths[rows].sum().clamp(min=1))
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any, epsilon: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (verl's grpo_passk): only each group's best response learns, with advantage
    (best - second best) [/ (group std + eps)]: what raises pass@k rather than the mean score."""
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    for uid, rows in _group_rows(index).items():
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs >= 2 responses per prompt (group {uid!r} has {len(rows)}); "
                             "set rollout.n >= 2")
        s = scores[rows]
        top, top_i = torch.topk(s, 2)
        adv = top[0] - top[1]
        advantages[rows[int(top_i[0])]] = adv / (s.std() + epsilon) if norm_by_std else adv
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


# name (algorithm.adv_estimator) -> fn(token_level_rewards, response_mask, algorithm config, **inputs)
# -> (advantages, returns). inputs: values (the critic's [B, T], GAE), index (each row's prompt uid:
# the group estimators), baselines (the greedy responses' rewards [B], ReMax).
ADV_ESTIMATORS = {
    "gae": lambda r, mask, a, values=None, **_: compute_gae_advantages(r, values, mask, a.gamma, a.lam,
                                                                       a.whiten_advantages),
    "grpo": lambda r, mask, a, index=None, **_: compute_grpo_outcome_advantage(
        r, mask, index, norm_by_std=a.norm_adv_by_std_in_grpo),
    "rloo": lambda r, mask, a, index=None, **_: compute_rloo_outcome_advantage(r, mask, index),
    "reinforce_plus_plus": lambda r, mask, a, **_: compute_reinforce_plus_plus_outcome_advantage(r, mask, a.gamma),
    "reinforce_plus_plus_baseline": lambda r, mask, a, index=None, **_:
        compute_reinforce_plus_plus_baseline_outcome_advantage(r, mask, index),
    "remax": lambda r, mask, a, baselines=None, **_: compute_remax_outcome_advantage(r, baselines, mask),
    "gpg": lambda r, mask, a, index=None, **_: compute_gpg_outcome_advantage(r, mask, index),
    "opo": lambda r, mask, a, index=None, **_: compute_opo_outcome_advantage(r, mask, index),
    "grpo_passk": lambda r, mask, a, index=None, **_: compute_grpo_passk_outcome_advantage(
        r, mask, index, norm_by_std=a.norm_adv_by_std_in_grpo),
    # on-policy distillation alone: no reward term; add_distillation_term gives every token its advantage
    "opd": lambda r, mask, a, **_: (torch.zeros_like(r), torch.zeros_like(r)),
}


# the estimators whose advantages depend on each row's own tokens (a critic's values, discounted returns, ReMax's
# reward-to-go); the others give every response one advantage from its group (ppo/segments.py relies on it)
TOKEN_LEVEL_ESTIMATORS = ("gae", "reinforce_plus_plus", "remax", "opd")


def add_distillation_term(advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                          response_mask: torch.Tensor, coef: float) -> torch.Tensor:
    """On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025; slime's form beside a reward):
    A_t - coef * (log pi_student(y_t) - log pi_teacher(y_t)) on each trained token. y_t ~ pi_student, so at each
    prefix E[log pi_student(y) - log pi_teacher(y)] is the reverse KL(pi_student || pi_teacher): the policy
    gradient of this advantage descends it. Per token: no discount, no whitening (a teacher equal to the student
    gives exactly 0)."""
    return advantages - coef * (student_log_probs - teacher_log_probs) * response_mask


def algorithm_name(adv_estimator: str) -> str:
    """What a run is called in logs: PPO (GAE with a critic), GRPO, RLOO, REINFORCE++, ..."""
    return {"gae": "PPO", "reinforce_plus_plus": "REINFORCE++", "reinforce_plus_plus_baseline": "REINFORCE++-baseline",
            "remax": "ReMax", "grpo_passk": "GRPO-pass@k", "opd": "OPD"}.get(adv_estimator, adv_estimator.upper())


def compute_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, algorithm,
                       values: torch.Tensor | None = None, index: Any = None,
                       baselines: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) with the estimator `algorithm.adv_estimator` names (see ADV_ESTIMATORS)."""
    name = algorithm.adv_estimator
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown algorithm.adv_estimator {name!r}; choose one of {', '.join(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name](token_level_rewards, response_mask, algorithm, values=values, index=index,
                                baselines=baselines)


# ----------------------------------------------------------------------------- DAPO dynamic sampling
def groups_with_varied_scores(uids, seq_scores) -> tuple[list, list]:
    """The prompt uids (in order of first appearance) whose responses' scores differ, and those whose
    scores are all equal (a group estimator gives them zero advantage)."""
    by_uid: dict = {}
    for u, s in zip(uids, seq_scores.tolist() if torch.is_tensor(seq_scores) else seq_scores):
        by_uid.setdefault(u, []).append(s)
    varied = [u for u, s in by_uid.items() if max(s) != min(s)]
    return varied, [u for u in by_uid if u not in set(varied)]


def groups_to_keep(uids, acc, score, metric: str = "acc") -> tuple[list, list]:
    """DAPO's dynamic sampling (Yu et al. 2025, eq. 11: keep a prompt when 0 < |{o_i correct}| < G): the
    prompt uids whose responses differ in `metric`, and those whose responses do not.
    acc: each response's correctness by the rule, before any shaping (the paper; verl's DAPO recipe);
    score: the shaped scalar reward (overlong and non-stop penalties included)."""
    if metric not in FILTER_GROUPS_METRICS:
        raise ValueError(f"algorithm.filter_groups.metric={metric!r} is not supported; choose one of: "
                         f"{', '.join(FILTER_GROUPS_METRICS)}")
    values = acc if metric == "acc" else score
    return groups_with_varied_scores(uids, [float(v) for v in values])


# ----------------------------------------------------------------------------- KL
def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from samples of pi (Schulman's k1/k2/k3).

    k1 = logp - ref;  k2 = 0.5 * (logp - ref)^2;  k3 = exp(ref - logp) - (ref - logp) - 1
    (k3 is clamped at 10 for stability; it is always >= 0); abs = |logp - ref|. verl's names are
    aliases: kl = k1, mse = k2, low_var_kl = k3."""
    kind = KL_ALIASES.get(kind, kind)
    log_ratio = logprob - ref_logprob
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        r = -log_ratio
        return (torch.exp(r) - r - 1).clamp(max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")


class FixedKLController:
    """beta stays at kl_coef."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(float(current_kl) / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


def make_kl_controller(cfg: Any) -> FixedKLController | AdaptiveKLController:
    """From `algorithm.kl_ctrl` (or the whole `algorithm` section): type fixed | adaptive."""
    cfg = getattr(cfg, "kl_ctrl", cfg)
    kind = getattr(cfg, "type", "fixed")
    if kind == "fixed":
        return FixedKLController(cfg.kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {kind!r}; choose fixed or adaptive")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: r_t = score_t - beta * kl_t, then kl_ctrl.update(per-token KL, B).

    The adaptive controller sees the PER-TOKEN KL (each response's token mean, averaged over the
    batch: verl's convention, which its default target_kl=0.1 is meant for), so its behaviour does not
    depend on the response length. Metrics (open-instruct names): objective/kl = mean over sequences of
    the summed token KL, objective/kl_token_mean = what the controller saw, objective/kl_coef = the beta
    used, objective/non_score_reward = mean summed -beta * kl, objective/rlhf_reward = mean summed
    reward (scores + non_score_reward)."""
    mask = response_mask.to(token_level_scores.dtype)
    kl = kl_penalty(logprob, ref_logprob, kind) * mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kl
    seq_kl = kl.sum(dim=-1)
    token_kl = masked_mean(kl, mask, dim=-1).mean().item()
    kl_ctrl.update(token_kl, n_steps=token_level_scores.shape[0])
    metrics = {
        "objective/kl": seq_kl.mean().item(),
        "objective/kl_token_mean": token_kl,
        "objective/kl_coef": beta,
        "objective/non_score_reward": (-beta * seq_kl).mean().item(),
        "objective/rlhf_reward": token_level_rewards.sum(dim=-1).mean().item(),
    }
    return token_level_rewards, metrics

