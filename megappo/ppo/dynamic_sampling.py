"""DAPO's dynamic sampling (algorithm.filter_groups): train only on prompts whose responses differ.

A group whose responses are all right or all wrong (metric=acc, the rule's correctness; =score: all got the
same shaped reward) has zero advantage under GRPO and only dilutes the batch. `filter_groups` keeps drawing
and generating prompts until `want` varied groups are in hand (at most `max_rounds` generations; then the
batch is topped up with the dropped groups) and keeps exactly `want` groups, each group's rows together.
A group is judged by its samples: a rewritten history's later rows (ppo/segments.py) are kept or dropped with
their sample, never judged as responses of their own (`judge_groups`; fully_async's filter uses it too).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from megappo.ppo.core_algos import groups_to_keep
from megappo.ppo.segments import Segments
from megappo.protocol import DataProto
from megappo.rewards.manager import RULE_SCORES


def judge_groups(part: DataProto, score_rows: Callable, metric: str) -> tuple[list, list]:
    """(varied, flat) group uids of `part` by `metric`, scoring its samples' rows only (`score_rows`:
    RewardManager.score_rows(keep=True)): a later segment's row carries its sample's uid and outcome, so it is
    neither scored (a rule runs once per sample, as in the reward phase, which scores the samples' rows) nor
    judged (its own non-stop or length penalty must not make a flat group look varied). The rule results
    kept for the reward phase go back onto `part`'s sample rows (None on later rows, which it never reads)."""
    seg = Segments.of(part)
    if seg is None:
        samples, rows = part, list(range(len(part)))
    else:
        samples, rows = part[seg.primary], seg.primary
    scored = score_rows(samples)
    if seg is not None and RULE_SCORES in samples.non_tensor_batch:
        kept = np.empty(len(part), dtype=object)
        for i, r in zip(rows, samples.non_tensor_batch[RULE_SCORES]):
            kept[i] = r
        part.non_tensor_batch[RULE_SCORES] = kept
    uids = part.non_tensor_batch["uid"]
    return groups_to_keep([uids[i] for i in rows], [s.correct for s in scored], [s.final for s in scored], metric)


def filter_groups(first: DataProto, want: int, fg, draw_more: Callable[[int], DataProto], score_rows: Callable,
                  pad_id: int) -> tuple[DataProto, dict]:
    """`first`: the step's generated batch; `draw_more(round)`: another generated batch of new prompts;
    `score_rows(batch)`: the rule's per-row results (RewardManager.score_rows(keep=True), so the reward phase
    reuses them: a rule runs once per response). Returns the kept rows and the dynamic_sampling/* counts."""
    parts, kept, flat = [first], [], []
    for rnd in range(fg.max_rounds):
        if rnd:
            parts.append(draw_more(rnd))
        varied, same = judge_groups(parts[-1], score_rows, fg.metric)
        kept += varied
        flat += same
        if len(kept) >= want:
            break
    chosen = (kept + flat)[:want]  # topped up with zero-variance groups when rounds ran out
    counts = {"dynamic_sampling/rounds": float(len(parts)),
              "dynamic_sampling/groups_drawn": float(len(kept) + len(flat)),
              "dynamic_sampling/groups_varied": float(len(kept)),
              "dynamic_sampling/groups_topped_up": float(max(0, want - len(kept)))}
    from megappo.workers.rollout.vllm_rollout import left_pad_prompts

    pool = DataProto.concat(left_pad_prompts(parts, pad_id))
    pool.meta_info = dict(first.meta_info)
    rank = {u: i for i, u in enumerate(chosen)}
    rows = [i for i, u in enumerate(pool.non_tensor_batch["uid"]) if u in rank]
    rows.sort(key=lambda i: rank[pool.non_tensor_batch["uid"][i]])  # stable: a group's rows stay together
    return pool[rows], counts
