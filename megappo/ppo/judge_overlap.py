"""reward.judge.overlap: the generative judge starts on the rows as they come, so its requests run beside the rest
of the rollout (and the step's forward passes), and the reward step waits only for what is still being judged.

    overlap = JudgeOverlap.of(reward_fn, cfg.reward.judge.overlap)  # None: no judge among the reward's rules
    overlap.submit(rows)             # fully_async: each finished group as the stream collects it; sync / async:
                                     # the step's batch as the rollout returns it
    timing = overlap.take(samples)   # the reward step: waits for what is still being judged; the rows' rule
                                     # results go to RULE_SCORES, which score_rows uses instead of the rules

Rows come before the rollout ends in fully_async only: GroupStream hands each finished group to `submit`, both
while the trainer waits for its batch and while a batch trains (the next batches' groups, with max_staleness >=
1), so only there does judging overlap the rollout. trainer.mode=sync (the hybrid engine's generate) and async (the
rollout pool's one call) return the batch whole: judging starts when it arrives and overlaps the step's pi_old /
reference / value forwards, none of the rollout. overlap=false: nothing is judged before the reward step, which
judges the batch itself (judge_overlap_frac 0).

One thread judges; what came while it was busy is judged together, one call to each rule (the judge's cap
holds). It runs every rule of the rows, not the judge's alone (the judge is what takes the time). Rows are known
by their group (uid), whose rows keep their order into the batch. A rewritten history's later rows
(ppo/segments.py) are not judged: each sample once, as the reward step scores it. With DAPO's filter
(algorithm.filter_groups) the filter has scored the rows (fully_async: each group as it came) and they carry
their results: nothing here runs, and no timing/judge_* is logged.

Per step: timing/judge_s, the wall seconds during which the step's rows were being judged (the union of the calls
that judged them); timing/judge_wait_s, what the reward step still waited for; timing/judge_overlap_frac =
1 - wait / judge, the share of the judging hidden behind the rollout and the step's other work.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Optional

import numpy as np

from megappo.ppo.segments import Segments
from megappo.protocol import DataProto
from megappo.rewards.judge import judges_of
from megappo.rewards.manager import RULE_SCORES, RewardManager


class JudgeOverlap:
    def __init__(self, manager: RewardManager, early: bool = True):
        """`early`: judge what `submit` gets as it comes (reward.judge.overlap); False: only what `take` asks."""
        self.manager, self.early = manager, early
        self._cond = threading.Condition()
        self._queue: list[DataProto] = []  # submitted, not yet being judged
        self._pending: set = set()  # uids queued or being judged
        self._done: dict = {}  # uid -> (its rows' rules.Scored, the judging call's (start, end)), or what it raised
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    @classmethod
    def of(cls, reward_fn, overlap: bool) -> Optional["JudgeOverlap"]:
        """For a RewardManager whose rules hold a judge (rewards/judge.py), else None."""
        if isinstance(reward_fn, RewardManager) and judges_of(reward_fn.scorers):
            return cls(reward_fn, overlap)
        return None

    def submit(self, rows: DataProto) -> None:
        """Whole groups' rows to judge from now on (nothing with overlap off)."""
        if self.early:
            self._enqueue(rows)

    def _enqueue(self, rows: DataProto) -> None:
        if RULE_SCORES in rows.non_tensor_batch:  # DAPO's filter scored them
            return
        segments = Segments.of(rows)
        if segments is not None:
            rows = rows[segments.primary]
        rows = DataProto(dict(rows.batch), dict(rows.non_tensor_batch), {})  # keys the step adds later are not read
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._judge, name="judge-overlap", daemon=True)
                self._thread.start()
            self._pending.update(rows.non_tensor_batch["uid"])
            self._queue.append(rows)
            self._cond.notify_all()

    def _judge(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                parts, self._queue = self._queue, []
            t0 = time.perf_counter()
            try:
                results = self.manager.rule_results(parts)
            except BaseException as e:  # noqa: BLE001 - raised again in the reward step that waits for these rows
                results = [e] * len(parts)
            span = (t0, time.perf_counter())
            with self._cond:
                for part, scored in zip(parts, results):
                    uids = list(part.non_tensor_batch["uid"])
                    for u in dict.fromkeys(uids):
                        self._done[u] = scored if isinstance(scored, BaseException) else \
                            ([s for s, v in zip(scored, uids) if v == u], span)
                    self._pending.difference_update(uids)
                self._cond.notify_all()

    def take(self, samples: DataProto) -> dict:
        """The reward step: `samples`' rule results (judged already, being judged, or judged now) into
        non_tensor_batch[RULE_SCORES]; returns timing/judge_s, judge_wait_s, judge_overlap_frac."""
        if RULE_SCORES in samples.non_tensor_batch:
            return {}
        t0 = time.perf_counter()
        uids = list(samples.non_tensor_batch["uid"])
        with self._cond:
            unseen = {u for u in uids if u not in self._pending and u not in self._done}
        if unseen:
            self._enqueue(samples[[i for i, u in enumerate(uids) if u in unseen]])
        with self._cond:
            self._cond.wait_for(lambda: all(u in self._done for u in uids))
            got = {u: self._done.pop(u) for u in dict.fromkeys(uids)}
        wait = time.perf_counter() - t0
        failed = next((r for r in got.values() if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        rows = Counter(uids)
        changed = [u for u, (scored, _) in got.items() if len(scored) != rows[u]]
        if changed:
            raise RuntimeError(f"reward.judge.overlap: group {changed[0]} has {rows[changed[0]]} rows in the reward "
                               f"step but {len(got[changed[0]][0])} were judged; set reward.judge.overlap=false")
        each = {u: iter(scored) for u, (scored, _) in got.items()}
        kept = np.empty(len(uids), dtype=object)
        kept[:] = [next(each[u]) for u in uids]
        samples.non_tensor_batch[RULE_SCORES] = kept
        judge = _covered({span for _, span in got.values()})
        return {"timing/judge_s": judge, "timing/judge_wait_s": wait,
                "timing/judge_overlap_frac": max(0.0, 1.0 - wait / judge) if judge > 0 else 0.0}

    def close(self) -> None:
        """The thread stops after the call it is in (a daemon: nothing waits for it)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _covered(spans) -> float:
    """Seconds covered by the union of (start, end) spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
