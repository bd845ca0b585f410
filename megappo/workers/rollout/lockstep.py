"""rollout.tp > 1 on trainer.mode=fully_async's stream: the TP ranks of one vLLM replica step in lock step.

With `external_launcher` every TP rank runs its own vLLM engine core (scheduler, sampler) and the ranks meet
in the model's collectives, so each must see the same engine calls in the same order. A synchronous
`LLM.generate` gives that for free (every rank passes the same batch); a stream does not: requests arrive
whenever the driver, an agent or a weight load makes them. So the replica's first rank (the leader) owns the
stream and its AsyncTokenEngine; its engine is wrapped in `LockstepLeader`, which records every call that
changes the engine's state (add_request with its arrival time, abort_request, reset_prefix_cache) and, before
each `step()`, sends them to the other ranks over a gloo group of the replica's ranks. Each other rank (a
follower) runs `FollowerStream`: a thread that receives the calls, replays them on its own engine in the same
order, steps, and drops the outputs (the leader's are the replica's). Requests are seeded per sample, so
every rank samples the same tokens; unseeded ones draw from the engines' generators, seeded alike.

A weight load: every rank of the rollout pool receives the weights (weight_sync.py) inside its stream's
`paused()`. The leader's takes its engine's step lock (a step it has begun, the followers finish with it),
then tells the followers it has paused, with the calls made since its last step (so a prefix-cache reset
in the pause finds the same blocks in use on every rank); a follower's `paused()` waits for that word before it takes the lock
its replay steps under, so no rank loads while its replica steps and no follower holds back a step the
leader has begun. What the leader does inside the pause (recompute: reset_prefix_cache(
reset_running_requests=True)) reaches the followers with the next step, before it. A step that fails on the
leader ends the replica (its followers ran or hang in it): every later call raises, the stream's next collect
or weight load raises it, and the run stops with it (resume from its last checkpoint).

This is how megappo differs from AReaL / verl's fully-async rollouts, which run vLLM's own server (its
multiprocess executor broadcasts the scheduler's output to the TP workers): here the engines stay in the
rollout workers' processes (the weight receiver loads into them in place) and the leader's engine calls
are what travels.
"""

from __future__ import annotations

import datetime
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

# a follower waits for the leader's next step as long as the stream lives (the leader steps only while
# requests are in flight: an idle stream sends nothing)
IDLE_TIMEOUT = datetime.timedelta(days=7)


def replica_groups(tp: int):
    """Every rank of the rollout world calls this, in the same order: (this rank's replica group, its
    leader's global rank). Replicas are consecutive blocks of `tp` ranks, as vLLM's TP groups."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, tp):
        group = dist.new_group(list(range(first, first + tp)), backend="gloo", timeout=IDLE_TIMEOUT)
        if first <= rank < first + tp:
            mine = (group, first)
    return mine


class LockstepLeader:
    """The leader's LLMEngine, its state-changing calls recorded and sent to the followers before each step
    (everything else passes through)."""

    def __init__(self, engine, group, src: int):
        self._engine, self._group, self._src = engine, group, src
        self._calls: list = []
        self.failed = None  # a step that raised: every later call raises (the followers' engines differ now)
        self._internal: dict = {}  # a request's id -> vLLM's internal id for it
        self._external: dict = {}  # and back

    def add_request(self, request_id, prompt, params, lora_request=None):
        arrival, sent = time.time(), params.clone()  # as given (the engine may adjust its own copy)
        internal = self._engine.add_request(request_id, prompt, params, arrival_time=arrival,
                                            lora_request=lora_request)
        self._calls.append(("add", request_id, prompt, sent, arrival, lora_request))
        self._internal[request_id], self._external[internal] = internal, request_id
        return internal

    def abort_request(self, request_ids, internal: bool = False):
        self._engine.abort_request(request_ids, internal=internal)
        ids = [self._external.get(i, i) for i in request_ids] if internal else list(request_ids)
        self._calls.append(("abort", ids))
        for rid in ids:
            self._external.pop(self._internal.pop(rid, None), None)

    def reset_prefix_cache(self, **kwargs):
        out = self._engine.reset_prefix_cache(**kwargs)
        self._calls.append(("reset", kwargs))
        return out

    def announce_pause(self) -> None:
        """Inside the stream's paused() (no step runs): the followers apply the calls made since the last step
        (e.g. aborts: a prefix-cache reset inside the pause must find the same blocks in use on every rank),
        then may load weights."""
        self._send(("pause", self._calls))

    def step(self):
        self._send(("step", self._calls))
        try:
            outputs = self._engine.step()
        except Exception as e:  # the followers ran (or hang in) this step: the replica cannot go on
            self.failed = e
            raise
        for out in outputs:
            if out.finished:
                self._external.pop(self._internal.pop(out.request_id, None), None)
        return outputs

    def _send(self, message) -> None:
        if self.failed is not None:
            raise RuntimeError(f"this rollout replica's engines diverged at a failed step ({self.failed}); "
                               "resume the run from its last checkpoint")
        dist.broadcast_object_list([message], src=self._src, group=self._group)
        self._calls = []  # sent

    def __getattr__(self, name):
        return getattr(self._engine, name)


class FollowerStream:
    """A follower's side of the stream: no groups of its own (the driver submits to leaders only), its engine
    replaying the leader's calls."""

    in_flight = 0

    def __init__(self, rollout, group, src: int):
        self.engine = rollout.llm.llm_engine
        self._group, self._src = group, src
        self._lock = threading.RLock()
        self._leader_paused = threading.Condition()
        self._pauses = [0, 0]  # the leader's pauses announced, this rank's entered
        self._internal: dict = {}  # the leader's request id -> this engine's internal id
        self.error = None
        self._thread = threading.Thread(target=self._replay, name="megappo-lockstep", daemon=True)
        self._thread.start()

    def _replay(self) -> None:
        from megappo.parallel import cpu_compat
        from megappo.utils.checkpoint import preserved_rng

        try:
            while True:
                box = [None]
                dist.broadcast_object_list(box, src=self._src, group=self._group)
                kind, calls = box[0]
                with self._lock:
                    for call in calls:
                        self._apply(call)
                if kind == "pause":
                    with self._leader_paused:
                        self._pauses[0] += 1
                        self._leader_paused.notify_all()
                    continue
                with self._lock:
                    with preserved_rng(), cpu_compat.suspended():
                        outputs = self.engine.step()
                for out in outputs:
                    if out.finished:
                        self._internal.pop(out.request_id, None)
        except Exception as e:  # noqa: BLE001 - kept for the worker to report (stream calls raise it)
            self.error = e

    def _apply(self, call) -> None:
        kind, *args = call
        if kind == "add":
            rid, prompt, params, arrival, lora = args
            self._internal[rid] = self.engine.add_request(rid, prompt, params, arrival_time=arrival,
                                                          lora_request=lora)
        elif kind == "abort":
            ids = [self._internal.pop(r) for r in args[0] if r in self._internal]
            if ids:
                self.engine.abort_request(ids, internal=True)
        else:
            self.engine.reset_prefix_cache(**args[0])

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"rollout TP follower: replaying the leader's engine calls failed: {self.error}")

    # ---- the stream's interface (rollout_role.py stream_*): nothing of its own to submit, collect or drain
    def submit(self, prompts) -> int:
        raise RuntimeError("fully_async submits groups to each rollout replica's first rank only")

    def collect(self):
        self._check()
        return None

    def drain(self) -> int:
        self._check()
        return 0

    @contextmanager
    def paused(self):
        """Once the leader has paused (its next announcement), no replayed step inside: a weight load."""
        self._pauses[1] += 1
        with self._leader_paused:
            while self._pauses[0] < self._pauses[1]:
                self._check()
                self._leader_paused.wait(timeout=1.0)
        while not self._lock.acquire(timeout=1.0):  # a replayed step the leader abandoned would hold it
            self._check()
        try:
            yield
        finally:
            self._lock.release()

    def recompute(self) -> int:
        return 0  # the leader's reset reaches this engine before its next step

    def bump_version(self) -> int:
        return 0

    def close(self) -> None:
        """The stream restarts (stream_start): this replay goes on serving the leader's next stream."""
