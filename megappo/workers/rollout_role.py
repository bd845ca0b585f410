"""The rollout half of ActorRolloutRefWorker (workers/roles.py), mixed into it: its vLLM engine and the hybrid
engine (`init_rollout`), generation (`generate_sequences`), fully_async's continuous stream (`stream_*`,
rollout/stream.py) and the async weight sync between the actor and rollout groups (`weight_sync_address`,
`init_weight_sync`, `send_weights` / `receive_weights`, rollout/weight_sync.py). Its state (rollout, hybrid,
_stream, _replica, _sync_group, _sender, _receiver) is set up by ActorRolloutRefWorker.__init__.
"""

from __future__ import annotations

from typing import Optional

from megappo.controller.dispatch import Dispatch, register
from megappo.protocol import DataProto


class RolloutRole:
    def _reset_rollout(self, config) -> None:
        """vLLM: the rollout section's sampling defaults, no cached prefix, no stream left running
        (fully_async's stream_start builds the next run's)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self.rollout is not None:
            self.rollout.reset(config.rollout)

    # ---- rollout ---------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def init_rollout(self) -> dict:
        """Build this process's vLLM engine (+ the hybrid engine when the actor lives here too)."""
        from megappo.workers.rollout.hybrid_engine import HybridEngine
        from megappo.workers.rollout.vllm_rollout import VLLMRollout

        cfg = self.config
        if not self.is_rollout:
            raise RuntimeError(f"ActorRolloutRefWorker(role={self.role!r}) has no rollout")
        # every rollout engine of a run samples only after a weight sync has sent it the trainer's weights (the
        # hybrid engine's each rollout, the async pools' first sync before any generation): reading model.path
        # here as well would be 64 ranks reading a 70B checkpoint for vLLM to discard at its first sleep. Not with
        # adapter sync, whose vLLM keeps the base it loaded (only the adapters are ever sent)
        adapters_only = cfg.actor.lora.rank > 0 and cfg.rollout.lora_sync == "adapter"
        self.rollout = VLLMRollout.from_config(cfg, load_format="auto" if adapters_only else "dummy")
        if self.actor is not None:
            self.hybrid = HybridEngine(self.actor, self.rollout, bucket_mb=cfg.rollout.weight_sync_bucket_mb)
            self.on_release.append(self.hybrid.close)
        return {"role": self.role, "hybrid": self.hybrid is not None}

    @register(Dispatch.ONE_TO_ALL)
    def generate_sequences(self, prompts: DataProto) -> Optional[DataProto]:
        """Every rank gets the whole prompt batch; the vLLM replicas split it (seeded per row) and
        gather. Hybrid: enter the hybrid engine (reshard the actor's weights into vLLM), generate, exit.
        Returns the full output (meta_info["metrics"]: rollout/*, timing/*) on rank 0, None elsewhere."""
        import time

        from megappo.workers.rollout.hybrid_engine import replicated_generate

        if self.rollout is None:
            raise RuntimeError(f"ActorRolloutRefWorker(role={self.role!r}) has no rollout engine: call "
                               "init_rollout() first (it builds vLLM and the hybrid engine)")
        if self.hybrid is not None:
            with self.hybrid:
                out = self.hybrid.generate_sequences(prompts)
            metrics = dict(self.hybrid.metrics)
        elif self._stream is not None:  # fully_async (validation): through the stream's engine, on rank 0
            t0 = time.perf_counter()
            out = self._stream.generate(prompts) if self.rank == 0 else None
            metrics = {"timing/rollout_s": time.perf_counter() - t0}
        else:
            t0 = time.perf_counter()
            out = replicated_generate(self.rollout, prompts)
            metrics = {"timing/rollout_s": time.perf_counter() - t0}
        if out is not None:
            out.meta_info["metrics"] = metrics
        return out if self.rank == 0 else None

    # ---- fully asynchronous rollout (trainer.mode=fully_async, rollout/stream.py) ------------------

    @register(Dispatch.ONE_TO_ALL)
    def stream_start(self, version: int) -> int:
        """(Re)start this rollout worker's stream at policy `version`; what was in flight is aborted. With
        rollout.tp > 1 each replica's first rank runs the stream, its other ranks replay the first's engine
        calls (rollout/lockstep.py). Returns the TP size of this rank's vLLM engine."""
        from megappo.workers.rollout import lockstep
        from megappo.workers.rollout.stream import RolloutStream

        rollout, tp = self._need(self.rollout, "rollout"), self.config.rollout.tp
        if self._stream is not None:
            self._stream.close()
        if tp > 1 and self._replica is None:  # every rank of the rollout world, together
            self._replica = lockstep.replica_groups(tp)
        if tp > 1 and self.rank % tp:
            if not isinstance(self._stream, lockstep.FollowerStream):  # one replay for the worker's life
                self._stream = lockstep.FollowerStream(rollout, *self._replica)
        else:
            self._stream = RolloutStream(rollout, version)
            if tp > 1 and not isinstance(self._stream.engine.engine, lockstep.LockstepLeader):
                self._stream.engine.use(lockstep.LockstepLeader(rollout.llm.llm_engine, *self._replica))
        return rollout.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size

    @register(Dispatch.ONE_TO_ALL)
    def stream_submit(self, prompts: DataProto, ranks: list) -> int:
        """Start the groups (prompt rows) i with ranks[i] == this worker's rank; returns its groups in flight."""
        mine = [i for i, r in enumerate(ranks) if r == self.rank]
        return self._stream.submit(prompts[mine]) if mine else self._stream.in_flight

    @register(Dispatch.ONE_TO_ALL)
    def stream_collect(self) -> Optional[DataProto]:
        """This worker's finished groups since the last call (token_versions, start_version), or None."""
        return self._stream.collect()

    @register(Dispatch.ONE_TO_ALL)
    def stream_drain(self) -> int:
        """Wait for this worker's samples in flight to finish (trainer.partial_rollout=false, before a sync)."""
        return self._stream.drain()

    @register(Dispatch.ONE_TO_ALL)
    def stream_receive_weights(self, bump: bool = True) -> dict:
        """receive_weights between two engine steps (the actor's send_weights runs at the same time): the
        groups in flight wait with their KV cache and continue under the new weights (trainer.pause_mode=
        recompute: re-prefilled under them first; rollout.lora_sync=adapter: always, as vLLM fixes a request's
        adapter when it is added, so each is aborted and added again, AsyncTokenEngine.resubmit_running); then
        version + 1."""
        with self._stream.paused():
            out = self.receive_weights()
            if self.config.trainer.pause_mode == "recompute" and self.config.rollout.lora_sync != "adapter":
                out["async/recomputed_samples"] = float(self._stream.recompute())
            if bump:
                self._stream.bump_version()
        return out

    # ---- async weight sync (rollout/weight_sync.py) ----------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def weight_sync_address(self) -> tuple:
        """(host, free port) for the weight-sync group's rendezvous (the driver uses rank 0's): this node's routable
        address, never the actor group's own MASTER_ADDR, which is 127.0.0.1 when the actor pool is on one node
        while the rollout pool may be on another."""
        from megappo.controller.worker import node_ip
        from megappo.parallel.launch import free_port

        host = node_ip()
        return host, free_port(host)

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, host: str, port: int, world: int) -> dict:
        """Join the sync group: actor rank 0 as its rank 0, rollout worker r as rank 1 + r (the other
        actor ranks take part in the resharding only)."""
        from megappo.workers.rollout.weight_sync import StatelessGroup, WeightReceiver, WeightSender

        timeout = self.config.trainer.worker_timeout_s
        if self.is_actor:
            if self.rank == 0:
                self._sync_group = StatelessGroup(host, port, 0, world, timeout_s=timeout)
            self._sender = WeightSender(self._need(self.actor, "actor"), self._sync_group,
                                        self.config.rollout.weight_sync_bucket_mb,
                                        adapter=self.config.rollout.lora_sync == "adapter")
        elif self.role == "rollout":
            if self.rollout is None:
                raise RuntimeError("call init_rollout() before init_weight_sync()")
            self._sync_group = StatelessGroup(host, port, 1 + self.rank, world, timeout_s=timeout)
            from megappo.workers.engine_config import lora_config_from

            lora = lora_config_from(self.config) if self.config.rollout.lora_sync == "adapter" else None
            self._receiver = WeightReceiver(self.rollout, self._sync_group,
                                            lora=None if lora is None else (lora, self.config.model.path))
            self.on_release.append(self._receiver.adapter_dirs.close)
        else:
            raise RuntimeError(f"role {self.role!r} takes no part in the weight sync")
        return {"role": self.role, "sync_rank": None if self._sync_group is None else self._sync_group.rank}

    @register(Dispatch.ONE_TO_ALL)
    def send_weights(self) -> dict:
        if self._sender is None:
            raise RuntimeError("call init_weight_sync() first")
        return self._sender.send()

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> dict:
        if self._receiver is None:
            raise RuntimeError("call init_weight_sync() first")
        return self._receiver.receive()
