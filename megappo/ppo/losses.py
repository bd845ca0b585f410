"""The actor's and the critic's PPO losses, as the workers apply them. Pure torch (core_algos).

The driver builds them from the config and hands them to the update calls
(`actor_wg.update_actor(batch, PolicyLoss.from_config(cfg.actor))`); a worker only does the
plumbing every loss shares (mini-batches, the global normaliser, micro-batches, the optimizer step):

    norm, n_tokens = all-reduce over DP of (loss.normalizer(mask), mask.sum())   # once per mini-batch
    loss_sum, metrics = loss(outputs, micro_batch, norm, n_tokens, first)       # per micro-batch

(`first`: this is the update's first optimizer step, the weights still those before it.)

`outputs` is what the engine computed for the micro-batch (`logprobs`, `entropy` for an LM head;
`values` for a value head). `loss_sum` is a SUM over the micro-batch (`normalizer=1.0` in
core_algos); the engine divides it by `norm`, so the micro-batches add up to the mini-batch loss.
Metrics are summed over micro-batches and DP ranks: a per-token mean is scaled by this micro-batch's
share of the mini-batch's tokens, a loss is divided by the normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megappo.ppo import core_algos as algos
from megappo.ppo.staleness import loglinear_proximal


@dataclass(frozen=True)
class PolicyLoss:
    """Clipped surrogate (+ dual clip), truncated IS when `rollout_log_probs` are in the batch,
    optional entropy bonus and KL-to-reference loss (actor.* keys of the config).
    policy_loss=decoupled: decoupled PPO (core_algos.compute_decoupled_policy_loss), clipped around
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

    @staticmethod
    def recomputes_old_log_probs(actor) -> bool:
        """Whether the driver runs a pi_old forward before the update: not with actor.use_rollout_log_probs,
        nor with A-3PO's interpolated proximal (actor.proximal=loglinear); then pi_old is the sampler's."""
        return not (actor.use_rollout_log_probs or actor.proximal == "loglinear")

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
        return algos.loss_normalizer(response_mask, self.loss_agg_mode)

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
            pg, clipfrac, approx_kl, dual, behav = algos.compute_decoupled_policy_loss(
                prox, mb["rollout_log_probs"], outs["logprobs"], mb["advantages"], mask,
                self.behav_imp_weight_cap, **ppo)
        else:
            weights = None
            if "rollout_log_probs" in mb:
                weights, _ = algos.compute_importance_weights(mb["old_log_probs"], mb["rollout_log_probs"], mask)
            pg, clipfrac, approx_kl, dual = algos.compute_policy_loss(
                mb["old_log_probs"], outs["logprobs"], mb["advantages"], mask, importance_weights=weights, **ppo)
        loss = pg
        share = float(mask.sum()) / max(n_tokens, 1.0)  # token-weighted means sum to the mini-batch mean
        p = self.name
        # ppo_kl: k1 = mean(log pi_old - log pi) (verl's actor/ppo_kl); approx_kl: k2 = mean 0.5 (log ratio)^2
        # (open-instruct's policy/approxkl_avg)
        ppo_kl = algos.masked_mean((prox - outs["logprobs"]).detach(), mask)
        metrics = {f"{p}/pg_loss": pg.detach() / norm, f"{p}/pg_clipfrac": clipfrac * share,
                   f"{p}/ppo_kl": ppo_kl * share, f"{p}/approx_kl": approx_kl.detach() * share,
                   f"{p}/pg_clipfrac_lower": dual * share}
        metrics.update({f"{p}/{k}": v * share for k, v in behav.items()})
        # weights as sampled in sync mode; async modes add the batch's policy lag, as the recomputed gap does
        if first and self.parity_in_update and "rollout_log_probs" in mb:  # means only: metrics are summed
            parity = algos.logprob_parity(outs["logprobs"], mb["rollout_log_probs"], mask)
            metrics.update({k: v * share for k, v in parity.items() if not k.endswith("_max")})
        eps_low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        if self.clip_ratio_high is not None and self.clip_ratio_high > eps_low:  # clip-higher: what it let through
            metrics[f"{p}/clip_higher_kept_frac"] = share * algos.clip_higher_kept_frac(
                prox, outs["logprobs"], mb["advantages"], mask, eps_low, self.clip_ratio_high)
        if self.entropy_coeff:
            ent = algos.compute_entropy_loss(outs["entropy"], mask, self.loss_agg_mode, normalizer=1.0)
            loss = loss - self.entropy_coeff * ent
            metrics[f"{p}/entropy"] = ent.detach() / norm
        if self.use_kl_loss:
            kl = algos.agg_loss(algos.kl_penalty(outs["logprobs"], mb["ref_log_prob"], self.kl_loss_type),
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
        return algos.loss_normalizer(response_mask, "token-mean")

    def __call__(self, outs: dict, mb: dict, norm: float, n_tokens: float,
                 first: bool = False) -> tuple[torch.Tensor, dict]:
        mask = mb["response_mask"]
        loss, clipfrac = algos.compute_value_loss(outs["values"], mb["values"], mb["returns"], mask,
                                                  self.cliprange_value, "token-mean", normalizer=1.0)
        share = float(mask.sum()) / max(n_tokens, 1.0)
        return loss, {f"{self.name}/vf_loss": loss.detach() / norm, f"{self.name}/vf_clipfrac": clipfrac * share}
