"""Staleness control for fully asynchronous training (#39): which samples may start, which form a batch,
and how stale the trained tokens were. Pure Python / torch, no Ray: the fully-async driver asks it.

Versions: the trainer's policy version v counts the optimizer updates so far (batch k is trained at
version k and makes version k + 1). A sample (one prompt's group of responses) starts at the version
current when it is admitted; with partial rollouts its tokens may be sampled by later versions too.
It is `s` versions stale if trained at version start + s.

Admission (AReaL, Fu et al. 2025): a sample may start only while

    started < (v + max_staleness + 1) * B        (B = groups per batch)

i.e. at most (max_staleness + 1) batches' worth of samples are started and not yet consumed. A sample
started at v0 must be trained by batch v0 + max_staleness (its deadline); admission keeps the
unconsumed samples schedulable earliest-deadline-first (a new one's deadline is s batches out and at
most (s + 1) B are unconsumed), and `select_batch` takes a batch early (the oldest finished samples,
while slower older ones still generate) only when what remains stays schedulable, else it waits. So
every trained sample's staleness is <= max_staleness. max_staleness=0
admits exactly one batch at a time: on-policy, the synchronous schedule. A sample over the bound anyway
(it cannot happen under this admission; counted as `over_bound` should another path produce one) is
trained, its tokens weighted by the decoupled loss's truncated behaviour weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch


@dataclass
class StalenessManager:
    """Counts of samples (groups) started, finished and consumed, and the policy version; `capacity` is how
    many more may start now. The driver calls on_start / on_finish / on_consume / on_update as they happen."""

    batch_size: int  # B: groups per trained batch
    max_staleness: int  # s: versions a trained sample may lag its start
    version: int = 0
    started: int = 0
    finished: int = 0
    consumed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_staleness < 0:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1 and max_staleness={self.max_staleness} >= 0")

    @property
    def running(self) -> int:
        return self.started - self.finished

    def capacity(self) -> int:
        """How many samples may start now (>= 0)."""
        return max((self.version + self.max_staleness + 1) * self.batch_size - self.started, 0)

    def on_start(self, n: int = 1) -> None:
        if n > self.capacity():
            raise RuntimeError(f"{n} samples started with capacity {self.capacity()} (version {self.version})")
        self.started += n

    def on_finish(self, n: int = 1) -> None:
        self.finished += n
        assert self.finished <= self.started, (self.finished, self.started)

    def on_drop(self, n: int = 1) -> None:
        """Finished samples that will never be trained (DAPO's filter): as if never started, so their places
        go to new samples and the bound on the trained ones is unchanged."""
        self.started -= n
        self.finished -= n
        assert self.consumed <= self.finished <= self.started, (self.consumed, self.finished, self.started)

    def on_consume(self, n: int) -> None:
        self.consumed += n
        assert self.consumed <= self.finished, (self.consumed, self.finished)

    def on_update(self) -> None:
        self.version += 1


def select_batch(done: dict[Hashable, int], pending: Sequence[int], version: int, batch_size: int,
                 max_staleness: int) -> Optional[list[Hashable]]:
    """The batch to train at `version`, or None to wait. `done`: finished samples (key -> start version);
    `pending`: start versions of samples still generating. Takes the oldest batch_size done samples if what
    remains can still be trained in time: each sample's deadline is start + max_staleness, and batch
    version + i trains batch_size of them, so the j-th earliest remaining deadline must be >= version +
    ceil(j / batch_size) (earliest-deadline-first feasibility). Otherwise wait for older samples to finish:
    once the oldest batch_size are done they are always feasible, since admission keeps them so."""
    if len(done) < batch_size:
        return None
    batch = sorted(done, key=lambda k: done[k])[:batch_size]
    chosen = set(batch)
    rest = sorted([v0 for k, v0 in done.items() if k not in chosen] + list(pending))
    for j, v0 in enumerate(rest, start=1):
        if v0 + max_staleness < version + -(-j // batch_size):
            return None
    return batch


def version_stats(token_versions: torch.Tensor, response_mask: torch.Tensor, version: int,
                  max_staleness: int, start_version: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Staleness of a trained batch: token_versions [N, T] = the policy version that sampled each response
    token, trained at `version`. Per token: version - its version; per sample: version - when it started, its
    oldest trained token's version or, given, its `start_version` [N] (the rollout stream's) when older (a
    request queued across an update, an agent's first turn a forced call that is not trained).
    cross_update_token_frac: the share of tokens sampled by a later version than their sample's first trained
    token (generated across an update); over_bound: samples staler than max_staleness."""
    mask = response_mask.bool()
    if not mask.any():
        return {}
    behind = (version - token_versions).to(torch.float64)
    tok = behind[mask]
    big = torch.iinfo(torch.int64).max
    first = torch.where(mask, token_versions.long(), torch.full_like(token_versions.long(), big)).min(dim=-1).values
    rows = mask.any(dim=-1)
    started = first if start_version is None else torch.minimum(first, start_version.long())
    per_sample = (version - started[rows]).to(torch.float64)
    crossed = mask & (token_versions.long() > first[:, None])
    return {"async/staleness_mean": tok.mean().item(), "async/staleness_max": tok.max().item(),
            "async/sample_staleness_mean": per_sample.mean().item(),
            "async/sample_staleness_max": per_sample.max().item(),
            "async/cross_update_token_frac": crossed.sum().item() / mask.sum().item(),
            "async/over_bound": float((per_sample > max_staleness).sum().item())}


# ---- A-3PO: the decoupled loss's proximal policy from the versions, without a forward -------------------


def batch_token_versions(batch, version: int) -> torch.Tensor:
    """The policy version that sampled each response token of a batch (a DataProto): fully_async's per-token
    record (`token_versions`), else the one version the whole batch was sampled at (meta_info
    "policy_version": a one-step async batch's launch version; none: `version`, sync); -1 past a response."""
    if "token_versions" in batch.batch:
        return batch.batch["token_versions"]
    sampled_at = batch.meta_info.get("policy_version", version)
    return torch.where(batch.batch["response_mask"].bool(), sampled_at, -1)


def loglinear_proximal_alpha(token_versions: torch.Tensor, version: int) -> torch.Tensor:
    """A-3PO (AReaL's proximal log-prob approximation): the weight alpha of log pi_theta in
    log pi_prox ~= log pi_behav + alpha (log pi_theta - log pi_behav), per token. The proximal policy is the
    trainer's weights at `version` (before this update) and pi_theta is on its way to version + 1, so a token
    sampled at v_behav sits v - v_behav of the v + 1 - v_behav versions from pi_behav to pi_theta:
    alpha = (v - v_behav) / (v + 1 - v_behav), in [0, 1) (0 on-policy, 1/2 one version behind); tokens
    without a version (-1: prompt, tool, padding) get 0."""
    v_behav = token_versions.to(torch.float32)
    alpha = (version - v_behav) / (version + 1 - v_behav)
    return torch.where(token_versions >= 0, alpha.clamp(0.0, 1.0), torch.zeros_like(alpha))


def loglinear_proximal(behaviour_log_prob: torch.Tensor, log_prob: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """log pi_prox ~= log pi_behav + alpha (log pi_theta - log pi_behav), detached (loglinear_proximal_alpha)."""
    behaviour_log_prob = behaviour_log_prob.detach()
    return (behaviour_log_prob + alpha * (log_prob.detach() - behaviour_log_prob)).detach()
