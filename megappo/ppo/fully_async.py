"""trainer.mode=fully_async (#39): the rollout pool generates continuously, the trainer takes a batch as soon
as enough finished groups keep every sample within trainer.max_staleness, and after each update the new
weights reach the pool while generation is in flight (each engine pauses between two steps, loads them,
resumes: an unfinished sample continues under the new weights, a partial rollout).

    stream = GroupStream(StreamSource(...))  # what it takes from the trainer; the pool's streams start at its version
    batch = stream.next_batch()         # admit groups, collect finished ones, until select_batch gives a batch
    ...the trainer's steps 2-6 on it (pi_old / proximal, ref, values, rewards, advantages, updates)...
    stream.after_update()               # weights to the pool under pause; version + 1

Admission and batch choice are ppo/staleness.py's (AReaL's rule: a group starts only while every group that
can still be trained stays within the bound). With algorithm.filter_groups (DAPO's dynamic sampling) each
group is scored by its rule as it finishes and one whose responses all agree is dropped: its place goes to a
new group, and it counts as consumed for a resume. At most (max_rounds - 1) x B groups are dropped per batch,
as a synchronous step draws at most max_rounds x B prompts; past that a finished group is kept as it is.

A group is one prompt's rollout.n samples; each is seeded as the synchronous run seeds it (group g = prompt i
of step k gets step k's seed + i * n), so with max_staleness=0 (one batch admitted at a time, trained
on-policy) the batches are the sync run's. A batch's groups are ordered by their index, whatever order they
finished in.

With `on_group` (the trainer's generative judge, reward.judge.overlap: ppo/judge_overlap.py) each kept group is
handed over as it is collected, and while a batch trains (from next_batch until the trainer's next call here) a
thread collects the groups that finish meanwhile, admitting nothing, so they are judged as they finish.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from megappo.ppo.dynamic_sampling import judge_groups
from megappo.ppo.staleness import StalenessManager, select_batch, version_stats
from megappo.protocol import DataProto

POLL_S = 0.02  # between two collects while a batch is not ready


@dataclass
class StreamSource:
    """What a GroupStream takes from the trainer, and nothing more (ppo/ray_trainer.py builds it per fit)."""

    config: object  # the run's config
    pool: object  # the rollout worker group (its stream_* methods)
    version: int  # the trainer's global step: the policy version the stream starts at
    sampler: object  # the train prompts' EpochSampler (its state_dict for checkpoints)
    dataset: object  # the train RLHFDataset (get_batch)
    sampling: object  # the rollout's SamplingSpec
    seed_for: Callable  # step -> the SamplingSpec a sync run would seed that step's rollout with
    score_rows: Callable  # the reward manager's score_rows (DAPO's filter)
    sync_weights: Callable  # (receive method, bump) -> the trainer's weights to the pool, timed: its metrics
    pad_id: int
    resume: Optional[dict] = None  # a checkpoint's GroupStream.state_dict()[1]
    on_group: Optional[Callable] = None  # each finished group kept (its rows), as it comes: ppo/judge_overlap.py


class GroupStream:
    def __init__(self, src: StreamSource):
        cfg = src.config
        self.src = src
        self.pool = src.pool
        self.B = cfg.data.train_batch_size  # groups per trained batch
        self.max_staleness = cfg.trainer.max_staleness
        self.mgr = StalenessManager(self.B, self.max_staleness, version=src.version, started=src.version * self.B,
                                    finished=src.version * self.B, consumed=src.version * self.B)
        self.queue: list = []  # (group index, one-row DataProto) drawn from the sampler, not yet started
        self.next_group = src.version * self.B  # the first group of the next sampler batch to draw
        self.consumed: set = set()  # group indices trained (those at or above the lowest untrained one matter)
        self.skip: set = set()  # resumed: groups of the redrawn sampler batches that were trained already
        resume = src.resume
        if resume is not None:  # the trainer's sampler is at the batch holding the lowest untrained group
            self.next_group = resume["low"] // self.B * self.B
            self.skip = set(range(self.next_group, resume["low"])) | set(resume["consumed"])
            self.consumed = set(resume["consumed"])
        self.sampler_before = {self.next_group // self.B: src.sampler.state_dict()}  # sampler batch -> state
        self.pending: dict = {}  # uid -> (group index, start version, worker rank)
        self.done: dict = {}  # uid -> (group index, start version, DataProto rows)
        self.load = [0] * self.pool.world_size  # groups in flight per rollout worker
        # each rollout replica's first rank takes groups (rollout.tp > 1: the others step with it, lockstep.py)
        self.leaders = list(range(0, self.pool.world_size, cfg.rollout.tp))
        fg = cfg.algorithm.filter_groups
        self.filter = fg if fg.enable else None  # DAPO: drop finished groups whose responses all agree
        self.drop_budget = (fg.max_rounds - 1) * self.B  # per batch, as a sync step's extra rounds
        self.filtered = {"varied": 0, "dropped": 0, "kept_flat": 0}  # since the last batch
        self._poller: Optional[tuple] = None  # on_group: (thread, stop, [its error]) collecting while a batch trains
        engines_tp = set(self.pool.submit("stream_start", self.mgr.version).result())
        if engines_tp != {cfg.rollout.tp}:
            raise RuntimeError(f"fully_async: the rollout pool's vLLM engines run at TP {sorted(engines_tp)}, not "
                               f"rollout.tp={cfg.rollout.tp}")
        src.sync_weights("stream_receive_weights", False)  # the trainer's weights (resumed too), checked

    # ---- 1. admit, collect, choose --------------------------------------------------------------------

    def next_batch(self) -> DataProto:
        """The next batch to train (its groups' rows in group order), with meta_info["metrics"] (async/*)."""
        self._stop_polling()
        t0 = time.perf_counter()
        while True:
            self._admit()
            if self._collect():  # progress (DAPO may drop what finished): the timeout counts from here
                t0 = time.perf_counter()
            starts = {uid: v0 for uid, (_, v0, _) in self.done.items()}
            chosen = select_batch(starts, [v0 for _, v0, _ in self.pending.values()], self.mgr.version, self.B,
                                  self.max_staleness)
            if chosen is not None:
                break
            if time.perf_counter() - t0 > self.src.config.trainer.phase_timeout_s:
                raise TimeoutError(f"fully_async: no batch of {self.B} finished groups after trainer.phase_timeout_s="
                                   f"{self.src.config.trainer.phase_timeout_s}s ({len(self.pending)} in flight, "
                                   f"{len(self.done)} finished)")
            time.sleep(POLL_S)
        groups = sorted((self.done.pop(uid) for uid in chosen), key=lambda g: g[0])
        self.mgr.on_consume(len(groups))
        self.consumed.update(g for g, _, _ in groups)
        from megappo.workers.rollout.vllm_rollout import left_pad_prompts

        batch = DataProto.concat(left_pad_prompts([rows for _, _, rows in groups], self.src.pad_id))
        metrics = version_stats(batch.batch["token_versions"], batch.batch["response_mask"], self.mgr.version,
                                self.max_staleness, batch.batch.get("start_version"))
        if self.filter is not None:
            f = self.filtered
            metrics.update({"dynamic_sampling/groups_drawn": float(sum(f.values())),
                            "dynamic_sampling/groups_varied": float(f["varied"]),
                            "dynamic_sampling/groups_dropped": float(f["dropped"]),
                            "dynamic_sampling/groups_topped_up": float(f["kept_flat"])})
            self.filtered = dict.fromkeys(f, 0)
        metrics.update({"async/rollout_replicas": float(len(self.leaders)),
                        "async/groups_in_flight": float(len(self.pending)),
                        "async/groups_waiting": float(len(self.done)),
                        "async/policy_version": float(self.mgr.version)})
        batch.meta_info["metrics"] = metrics
        if self.src.on_group is not None:  # groups finishing while this batch trains are handed over as they finish
            stop, error = threading.Event(), []
            self._poller = (threading.Thread(target=self._poll, args=(stop, error), name="group-poll", daemon=True),
                            stop, error)
            self._poller[0].start()
        return batch

    def _poll(self, stop: threading.Event, error: list) -> None:
        """Between next_batch and the trainer's next call here: collect what finishes (on_group), admitting nothing."""
        while not stop.wait(POLL_S):
            try:
                if self.pending:
                    self._collect()
            except BaseException as e:  # noqa: BLE001 - raised in the trainer's next call here
                error.append(e)
                return

    def _stop_polling(self) -> None:
        if self._poller is not None:
            (thread, stop, error), self._poller = self._poller, None
            stop.set()
            thread.join()
            if error:
                raise error[0]

    def _admit(self) -> None:
        """Start as many groups as admission allows, each on the rollout worker with the fewest in flight."""
        k = self.mgr.capacity()
        if k == 0:
            return
        while len(self.queue) < k:  # whole sampler batches, in order: group g = prompt g % B of step g // B + 1
            self.sampler_before[self.next_group // self.B] = self.src.sampler.state_dict()
            prompts = self.src.dataset.get_batch(next(self.src.sampler))
            self.queue += [(self.next_group + i, prompts[i:i + 1]) for i in range(len(prompts))
                           if self.next_group + i not in self.skip]
            self.next_group += len(prompts)
        start, self.queue = self.queue[:k], self.queue[k:]
        seeds, ranks = [], []
        for g, row in start:
            step, i = g // self.B + 1, g % self.B
            seeds.append(self.src.seed_for(step).seed + i * self.src.sampling.num_samples)
            rank = min(self.leaders, key=self.load.__getitem__)
            self.load[rank] += 1
            self.pending[row.non_tensor_batch["uid"][0]] = (g, self.mgr.version, rank)
            row.non_tensor_batch["group"] = np.array([g])
            ranks.append(rank)
        from megappo.workers.rollout.vllm_rollout import left_pad_prompts

        rows = DataProto.concat(left_pad_prompts([row for _, row in start], self.src.pad_id))
        rows.non_tensor_batch["group_seed"] = np.array(seeds, dtype=object)
        rows.meta_info = {"sampling": self.src.sampling}
        self.mgr.on_start(len(start))
        self.pool.submit("stream_submit", rows, ranks).result()

    def _collect(self) -> int:
        """Move the pool's finished groups to `done` (or drop them: DAPO). Returns how many finished."""
        finished = 0
        for rank, part in enumerate(self.pool.submit("stream_collect").result()):
            if part is None:
                continue
            uids = part.non_tensor_batch["uid"]
            for uid in dict.fromkeys(uids):  # each finished group once, its rows together
                g, v0, worker = self.pending.pop(uid)
                self.load[worker] -= 1
                rows = part[[j for j, u in enumerate(uids) if u == uid]]
                self.mgr.on_finish()
                finished += 1
                if self.filter is not None and self._drop(rows):
                    self.mgr.on_drop()
                    self.consumed.add(g)  # a resume does not draw it again
                    continue
                self.done[uid] = (g, v0, rows)
                if self.src.on_group is not None:  # the judge starts on it, beside the rest of the rollout
                    self.src.on_group(rows)
        return finished

    def _drop(self, rows: DataProto) -> bool:
        """DAPO: whether this finished group's responses all agree (algorithm.filter_groups.metric) and the batch's
        drop budget has room. Its rule results stay on the rows for the reward phase (a rule runs once)."""
        score = self.src.score_rows  # its samples printed by the reward phase
        varied, _ = judge_groups(rows, lambda part: score(part, keep=True, examine=False), self.filter.metric)
        kind = "varied" if varied else "dropped" if self.filtered["dropped"] < self.drop_budget else "kept_flat"
        self.filtered[kind] += 1
        return kind == "dropped"

    # ---- checkpoints: the untrained groups are regenerated on resume -----------------------------------

    def state_dict(self) -> tuple[dict, dict]:
        """(the sampler's state before the batch holding the lowest untrained group, {low, consumed}): a
        resumed run redraws from that batch and skips the groups trained already, so no prompt is lost or
        trained twice. Groups in flight or finished but untrained are not saved: they are generated again
        (same prompts, same seeds) by the resumed weights."""
        self._stop_polling()
        untrained = [g for g, _, _ in self.pending.values()] + [g for g, _, _ in self.done.values()] + \
            [g for g, _ in self.queue] + [self.next_group]
        low = min(untrained)
        self.consumed = {g for g in self.consumed if g >= low}
        self.sampler_before = {b: s for b, s in self.sampler_before.items() if b >= low // self.B}
        return self.sampler_before[low // self.B], {"low": low, "consumed": sorted(self.consumed)}

    # ---- 6b. the new weights to the pool, generation in flight ----------------------------------------

    def after_update(self) -> dict:
        """trainer.partial_rollout=false: the samples in flight finish under the old weights first (the trainer
        waits: timing/drain_s), so every sample is generated by one version."""
        self._stop_polling()
        self.mgr.on_update()
        timing = {}
        if not self.src.config.trainer.partial_rollout:
            t0 = time.perf_counter()
            self.pool.submit("stream_drain").result()
            timing["timing/drain_s"] = time.perf_counter() - t0
        return {**timing, **self.src.sync_weights("stream_receive_weights", True)}
