"""A rewritten history trained as its own rows: how a session's later segments ride through a PPO step.

Your own agent (rollout.agent, gateway/agents.py) may send a request that does not extend its conversation
(it rewrote history, dropped old thinking, changed its tools): the gateway starts a new **segment**, a
sequence of its own. The rollout gives every segment after a sample's first its own row, after the
samples' rows, with `agent_segment` (its position in the session: 0 for the first) and non_tensor
`agent_session` (the sample it belongs to). A step with such rows treats them this way:

- **rewards**: the rule / reward model / agent scores each *sample* once (its first row, which carries the
  session's turns); a later row gets its session's score at its own last model token, so every segment
  ends in the session's outcome (the reward metrics count samples, not rows).
- **advantages**: an outcome estimator (GRPO, RLOO, ...) computes each group's statistics over the samples
  (one row each; with the KL penalty in the reward, each later row's penalty is added to its sample's), and
  every later segment gets its sample's advantage; a token-level one (GAE, REINFORCE++, ReMax's
  reward-to-go) runs on every row as a sequence of its own (core_algos.TOKEN_LEVEL_ESTIMATORS).
- **updates**: the optimizer steps per update stay sequences / ppo_mini_batch_size (the LR schedule counts
  them). A later row joins its sample's mini-batch on its sample's DP rank; every rank's share of every
  mini-batch is filled up to the same row count with masked copies (response_mask 0: no loss, no
  normaliser count; their tokens are computed, and counted in tokens/*), so the workers cut equal
  mini-batches (meta_info["mini_batch_rows"]). With a token budget, workers/packing.balance_across_dp then
  deals each mini-batch's rows over the ranks by length (the mini-batch keeps its rows, a row may change rank).

`Segments.of(batch)` is None for a batch without later rows: every step without them runs as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch

from megappo.rewards.manager import last_model_token


@dataclass(frozen=True)
class Segments:
    primary: list  # the rows that are a sample's first segment, in batch order
    owner: list  # every row -> the row of its sample's first segment

    @classmethod
    def of(cls, batch) -> Optional["Segments"]:
        """The batch's later-segment rows and their samples, or None when it has none."""
        seg = batch.batch.get("agent_segment")
        if seg is None or not bool((seg > 0).any()):
            return None
        sessions = [str(s) for s in batch.non_tensor_batch["agent_session"]]
        first = {s: i for i, (s, k) in enumerate(zip(sessions, seg.tolist())) if k == 0}
        missing = sorted({s for s in sessions if s not in first})
        if missing:
            raise ValueError(f"later segments without their sample's first row (sessions {missing[:3]}): a batch "
                             "must keep a sample's rows together")
        return cls([i for i, k in enumerate(seg.tolist()) if k == 0], [first[s] for s in sessions])

    @property
    def later(self) -> int:
        return len(self.owner) - len(self.primary)

    @cached_property
    def _position(self) -> dict:
        """A sample's first row -> its position among the samples' rows."""
        return {row: k for k, row in enumerate(self.primary)}

    def scores(self, primary_scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """[B, R] token-level scores: the samples' rows as scored, a later row its sample's summed score at its
        own last model token."""
        out = torch.zeros(response_mask.shape, dtype=primary_scores.dtype)
        out[self.primary] = primary_scores
        total, last = out.sum(-1), last_model_token(response_mask).tolist()
        for i, j in enumerate(self.owner):
            if i != j and last[i] >= 0:
                out[i, last[i]] = total[j]
        return out

    def sample_rewards(self, rewards: torch.Tensor, scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """[P, R]: the samples' rows' token rewards, each plus what its later rows add to their copy of the
        sample's score (the KL penalty in the reward, algorithm.use_kl_in_reward), at the sample row's last
        model token: an outcome estimator then sees every segment's penalty once."""
        out = rewards[self.primary].clone()
        extra, last = (rewards - scores).sum(-1), last_model_token(response_mask).tolist()
        for i, j in enumerate(self.owner):
            if i != j and last[j] >= 0:
                out[self._position[j], last[j]] += extra[i]
        return out

    def spread(self, primary_advantages: torch.Tensor, primary_mask: torch.Tensor,
               response_mask: torch.Tensor) -> torch.Tensor:
        """[B, R]: an outcome estimator's advantages of the samples' rows (constant over each row's model
        tokens) given to every row of the sample, over that row's own model tokens."""
        m = primary_mask.to(primary_advantages.dtype)
        per_sample = (primary_advantages * m).sum(-1) / m.sum(-1).clamp(min=1)
        value = per_sample[[self._position[j] for j in self.owner]]
        out = value.unsqueeze(-1) * response_mask.to(value.dtype)
        out[self.primary] = primary_advantages.to(out.dtype)  # the samples' rows as the estimator gave them
        return out

    def update_order(self, mini_batch_size: int, dp: int, multiple: int = 1) -> tuple[list, int]:
        """(row order, rows per mini-batch) for an update whose rows the group cuts into `dp` contiguous
        shards, each read as consecutive mini-batches: the samples' rows keep the mini-batch and rank they
        have without later rows (workers/packing.balance_across_dp's layout), a later row joins its
        sample's, and every rank's share is filled to the same count (a multiple of `multiple`, the
        micro-batch size) with -1: a masked copy goes there."""
        n = len(self.primary)
        if n % mini_batch_size or mini_batch_size % dp:
            raise ValueError(f"{n} samples do not split into mini-batches of {mini_batch_size} over dp={dp}")
        shard, per_rank, minis = n // dp, mini_batch_size // dp, n // mini_batch_size
        place = {row: (pos // shard, (pos % shard) // per_rank) for pos, row in enumerate(self.primary)}
        cells: dict = {(d, k): [] for d in range(dp) for k in range(minis)}
        for i, j in enumerate(self.owner):
            cells[place[j]].append(i)
        rows = max(len(c) for c in cells.values())
        rows = -(-rows // multiple) * multiple
        order = [r for d in range(dp) for k in range(minis)
                 for r in cells[(d, k)] + [-1] * (rows - len(cells[(d, k)]))]
        return order, rows * dp

    def update_batch(self, data, mini_batch_size: int, dp: int, micro_batch_size: int):
        """`data` (this batch's update rows, a DataProto) in `update_order`, each -1 a copy of the shortest
        row with response_mask 0; meta_info["mini_batch_rows"] tells the workers the mini-batch size."""
        order, rows = self.update_order(mini_batch_size, dp, micro_batch_size)
        b = data.batch
        fill = int(b["attention_mask"].sum(-1).argmin())
        pads = order.count(-1)
        if pads:
            pad = data[[fill] * pads]
            pad.batch["response_mask"] = torch.zeros_like(pad.batch["response_mask"])
            data = type(data).concat([data, pad])
        n, k = len(b["response_mask"]), iter(range(pads))
        out = data[[i if i >= 0 else n + next(k) for i in order]]
        out.meta_info["mini_batch_rows"] = rows
        return out


__all__ = ["Segments"]
