"""The guard on the sampler/trainer gap: no run trains on a rollout that is not the policy it trains.

In sync mode vLLM samples from the very weights Megatron trains, so the two engines' log-probs of the sampled
tokens differ by rounding alone (rollout/logprob_diff_mean: ~1e-6 in fp32, ~1e-2 in bf16). A wrong rotary
embedding, a router scoring with softmax where the model uses sigmoid, weights that never reached vLLM: each
leaves the weight fingerprint intact or unseen and shows only as a gap orders of magnitude past rounding, in a
metric nobody reads while the run trains on. The guard reads it on the run's first steps (and every
`trainer.rollout_check_every` steps after) and stops the run in one line when it is past the bound for the
dtypes in use (`trainer.rollout_check: warn` trains on, warning every step it is past; `never`: no check).

The gap is measured over the samples the current weights sampled whole: every sample in sync mode; in the async
modes those of the trainer's own version (one-step async: its first step only; fully_async: the samples begun and
finished since the last weight load), so the policy lag the losses correct for never counts as a mismatch. With a pi_old
forward it is read before any update trains on the batch; without one (actor.use_rollout_log_probs,
actor.proximal=loglinear) from the update's first mini-batch, after that step's update.

The bounds (docs/training.md, measured by bench/rollout_gap.py on the shipped tiny, MoE and SmolLM2 recipes, with a
margin over the largest step seen): `BOUNDS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

# mean |log p_vLLM - log p_Megatron| over a step's sampled tokens past which the sampler is not the policy, by the
# lower precision of the trainer and the rollout (bench/rollout_gap.py; docs/training.md "The rollout guard")
BOUNDS = {"fp32": 1e-3, "bf16": 0.25}
METRIC = "rollout/logprob_diff_mean"
LIKELY_CAUSES = ("the weights did not reach vLLM (rollout/weights_fingerprint_ok)",
                 "a layer vLLM computes otherwise than Megatron (RoPE and its scaling, the MoE router's score "
                 "function or dtype, an attention kernel)",
                 "a model config the converter or vLLM's loader reads otherwise (rope_scaling, topk_method, "
                 "tie_word_embeddings)")


class RolloutGapError(RuntimeError):
    """The run's rollout is not the policy it trains (one line: the metric, its value, the bound, the causes)."""


def run_dtype(model_dtype: str, on_gpu: bool) -> str:
    """The dtype the trainer and vLLM compute in: model.dtype, auto = bf16 on GPU, fp32 on CPU."""
    return model_dtype if model_dtype != "auto" else ("bf16" if on_gpu else "fp32")


def on_policy_gap(batch, version: int) -> Optional[float]:
    """rollout/logprob_diff_mean over the samples `version` sampled whole (the trainer's weights before this step's
    update), from pi_old and the sampler's log-probs; None without a pi_old forward or such samples. A sample begun
    under older weights is left out entirely, its later tokens too: they were sampled under the old weights' KV
    cache (fully_async's pause_mode=keep), so they rightly differ from a pi_old recomputed under the new weights."""
    b = batch.batch
    if "old_log_probs" not in b or "rollout_log_probs" not in b:
        return None
    mask = _sampled_whole(batch, version)
    if not mask.any():
        return None
    gap = (b["old_log_probs"].double() - b["rollout_log_probs"].double()).abs()
    return float(gap[mask].mean())


@dataclass
class RolloutGuard:
    action: str  # stop | warn | never (trainer.rollout_check)
    bound: float
    dtype: str
    first_steps: int  # checked steps at the start of each fit (a resume and a restart check again)
    every: int  # then every `every` steps (0: never again)
    steps_checked: list = field(default_factory=list)  # (no metric: a resumed run logs what the uninterrupted one did)

    @classmethod
    def from_config(cls, cfg, on_gpu: bool) -> "RolloutGuard":
        t = cfg.trainer
        dtype = run_dtype(cfg.model.dtype, on_gpu)
        bound = t.rollout_logprob_bound if t.rollout_logprob_bound is not None else BOUNDS[dtype]
        return cls(t.rollout_check, float(bound), dtype, int(t.rollout_check_steps), int(t.rollout_check_every))

    def due(self, step: int) -> bool:
        if self.action == "never":
            return False
        return self.action == "warn" or len(self.steps_checked) < self.first_steps or \
            bool(self.every and step % self.every == 0)

    def check(self, step: int, gap: Optional[float], where: str = "pi_old") -> dict:
        """Stop (or warn) when `gap` is past the bound; warn: {"rollout/gap_past_bound": 1.0} for a step past it."""
        if gap is None or not self.due(step):
            return {}
        self.steps_checked.append(step)
        if gap <= self.bound:
            return {}
        line = (f"step {step}: {METRIC}={gap:.4g} ({where} vs the sampler, tokens of the current weights) is past "
                f"the bound {self.bound:g} for {self.dtype}: the rollout is not sampling from the policy being "
                f"trained. Likely causes: {'; '.join(LIKELY_CAUSES)}. trainer.rollout_check=warn trains on anyway; "
                "trainer.rollout_logprob_bound sets the bound")
        if self.action == "stop":
            raise RolloutGapError(line)
        print(f"megappo: WARNING {line}", flush=True)
        return {"rollout/gap_past_bound": 1.0}


def _sampled_whole(batch, version: int) -> torch.Tensor:
    """The response tokens of the samples `version` sampled whole (every one of their tokens at that version)."""
    from megappo.ppo.staleness import batch_token_versions

    response = batch.batch["response_mask"].bool()
    whole = ((batch_token_versions(batch, version) == version) | ~response).all(-1, keepdim=True)
    return response & whole


def update_gap(batch, version: int, actor_metrics: dict) -> Optional[float]:
    """The gap the update measured on its first mini-batch (no pi_old forward: losses.PolicyLoss.parity_in_update),
    when `version` sampled the whole batch (its mini-batch is the update's, whatever samples it holds); else None."""
    value = actor_metrics.get(METRIC)
    if value is None or not bool((_sampled_whole(batch, version) == batch.batch["response_mask"].bool()).all()):
        return None
    return float(torch.as_tensor(value))
