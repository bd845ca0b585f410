"""RayWorkerGroup / NVMegatronRayWorkerGroup: one Ray actor per pool bundle, driven from the single
controller.

    pool = RayResourcePool([4])
    wg = NVMegatronRayWorkerGroup(pool, ActorRolloutRefWorker, args=(cfg,), name="actor", timeout_s=600)
    wg.init_model()                    # ONE_TO_ALL; then the group reads every worker's (dp, pp, tp)
    out = wg.compute_log_prob(batch)   # MEGATRON_COMPUTE: pad + split by dp -> call all -> collect

Every registered worker method (`@register(Dispatch.X)`, see dispatch.py) appears on the group as a
method of the same name that plans the call with DISPATCH_TABLE[X], calls every worker and collects.

Nothing waits forever: every ray.get has a timeout (trainer.worker_timeout_s). A worker that dies
mid-call, a call that outlives the timeout, or an actor that never starts (no resources left in its
bundle) raises a one-line WorkerError naming the group, rank, node IP and pid (or the bundle and the
resources asked). After a death or a timeout the group is marked broken (its collectives may be stuck)
and every later call raises at once; `shutdown()` kills its actors. An exception raised by the
worker's own code comes back as Ray's RayTaskError, which is also an instance of the original
exception class (a ValueError stays catchable as ValueError), with a note naming the rank.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, Optional, Sequence

from megappo.controller.dispatch import (CallPlan, Dispatch, DispatchSpec, MegatronTopology, collect_results, plan_call,
                                      register, registered_methods)
from megappo.controller.resource_pool import Bundle, RayResourcePool, ResourcePoolManager, WorkerError
from megappo.parallel import device

__all__ = ["RayWorkerGroup", "NVMegatronRayWorkerGroup", "PendingCall", "first_failure", "WorkerError", "RayResourcePool",
           "ResourcePoolManager", "Dispatch", "register"]


class PendingCall:
    """A submitted group call; `result()` waits (with the group's timeout) and collects."""

    def __init__(self, group: "RayWorkerGroup", method: str, spec: DispatchSpec, plan: CallPlan, refs: list,
                 after: Optional[Callable[[], Any]] = None):
        self.group, self.method, self.spec, self.plan, self.refs = group, method, spec, plan, refs
        self.after = after  # run once the call succeeded (NVMegatron: read coordinates after init_model)

    def settle(self, timeout_s: float) -> None:
        """Wait until every rank's part has ended, however it ends (at most timeout_s): `result()` raises
        at the first failed rank while the others may still be running."""
        import ray

        ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)

    def result(self, timeout_s: Optional[float] = None) -> Any:
        results = self.group._wait(self.refs, self.method, timeout_s)
        if self.after is not None:
            self.after()
        return collect_results(self.spec, self.plan, results)


def first_failure(*calls: PendingCall) -> None:
    """Wait until every call has ended or one has failed, and raise that one's error (its group's `result()`):
    for calls that meet in one collective, where a failed side leaves the others blocked until their timeout.
    Past the longest group timeout it returns, and each call's `result()` reports its own timeout."""
    import ray

    pending = {ref: call for call in calls for ref in call.refs}
    deadline = time.monotonic() + max(call.group.timeout_s for call in calls)
    while pending and time.monotonic() < deadline:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in ready:
            call = pending.pop(ref)
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - the group's own wrapping (WorkerError, the rank named) raises
                call.result(timeout_s=1.0)


def _with_env(worker_cls: type) -> type:
    """`worker_cls` whose constructor first puts the rank's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
    MEGAPPO_GROUP, MEGAPPO_DEVICE / CUDA_VISIBLE_DEVICES) into os.environ, then runs as before. Not Ray's runtime_env: a per-rank env is a distinct
    runtime env, and Ray starts a fresh process for each, while an actor without one takes an idle worker
    Ray already started when the driver connected (one per CPU, otherwise left unused): start-up saves a
    process launch per rank and the idle workers' wasted imports."""

    def __init__(self, env: dict, *args, **kwargs):
        os.environ.update(env)
        worker_cls.__init__(self, *args, **kwargs)

    # a class made here is pickled by value (cloudpickle), its base by reference; the name stays the
    # worker's own (Ray's process titles, error messages)
    return type(worker_cls.__name__, (worker_cls,), {"__init__": __init__, "__module__": __name__,
                                                      "__qualname__": f"_with_env.{worker_cls.__qualname__}"})


class RayWorkerGroup:
    def __init__(self, resource_pool: RayResourcePool, worker_cls: type, args: Sequence = (),
                 kwargs: Optional[dict] = None, name: str = "worker", world_size: Optional[int] = None,
                 timeout_s: float = 600.0, spawn_timeout_s: Optional[float] = None,
                 env: Optional[dict] = None, actor_options: Optional[dict] = None):
        import ray

        self.name = name
        self.pool = resource_pool
        self.worker_cls = worker_cls
        self.timeout_s = float(timeout_s)
        self.world_size = world_size or resource_pool.world_size
        if self.world_size > resource_pool.world_size:
            raise ValueError(f"group {name!r}: {self.world_size} workers but pool {resource_pool.name!r} "
                             f"has {resource_pool.world_size} bundles")
        self.specs: dict[str, DispatchSpec] = registered_methods(worker_cls)
        self.topology: Optional[MegatronTopology] = None
        self.workers: list = []
        self.infos: list[dict] = []
        self._broken: Optional[str] = None
        self._bundles: list[Bundle] = resource_pool.bundles[: self.world_size]
        self._remote_cls = ray.remote(_with_env(worker_cls))
        self._spawn(tuple(args), dict(kwargs or {}), dict(env or {}), dict(actor_options or {}),
                    float(spawn_timeout_s if spawn_timeout_s is not None else timeout_s))
        for method, spec in self.specs.items():
            if not hasattr(type(self), method):  # a group may wrap a method explicitly (init_model below)
                setattr(self, method, functools.partial(self._call_registered, method))

    # ------------------------------------------------------------------ spawning
    def _spawn(self, args: tuple, kwargs: dict, env: dict, actor_options: dict, timeout_s: float) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = {**self.pool.worker_resources(), **{k: v for k, v in actor_options.items()
                                                         if k in ("num_cpus", "num_gpus", "resources")}}
        other_options = {k: v for k, v in actor_options.items() if k not in ("num_cpus", "num_gpus", "resources")}
        # the pool's device decides the workers' (MEGAPPO_DEVICE; CPU workers see no GPU even on a GPU node)
        base_env = {"WORLD_SIZE": str(self.world_size), "MEGAPPO_GROUP": self.name,
                    **device.worker_env("cuda" if self.pool.use_gpu else "cpu"), **env}
        if self.pool.single_node:
            base_env.setdefault("MASTER_ADDR", "127.0.0.1")

        def start(rank: int, extra_env: dict):
            b = self._bundles[rank]
            return self._remote_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(b.pg, placement_group_bundle_index=b.index),
                name=None, **resources, **other_options,
            ).remote({**base_env, **extra_env, "RANK": str(rank)}, *args, **kwargs)

        def describe(rank: int) -> str:
            b = self._bundles[rank]
            return (f"group {self.name!r} rank {rank} (pool {self.pool.name!r} bundle {b.index} {dict(b.resources)} "
                    f"on node {b.node_id[:12]}, asked {resources})")

        if self.pool.single_node and self._bundles[0].node_id == ray.get_runtime_context().get_node_id():
            # the pool is on the driver's node: pick the port here and start every rank at once
            from megappo.parallel.launch import free_port

            master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            self.workers = [start(r, master) for r in range(self.world_size)]
            self.infos = self._await_infos(list(range(self.world_size)), describe, timeout_s)
            return
        # Rank 0 first: it picks MASTER_ADDR/PORT on its node (empty: not whatever the node's env exports);
        # the others are started with them.
        self.workers = [start(0, {"MASTER_ADDR": "", "MASTER_PORT": ""})]
        info0 = self._await_infos([0], describe, timeout_s)[0]
        master = {"MASTER_ADDR": info0["master_addr"], "MASTER_PORT": str(info0["master_port"])}
        self.workers += [start(r, master) for r in range(1, self.world_size)]
        self.infos = [info0] + self._await_infos(list(range(1, self.world_size)), describe, timeout_s)

    def _await_infos(self, ranks: list[int], describe, timeout_s: float) -> list[dict]:
        import ray

        refs = [self.workers[r].info.remote() for r in ranks]
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()))
            if pending and time.monotonic() >= deadline:
                stuck = [ranks[refs.index(p)] for p in pending]
                self.shutdown()
                avail = ray.available_resources()
                raise WorkerError(
                    f"{describe(stuck[0])} did not start within {timeout_s:g}s"
                    + (f" (and {len(stuck) - 1} more ranks)" if len(stuck) > 1 else "")
                    + ": actor still pending, not enough resources left in its bundle? cluster available "
                    f"{{CPU: {avail.get('CPU', 0):g}, GPU: {avail.get('GPU', 0):g}}}"
                ) from None
        out = []
        for r, ref in zip(ranks, refs):
            try:
                out.append(ray.get(ref, timeout=max(1.0, deadline - time.monotonic())))
            except ray.exceptions.RayActorError as e:
                self.shutdown()
                raise WorkerError(f"{describe(r)} died while starting: {_first_line(e)}") from e
        return out

    # ------------------------------------------------------------------ calling
    def worker_label(self, rank: int) -> str:
        info = self.infos[rank] if rank < len(self.infos) else {}
        return f"group {self.name!r} rank {rank} (node {info.get('node_ip', '?')}, pid {info.get('pid', '?')})"

    def _submit(self, method: str, plan: CallPlan) -> list:
        if self._broken:
            raise WorkerError(f"group {self.name!r} is unusable after an earlier failure ({self._broken}); "
                              "shut it down and create a new one")
        return [getattr(w, method).remote(*a, **k) for w, a, k in zip(self.workers, _put_shared(plan.args),
                                                                       _put_shared(plan.kwargs))]

    def _wait(self, refs: list, method: str, timeout_s: Optional[float] = None) -> list:
        """ray.get every ref with one deadline; the first death / error / the timeout raises."""
        import ray

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        index = {ref: i for i, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                stuck = sorted(index[p] for p in pending)
                self._broken = f"{method} timed out"
                raise WorkerError(
                    f"group {self.name!r}: {method} did not finish within {timeout_s:g}s on "
                    f"{len(stuck)} of {len(refs)} workers; first: {self.worker_label(stuck[0])}"
                )
            for ref in ready:
                rank = index[ref]
                try:
                    results[rank] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
                except ray.exceptions.RayActorError as e:
                    self._broken = f"rank {rank} died in {method}"
                    raise WorkerError(f"{self.worker_label(rank)} died during {method}: {_first_line(e)}") from None
                except ray.exceptions.RayTaskError as e:
                    e.add_note(f"raised by {self.worker_label(rank)} in {method}")
                    raise
        return results

    def dead_worker(self, timeout_s: float = 30.0) -> Optional[str]:
        """'<worker> died' for the first worker whose process is gone (None if none is). A collective
        whose peer was killed fails in the survivor with an ordinary RayTaskError ("Connection reset by
        peer"); this tells that apart from a bug in the worker's code (then the others merely wait in
        the collective: they do not answer, but they are alive, and the error propagates)."""
        import ray

        refs = [w.info.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError:
                    self._broken = self._broken or f"rank {rank} died"
                    return f"{self.worker_label(rank)} died"
        return None

    def _call_registered(self, method: str, *args, **kwargs) -> Any:
        return self.submit(method, *args, **kwargs).result()

    def submit(self, method: str, *args, **kwargs) -> PendingCall:
        """Start a registered method on the workers without waiting (e.g. async rollout)."""
        if method not in self.specs:
            raise AttributeError(f"{self.worker_cls.__name__}.{method} is not a @register-ed worker method "
                                 f"(registered: {sorted(self.specs)})")
        spec = self.specs[method]
        plan = plan_call(spec, self.world_size, self.topology, args, kwargs, method)
        return PendingCall(self, method, spec, plan, self._submit(method, plan))

    def execute_all(self, method: str, *args, **kwargs) -> list:
        """Call any worker method (registered or not) on every worker with the same args; results by rank."""
        plan = CallPlan([tuple(args)] * self.world_size, [dict(kwargs)] * self.world_size)
        return self._wait(self._submit(method, plan), method)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self, release_timeout_s: float = 3.0) -> None:
        """Kill every worker; first give the started ones `release_timeout_s` to undo what a kill would leave
        behind (Worker.release: files on tmpfs; a dead rank answers at once, a hung one costs the bound)."""
        import ray

        if self.workers and len(self.infos) == len(self.workers):
            try:
                ray.wait([w.release.remote() for w in self.workers], num_returns=len(self.workers),
                         timeout=release_timeout_s)
            except Exception:  # noqa: BLE001 - Ray itself going down: kill what can be killed
                pass
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.workers = []
        self._broken = self._broken or "shut down"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, world_size={self.world_size}, worker={self.worker_cls.__name__})"


class NVMegatronRayWorkerGroup(RayWorkerGroup):
    """A RayWorkerGroup whose workers run megatron: after init_model it knows each rank's (dp, pp, tp)
    and can use the MEGATRON_COMPUTE / MEGATRON_PP_AS_DP dispatch modes."""

    def init_model(self, *args, **kwargs) -> list:
        """Workers' init_model (ONE_TO_ALL), then read every rank's megatron (dp, pp, tp)."""
        return self.submit("init_model", *args, **kwargs).result()

    def submit(self, method: str, *args, **kwargs) -> PendingCall:
        call = super().submit(method, *args, **kwargs)
        if method == "init_model":
            call.after = self.refresh_topology
        return call

    def refresh_topology(self) -> MegatronTopology:
        coords = self.execute_all("megatron_coords")
        self.topology = MegatronTopology(tuple(tuple(int(x) for x in c) for c in coords))
        return self.topology

    @property
    def dp_size(self) -> int:
        return self._topo().dp_size

    @property
    def pp_size(self) -> int:
        return self._topo().pp_size

    @property
    def tp_size(self) -> int:
        return self._topo().tp_size

    def _topo(self) -> MegatronTopology:
        if self.topology is None:
            raise RuntimeError(f"group {self.name!r}: call init_model() first (coordinates unknown)")
        return self.topology


def _first_line(e: BaseException) -> str:
    """One line: the exception's first line, plus its last line when that names the root cause."""
    text = [t.strip() for t in str(e).strip().splitlines() if t.strip()]
    if not text:
        return type(e).__name__
    return text[0] if len(text) == 1 else f"{text[0]} ... {text[-1]}"


def _put_shared(items: list) -> list:
    """ray.put each DataProto (or other large value) that several ranks receive once, and pass the ref:
    the tp/pp ranks of one dp group then share one object-store copy of their chunk."""
    import ray

    from megappo.protocol import DataProto

    cache: dict[int, Any] = {}

    def share(v):
        if isinstance(v, DataProto):
            if id(v) not in cache:
                cache[id(v)] = ray.put(v)
            return cache[id(v)]
        return v

    out = []
    for item in items:
        if isinstance(item, dict):
            out.append({k: share(v) for k, v in item.items()})
        else:
            out.append(tuple(share(v) for v in item))
    return out
