"""Continuous generation on one rollout worker, for trainer.mode=fully_async (#39): groups go in whenever the
driver admits them, finished groups come out, and new weights load between two engine steps while the rest
keep generating.

    stream = RolloutStream(rollout, version=0)   # the worker's VLLMRollout (rollout.tp > 1: lockstep.py)
    stream.submit(prompts)                       # one row per prompt (a group of spec.num_samples samples)
    done = stream.collect()                      # the finished groups as one DataProto, or None
    stream.drain()                               # trainer.partial_rollout=false only: nothing in flight
    with stream.paused():                        # between two engine steps
        ...load weights...                       # (WeightReceiver.receive)
        stream.recompute()                       # trainer.pause_mode=recompute only: re-prefill what runs
    stream.bump_version()

The engine is the gateway's AsyncTokenEngine over the same in-process vLLM (continuous batching across
every group in flight). Pause mode (trainer.pause_mode): keep = a request in flight across a weight load
keeps its KV cache and continues from its tokens so far under the new weights (a partial rollout, as
PipelineRL does; its KV for the earlier tokens was computed by the old weights); recompute = after the load
vLLM preempts it and re-prefills its prompt + tokens so far under the new weights, then samples on. With
trainer.partial_rollout=false the stream drains first: no sample spans a weight load. Each sampled token carries the version of the
engine step that sampled it (`token_versions`, [rows, R], -1 past a response) and each sample the version
it started at (`start_version`); the decoupled loss takes the sampler's own log-probs as the behaviour
policy per token, so a sample that spans versions is corrected token by token.

Your own agent (rollout.agent, gateway/agents.AgentRunner): each sample is the agent run in its own gateway
session on the same engine (AgentRunner.sample, at most rollout.agent_concurrency at once), its trajectory
the tokens the engine sampled; a weight load pauses the engine under the agents' requests as under plain
ones, and each sampled token carries its version through the gateway's capture. The built-in multi-turn loop
(rollout.multi_turn, agent/loop.AgentLoop.sample) runs the same way: each sample its own turns on the engine,
its tools on the loop's threads, its model tokens tagged with the version that sampled them.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Optional

import torch

from megappo.protocol import DataProto


class RolloutStream:
    def __init__(self, rollout, version: int = 0):
        from megappo.workers.rollout.async_engine import AsyncTokenEngine

        self.rollout = rollout
        self.engine = AsyncTokenEngine.for_llm(rollout.llm)
        self.engine.version = version
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="megappo-stream", daemon=True)
        self._thread.start()
        self._groups: dict = {}  # uid -> (the prompt's row, its SamplingSpec, one future per sample, requests)
        from megappo.agent.loop import AgentLoop
        from megappo.gateway.agents import AgentRunner

        agent = getattr(rollout, "agent", None)
        if agent is not None and not isinstance(agent, (AgentRunner, AgentLoop)):
            raise ValueError(f"fully_async streams single-turn samples, rollout.multi_turn or rollout.agent, not "
                             f"{type(agent).__name__}")
        self.agent = agent
        self._gate = asyncio.Semaphore(agent.concurrency) if isinstance(agent, AgentRunner) else None
        if rollout.capture_routes:  # actor.router_replay=r3: every forward's routes, popped as samples finish
            from megappo.workers.rollout.route_capture import start_capture

            rollout.llm.collective_rpc(start_capture)

    @property
    def in_flight(self) -> int:
        return len(self._groups)

    def submit(self, prompts: DataProto) -> int:
        """Start every row's group: sample j of row i is seeded base + j, base = non_tensor "group_seed"[i]
        when given, else meta_info["sampling"].seed + i * n (as VLLMRollout.generate_sequences seeds a
        batch). Returns the groups now in flight."""
        seeds = prompts.non_tensor_batch.get("group_seed")
        for i, uid in enumerate(prompts.non_tensor_batch["uid"]):
            if uid in self._groups:
                raise ValueError(f"group {uid} is already in flight on this rollout worker")
            self._groups[uid] = self._start(prompts, i, None if seeds is None else int(seeds[i]))
        return self.in_flight

    def _start(self, prompts: DataProto, i: int, base=None) -> tuple:
        """Row i's group into the engine: (its one-row DataProto, its SamplingSpec seeded `base`, one future
        per sample)."""
        from megappo.data.images import IMAGES

        if IMAGES in prompts.non_tensor_batch:
            raise ValueError("fully_async streams text prompts only: train a vision-language model with "
                             "trainer.mode=sync")
        spec = prompts.meta_info["sampling"]
        base = spec.seed + i * spec.num_samples if base is None else base
        requests, params = self.rollout._requests(prompts.batch["input_ids"][i:i + 1].cpu(),
                                                  prompts.batch["attention_mask"][i:i + 1].cpu().bool(), spec, base)
        row = prompts[i:i + 1]
        row.non_tensor_batch.pop("group_seed", None)
        if self.agent is None:
            runs = [self.engine.generate(r["prompt_token_ids"], p) for r, p in zip(requests, params)]
        else:  # sample j of the group is the agent on the row, seeded base + j (as the sync rollout seeds it)
            inputs = self.rollout._agent_input(row.non_tensor_batch, spec.num_samples)  # rows / tool names
            if self._gate is not None:
                runs = [self.agent.sample(r["prompt_token_ids"], spec, base + j, inputs[j], self._gate)
                        for j, r in enumerate(requests)]
            else:
                runs = [self.agent.sample(self.engine, r["prompt_token_ids"], spec, base + j,
                                          None if inputs is None else inputs[j]) for j, r in enumerate(requests)]
        return row, spec.with_seed(base), [asyncio.run_coroutine_threadsafe(c, self._loop) for c in runs], requests

    def _check(self) -> None:
        """rollout.tp > 1: a step that failed on this replica ends it (lockstep.py), whatever its samples show (an
        agent's failed request is a dropped sample)."""
        failed = getattr(self.engine.engine, "failed", None)
        if failed is not None:
            raise RuntimeError(f"this rollout replica's engines stopped at a failed step: {failed}")

    def collect(self) -> Optional[DataProto]:
        """The groups whose every sample has finished (removed from the stream), or None. A request the
        engine failed raises here."""
        self._check()
        done = [uid for uid, (_, _, futures, _) in self._groups.items() if all(f.done() for f in futures)]
        parts = [self._assemble(*self._groups.pop(uid)) for uid in done]
        if not parts:
            return None
        from megappo.workers.rollout.vllm_rollout import left_pad_prompts

        return DataProto.concat(left_pad_prompts(parts, self.rollout.pad_token_id))

    def generate(self, prompts: DataProto) -> DataProto:
        """A whole batch through the stream's engine, waited for (validation while groups are in flight: a
        synchronous LLM.generate would step the same engine from a second thread)."""
        spec = prompts.meta_info["sampling"]
        if spec.seed is None:  # greedy validation: no seed of its own
            prompts = DataProto(prompts.batch, prompts.non_tensor_batch, {**prompts.meta_info,
                                                                          "sampling": spec.with_seed(0)})
        started = [self._start(prompts, i) for i in range(len(prompts))]  # every request in before any wait
        return DataProto.concat([self._assemble(*group) for group in started])

    def _assemble(self, row: DataProto, spec, futures, requests) -> DataProto:
        done = [f.result() for f in futures]
        R = spec.max_new_tokens
        captured = None
        if self.agent is None:
            res = self.rollout.response_tensors([(c.ids, c.logprobs, c.finish_reason) for c in done], R)
            per_token, starts = [c.token_versions for c in done], [c.version for c in done]
            if self.rollout.capture_routes:  # each sample's from the forwards of its request(s): a resubmitted
                from megappo.models.routing_replay import ROUTES  # one's last recomputed the part before

                res[ROUTES] = self.rollout._routes([c.request_id for c in done], requests,
                                                   row.batch["input_ids"].shape[1], R, streaming=True)
        else:  # trajectories (an agent that failed: nothing trained, started at the current version)
            from megappo.agent.loop import trajectory_rows, trajectory_tensors

            done = trajectory_rows(done)  # + rollout.agent's rewritten histories, rows of their own
            res = trajectory_tensors(done, R, self.rollout.pad_token_id)
            per_token = [t.versions for t in done]
            starts = [min((v for v in t.versions if v >= 0), default=self.engine.version) for t in done]
            if self.rollout.capture_routes:  # each row's from its last turn's request (as generate_sequences'); the
                from megappo.workers.rollout.route_capture import pop_routes  # earlier turns' popped and dropped

                captured = self.rollout.llm.collective_rpc(pop_routes, args=([r for t in done
                                                                               for r in t.request_ids],))[0]
        versions = torch.full((len(done), R), -1, dtype=torch.long, device="cpu")
        for k, tv in enumerate(per_token):
            tv = tv[:R]
            versions[k, :len(tv)] = torch.tensor(tv, dtype=torch.long, device="cpu")
        res["token_versions"] = versions
        res["start_version"] = torch.tensor(starts, dtype=torch.long, device="cpu")
        return self.rollout.assemble(row, res, spec, None if self.agent is None else done, requests, captured)

    def drain(self) -> int:
        """Wait until every sample in flight has finished (the engine keeps stepping; the groups stay here
        for collect). Returns the groups waited for."""
        for _, _, futures, _ in list(self._groups.values()):
            for f in futures:
                f.exception()  # waits; a failed request raises in collect, as it would without the drain
        self._check()
        return len(self._groups)

    @contextmanager
    def paused(self):
        """No engine step runs inside; the requests in flight keep their KV cache and continue after (unless
        `recompute` is called inside, after the weights load). rollout.tp > 1: the replica's other ranks are
        told, and load theirs (lockstep.py)."""
        with self.engine.paused():
            announce = getattr(self.engine.engine, "announce_pause", None)
            if announce is not None:
                announce()
            yield

    def recompute(self) -> int:
        """Inside `paused()`, after a weight load (trainer.pause_mode=recompute): the running requests re-prefill
        their prompt + tokens so far under the new weights before sampling on. Returns how many."""
        return self.engine.recompute_running()

    def bump_version(self) -> int:
        return self.engine.bump_version()

    def close(self) -> None:
        """Abort what is in flight (a new stream starts clean, e.g. after a restart)."""
        self.engine.abort_all()
        self._groups.clear()
        self._loop.call_soon_threadsafe(self._loop.stop)
