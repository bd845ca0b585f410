"""The actor's and the critic's PPO losses, as the workers apply them. Pure torch: never imports Ray or Megatron.

First the per-token math (the aggregation modes, the clipped surrogate and its decoupled form, truncated
importance weights, the value and entropy losses, the trainer/sampler log-prob gap), then the loss objects
built on it, `PolicyLoss` and `ValueLoss`. Each loss takes a `normalizer` (the global token / sequence count
of the whole mini-batch, see `loss_normalizer`) so that micro-batch losses sum to the mini-batch loss for
any split.

The driver builds them from the config and hands them to the update calls
(`actor_wg.update_actor(batch, PolicyLoss.from_config(cfg.actor))`); a worker only does the
plumbing every loss shares (mini-batches, the global normaliser, micro-batches, the optimizer step):

    norm, n_tokens = all-reduce over DP of (loss.normalizer(mask), mask.sum())   # once per mini-batch
    loss_sum, metrics = loss(outputs, micro_batch, norm, n_tokens, first)       # per micro-batch

(`first`: this is the update's first optimizer step, the weights still those before it.)

`outputs` is what the engine computed for the micro-batch (`logprobs`, `entropy` for an LM head;
`values` for a value head). `loss_sum` is a SUM over the micro-batch (`normalizer=1.0` in the
functions above); the engine divides it by `norm`, so the micro-batches add up to the mini-batch loss.
Metrics are summed over micro-batches and DP ranks: a per-token mean is scaled by this micro-batch's
share of the mini-batch's tokens, a loss is divided by the normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megappo.config.schema import CHOICES, recomputes_old_log_probs
from megappo.ppo.core_algos import kl_penalty, masked_mean, masked_sum
from megappo.ppo.staleness import loglinear_proximal

LOSS_AGG_MODES = CHOICES["actor.loss_agg_mode"]


# ----------------------------------------------------------------------------- loss aggregation
def loss_normalizer(response_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """The count a mini-batch loss is divided by: tokens (token-mean) or sequences with >= 1 token.

    Compute it once over the whole mini-batch (all-reduced over DP) and pass it to every micro-batch."""
    if loss_agg_mode == "token-mean":
        return float(response_mask.sum().item())
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float((response_mask.sum(dim=-1) > 0).sum().item())
    if loss_agg_mode == "seq-mean-token-sum-norm":  # Dr. GRPO: a constant length, the max response length
        return float((response_mask.sum(dim=-1) > 0).sum().item() * response_mask.shape[-1])
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    token-mean:              sum_{i,t} l_it / N_tokens
    seq-mean-token-sum:      sum_i (sum_t l_it) / N_seqs
    seq-mean-token-mean:     sum_i (mean_t l_it) / N_seqs
    seq-mean-token-sum-norm: sum_i (sum_t l_it) / (N_seqs * T), T = the max response length (Dr. GRPO,
                             Liu et al. 2025: no per-response length normalisation; verl's mode of this
                             name divides by T only, a per-batch sum)
    N_* defaults to this batch's count (`loss_normalizer`); pass the mini-batch's global count as
    `normalizer` and the micro-batch losses sum to exactly the mini-batch loss. (With DDP gradient
    averaging over dp ranks, the caller multiplies by dp_size.)"""
    if normalizer is None:
        normalizer = loss_normalizer(loss_mask, loss_agg_mode)
    normalizer = max(float(normalizer), 1e-8)
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, mask) / normalizer
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return masked_sum(loss_mat, mask, dim=-1).sum() / normalizer
    if loss_agg_mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, mask, dim=-1).sum() / normalizer
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")


# ----------------------------------------------------------------------------- losses
def logprob_parity(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """The trainer/sampler gap on the sampled tokens, float64 tensors: rollout/logprob_diff_mean and _max
    (|log p - log p_rollout|) and rollout/token_mult_prob_error (mean of its exp: 1.0 = identical).
    Padding is zeroed before the exp (its log-probs may be anything)."""
    gap = (log_prob.detach().double() - rollout_log_prob.double()).abs().where(response_mask.bool(), 0.0)
    return {"rollout/logprob_diff_mean": masked_mean(gap, response_mask), "rollout/logprob_diff_max": gap.max(),
            "rollout/token_mult_prob_error": masked_mean(torch.exp(gap), response_mask)}


def compute_importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (TIS) for off-policy / mismatched rollouts.

    w_t = min(exp(old_logp_t - rollout_logp_t), cap): corrects for responses sampled by a policy
    (vLLM, or one step stale in async mode) other than the one the loss treats as pi_old.
    Detached, 0 on padding. Metrics: mean weight and fraction of tokens capped."""
    mask = response_mask.to(old_log_prob.dtype)
    ratio = torch.exp((old_log_prob - rollout_log_prob).clamp(-20.0, 20.0)).detach()
    weights = ratio.clamp(max=cap) * mask
    metrics = {
        "rollout/tis_weight_mean": masked_mean(weights, mask).item(),
        "rollout/tis_capped_frac": masked_mean((ratio > cap).to(mask.dtype), mask).item(),
    }
    return weights, metrics


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | None = None,
    importance_weights: torch.Tensor | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate (Schulman et al. 2017) with optional dual clip (Ye et al. 2020) and DAPO's
    decoupled clip range (Yu et al. 2025, clip-higher: eps_low / eps_high, each defaulting to clip_ratio).

        ratio = exp(logp - old_logp)
        l     = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
        dual clip, A < 0:  l = min(l, -A * clip_ratio_c)
    `importance_weights` (e.g. TIS from `compute_importance_weights`) multiply l per token.
    Returns (loss, clipfrac, approx_kl, dual_clipfrac). approx_kl = masked mean of
    0.5 * (logp - old_logp)^2 (open-instruct's approxkl); the fractions and approx_kl are
    diagnostics averaged over this batch's tokens, not scaled by `normalizer`."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    eps_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    eps_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clipped_losses = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = masked_mean((pg_losses2 > pg_losses1).to(mask.dtype), mask)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c must be > 1 (got {clip_ratio_c}); use null to disable dual clip")
        pg_losses3 = -advantages * clip_ratio_c
        dual_clipped = torch.minimum(clipped_losses, pg_losses3)
        negative = advantages < 0
        pg_losses = torch.where(negative, dual_clipped, clipped_losses)
        dual_clipfrac = masked_mean(((clipped_losses > pg_losses3) & negative).to(mask.dtype), mask)
    else:
        pg_losses = clipped_losses
        dual_clipfrac = torch.zeros((), dtype=mask.dtype)
    if importance_weights is not None:
        pg_losses = pg_losses * importance_weights
    loss = agg_loss(pg_losses, mask, loss_agg_mode, normalizer)
    approx_kl = masked_mean(0.5 * log_ratio.detach() ** 2, mask)
    return loss, clipfrac.detach(), approx_kl, dual_clipfrac.detach()


def compute_decoupled_policy_loss(
    proximal_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    behav_imp_weight_cap: float | None = None,
    **ppo: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"; AReaL, Fu et al. 2025):
    the policy that sampled a token (behaviour, pi_behav: `rollout_log_probs`, of whatever version generated
    that token) is kept apart from the policy the update is clipped around (proximal, pi_prox:
    `old_log_probs`, the trainer's forward over the batch just before this update). Per token t:

        r_t = pi_theta / pi_prox                            (the PPO ratio, clipped as in compute_policy_loss)
        w_t = min(pi_prox / pi_behav, behav_imp_weight_cap) (the behaviour weight; cap None = not truncated)
        l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))   (dual clip as compute_policy_loss)

    w_t is detached: gradients flow through pi_theta only. With pi_behav == pi_prox, w_t = 1 and this is
    plain PPO. A sample generated across weight updates (fully async) has a different pi_behav per token, so
    w_t is per token. `ppo` are compute_policy_loss's keyword arguments (clip ranges, agg mode, normalizer).
    Returns compute_policy_loss's four values plus metrics: behav_weight_mean, behav_capped_frac."""
    mask = response_mask.to(log_prob.dtype)
    proximal_log_prob, behaviour_log_prob = proximal_log_prob.detach(), behaviour_log_prob.detach()
    ratio = torch.exp((proximal_log_prob - behaviour_log_prob).clamp(-20.0, 20.0))
    weight = ratio if behav_imp_weight_cap is None else ratio.clamp(max=behav_imp_weight_cap)
    capped = torch.zeros_like(ratio) if behav_imp_weight_cap is None else (ratio > behav_imp_weight_cap).to(mask.dtype)
    out = compute_policy_loss(proximal_log_prob, log_prob, advantages, response_mask,
                              importance_weights=weight * mask, **ppo)
    metrics = {"behav_weight_mean": masked_mean(weight, mask), "behav_capped_frac": masked_mean(capped, mask)}
    return (*out, metrics)


def clip_higher_kept_frac(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                          response_mask: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """What DAPO's clip-higher changed: the fraction of tokens that symmetric clipping, [1 - eps_low,
    1 + eps_low], would clip but [1 - eps_low, 1 + eps_high] keeps in the gradient (A > 0 and
    1 + eps_low < ratio <= 1 + eps_high): compute_policy_loss's clipfrac at eps_high = eps_low minus at eps_high."""
    mask = response_mask.to(log_prob.dtype)
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0)).detach()
    kept = (advantages > 0) & (ratio > 1.0 + eps_low) & (ratio <= 1.0 + eps_high)
    return masked_mean(kept.to(mask.dtype), mask)


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2).

    Returns (loss, clipfrac = fraction of tokens where the clipped term is larger)."""
    mask = response_mask.to(vpreds.dtype)
    vpred_clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), mask, loss_agg_mode, normalizer)
    clipfrac = masked_mean((vf_losses2 > vf_losses1).to(mask.dtype), mask)
    return loss, clipfrac.detach()


def compute_entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    normalizer: float | None = None,
) -> torch.Tensor:
    """Aggregated per-token entropy (the actor subtracts entropy_coeff * this from its loss)."""
    return agg_loss(entropy, response_mask, loss_agg_mode, normalizer)


@dataclass(frozen=True)
class PolicyLoss:
    """Clipped surrogate (+ dual clip), truncated IS when `rollout_log_probs` are in the batch,
    optional entropy bonus and KL-to-reference loss (actor.* keys of the config).
    policy_loss=decoupled: decoupled PPO (core_compute_decoupled_policy_loss), clipped around
    `old_log_probs` (proximal) and weighted by old / rollout (behaviour) truncated at behav_imp_weight_cap."""

    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # DAPO clip-higher: [1 - low, 1 + high]; None = clip_ratio
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: Optional[float] = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    policy_loss: str = "ppo"  # ppo | decoupled (CHOICES["actor.policy_loss"])
    behav_imp_weight_cap: Optional[float] = None
    proximal: str = "recompute"  # decoupled's pi_prox: recompute (old_log_probs) | loglinear (A-3PO, `prox_alpha`)
    # no pi_old forward before the update (recomputes_old_log_probs is false): the update's first optimizer
    # step measures the sampler/trainer gap on its mini-batch instead (rollout/logprob_diff_mean)
    parity_in_update: bool = False
    name: str = "actor"  # metric prefix

    recomputes_old_log_probs = staticmethod(recomputes_old_log_probs)

    @classmethod
    def from_config(cls, actor) -> "PolicyLoss":
        return cls(parity_in_update=not cls.recomputes_old_log_probs(actor),
                   clip_ratio=actor.clip_ratio, clip_ratio_low=actor.clip_ratio_low,
                   clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c, loss_agg_mode=actor.loss_agg_mode,
                   entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss,
                   kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type,
                   policy_loss=actor.policy_loss, behav_imp_weight_cap=actor.behav_imp_weight_cap,
                   proximal=actor.proximal)

    @property
    def required_keys(self) -> list[str]:
        return (["old_log_probs", "advantages", "response_mask"] + (["ref_log_prob"] if self.use_kl_loss else [])
                + (["rollout_log_probs"] if self.policy_loss == "decoupled" else [])
                + (["prox_alpha"] if self.policy_loss == "decoupled" and self.proximal == "loglinear" else []))

    optional_keys = ("rollout_log_probs",)

    @property
    def needs_entropy(self) -> bool:
        """The update's forward computes the entropy only for an entropy bonus (a pass over the vocab)."""
        return bool(self.entropy_coeff)

    def normalizer(self, response_mask: torch.Tensor) -> float:
        return loss_normalizer(response_mask, self.loss_agg_mode)

    def __call__(self, outs: dict, mb: dict, norm: float, n_tokens: float,
                 first: bool = False) -> tuple[torch.Tensor, dict]:
        mask = mb["response_mask"]
        ppo = dict(clip_ratio=self.clip_ratio, clip_ratio_c=self.clip_ratio_c, loss_agg_mode=self.loss_agg_mode,
                   normalizer=1.0, clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high)
        behav = {}
        prox = mb["old_log_probs"]  # what the ratio is clipped around (the metrics below read it too)
        if self.policy_loss == "decoupled" and self.proximal == "loglinear":  # A-3PO: interpolated, no forward
            prox = loglinear_proximal(mb["rollout_log_probs"], outs["logprobs"], mb["prox_alpha"])
        if self.policy_loss == "decoupled":
            pg, clipfrac, approx_kl, dual, behav = compute_decoupled_policy_loss(
                prox, mb["rollout_log_probs"], outs["logprobs"], mb["advantages"], mask,
                self.behav_imp_weight_cap, **ppo)
        else:
            weights = None
            if "rollout_log_probs" in mb:
                weights, _ = compute_importance_weights(mb["old_log_probs"], mb["rollout_log_probs"], mask)
            pg, clipfrac, approx_kl, dual = compute_policy_loss(
                mb["old_log_probs"], outs["logprobs"], mb["advantages"], mask, importance_weights=weights, **ppo)
        loss = pg
        share = float(mask.sum()) / max(n_tokens, 1.0)  # token-weighted means sum to the mini-batch mean
        p = self.name
        # ppo_kl: k1 = mean(log pi_old - log pi) (verl's actor/ppo_kl); approx_kl: k2 = mean 0.5 (log ratio)^2
        # (open-instruct's policy/approxkl_avg)
        ppo_kl = masked_mean((prox - outs["logprobs"]).detach(), mask)
        metrics = {f"{p}/pg_loss": pg.detach() / norm, f"{p}/pg_clipfrac": clipfrac * share,
                   f"{p}/ppo_kl": ppo_kl * share, f"{p}/approx_kl": approx_kl.detach() * share,
                   f"{p}/pg_clipfrac_lower": dual * share}
        metrics.update({f"{p}/{k}": v * share for k, v in behav.items()})
        # weights as sampled in sync mode; async modes add the batch's policy lag, as the recomputed gap does
        if first and self.parity_in_update and "rollout_log_probs" in mb:  # means only: metrics are summed
            parity = logprob_parity(outs["logprobs"], mb["rollout_log_probs"], mask)
            metrics.update({k: v * share for k, v in parity.items() if not k.endswith("_max")})
        eps_low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        if self.clip_ratio_high is not None and self.clip_ratio_high > eps_low:  # clip-higher: what it let through
            metrics[f"{p}/clip_higher_kept_frac"] = share * clip_higher_kept_frac(
                prox, outs["logprobs"], mb["advantages"], mask, eps_low, self.clip_ratio_high)
        if self.entropy_coeff:
            ent = compute_entropy_loss(outs["entropy"], mask, self.loss_agg_mode, normalizer=1.0)
            loss = loss - self.entropy_coeff * ent
            metrics[f"{p}/entropy"] = ent.detach() / norm
        if self.use_kl_loss:
            kl = agg_loss(kl_penalty(outs["logprobs"], mb["ref_log_prob"], self.kl_loss_type),
                          mask, self.loss_agg_mode, normalizer=1.0)
            loss = loss + self.kl_loss_coef * kl
            metrics[f"{p}/kl_loss"] = kl.detach() / norm
        return loss, metrics


@dataclass(frozen=True)
class ValueLoss:
    """Clipped value loss, token-mean (critic.* keys of the config)."""

    cliprange_value: float = 0.2
    name: str = "critic"  # metric prefix

    @classmethod
    def from_config(cls, critic) -> "ValueLoss":
        return cls(cliprange_value=critic.cliprange_value)

    required_keys = ("values", "returns", "response_mask")
    optional_keys = ()
    needs_entropy = False

    def normalizer(self, response_mask: torch.Tensor) -> float:
        return loss_normalizer(response_mask, "token-mean")

    def __call__(self, outs: dict, mb: dict, norm: float, n_tokens: float,
                 first: bool = False) -> tuple[torch.Tensor, dict]:
        mask = mb["response_mask"]
        loss, clipfrac = compute_value_loss(outs["values"], mb["values"], mb["returns"], mask,
                                            self.cliprange_value, "token-mean", normalizer=1.0)
        share = float(mask.sum()) / max(n_tokens, 1.0)
        return loss, {f"{self.name}/vf_loss": loss.detach() / norm, f"{self.name}/vf_clipfrac": clipfrac * share}
