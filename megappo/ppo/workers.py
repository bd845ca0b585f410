"""The trainer's worker groups: resource pools, one NVMegatronRayWorkerGroup per role (roles that share a
layout share processes: the hybrid engine's actor + rollout (+ ref, + critic with resources.colocate)),
models, then vLLM engines and, in the async modes, the weight-sync group; their teardown, and which dead
worker an error came from. RayPPOTrainer's (ppo/ray_trainer.py) through WorkersMixin: it reads
self.config / self.async_mode and sets self.groups and the *_wg attributes the loop calls."""

from __future__ import annotations

import time

from megappo.parallel.layout import same_layout
from megappo.workers.roles import Role, fused_role  # Role: what a worker group does (one group per role)


class WorkersMixin:
    def init_workers(self) -> None:
        """Pools (Ray placement groups), one worker group per role (roles that share a layout share
        processes), models, then vLLM engines."""
        from megappo.controller.resource_pool import ResourcePoolManager
        from megappo.controller.worker_group import NVMegatronRayWorkerGroup, RayWorkerGroup
        from megappo.workers.roles import ActorCriticWorker, ActorRolloutRefWorker, CriticWorker, RewardModelWorker

        cfg, res = self.config, self.config.resources
        # actor.lora: the reference is the actor's own base (adapters off) in the actor's processes, never a model
        # of its own (ref.parallel unused)
        fuse_ref = cfg.ref.enable and (cfg.actor.lora.rank > 0 or same_layout(cfg.ref.parallel, cfg.actor.parallel))
        # resources.colocate: the critic joins the actor's processes when it has the actor's layout
        # (one megatron world, one process per device: no contention, no second set of imports)
        fuse_critic = cfg.critic.enable and res.colocate and same_layout(cfg.critic.parallel, cfg.actor.parallel)
        actor_kind = fused_role(actor=True, rollout=not self.async_mode, ref=fuse_ref)
        spec = {"train": [res.workers_per_node] * res.nodes}
        mapping = {Role.ActorRolloutRef if fuse_ref else Role.ActorRollout: "train"}
        if cfg.critic.enable and not fuse_critic:
            mapping[Role.Critic] = "train"
        if cfg.ref.enable and not fuse_ref:
            mapping[Role.RefPolicy] = "train"
        if cfg.reward.model.enable:
            mapping[Role.RewardModel] = "train"
        if self.async_mode:
            spec["rollout"] = [res.rollout_workers]
            mapping[Role.Rollout] = "rollout"
        # one decision for every worker (parallel/device.py): auto = GPUs when the Ray cluster has them
        import ray

        from megappo.parallel import device
        use_gpu = device.resolve(res.device, gpus_available=ray.cluster_resources().get("GPU", 0) > 0) == "cuda"
        mgr = self.resource_pool_manager = ResourcePoolManager(spec, mapping, use_gpu=use_gpu,
                                                               cpus_per_bundle=res.cpus_per_worker)
        mgr.create_resource_pool()
        print(f"placement: {mgr.describe()}", flush=True)
        pool, t = mgr.pools["train"], cfg.trainer
        t0 = time.perf_counter()

        def group(cls, name, *args, wg_cls=NVMegatronRayWorkerGroup, pool=pool):
            wg = wg_cls(pool, cls, args=(cfg, *args), name=name, timeout_s=t.phase_timeout_s,
                        spawn_timeout_s=t.worker_timeout_s)
            self.groups.append(wg)
            return wg

        self.actor_wg = group(ActorCriticWorker if fuse_critic else ActorRolloutRefWorker, "actor", actor_kind)
        self.critic_wg = (self.actor_wg if fuse_critic else group(CriticWorker, "critic")) if cfg.critic.enable \
            else None
        self.ref_wg = (self.actor_wg if fuse_ref else group(ActorRolloutRefWorker, "ref", Role.RefPolicy)) \
            if cfg.ref.enable else None
        self.rm_wg = group(RewardModelWorker, "rm") if cfg.reward.model.enable else None
        self.rollout_wg = group(ActorRolloutRefWorker, "rollout", Role.Rollout, wg_cls=RayWorkerGroup,
                                pool=mgr.pools["rollout"]) if self.async_mode else self.actor_wg
        t1 = time.perf_counter()
        for call in [g.submit("init_model") for g in self.groups]:  # every megatron world comes up at once
            call.result(timeout_s=t.worker_timeout_s)
        t2 = time.perf_counter()
        self.rollout_wg.submit("init_rollout").result(timeout_s=t.worker_timeout_s)
        # where start-up goes: worker processes (spawn + imports), megatron worlds + models, vLLM engines
        self.startup_s = {"processes": t1 - t0, "models": t2 - t1, "vllm": time.perf_counter() - t2}
        if self.async_mode:
            host, port = self.actor_wg.weight_sync_address()[0]
            world = 1 + self.rollout_wg.world_size
            calls = [g.submit("init_weight_sync", host, port, world) for g in (self.actor_wg, self.rollout_wg)]
            for c in calls:
                c.result()

    def shutdown(self, stop_ray: bool = False) -> None:
        """Stop every worker group and release the pools; give the preemption signals back; with
        `stop_ray`, Ray too (~1.3 s, while fit's reward-curve PNG is still being drawn). Returns once
        the PNG is written."""
        self._teardown_workers()
        self.preemption.uninstall()
        if stop_ray:
            import ray

            ray.shutdown()
        self._wait_for_plot()

    def _dead_worker_behind(self, err: Exception):
        """A worker's exception that a dead peer caused (a collective with a killed process: "Connection
        reset by peer") as the WorkerError naming the dead one; None when every worker is alive (a bug)."""
        import ray

        from megappo.controller.resource_pool import WorkerError

        if not isinstance(err, ray.exceptions.RayTaskError):
            return None
        for g in self.groups:
            dead = g.dead_worker()
            if dead is not None:
                e = WorkerError(f"{dead} (seen as {type(err).__name__} in another worker: "
                                f"{str(err).strip().splitlines()[-1][:200]})")
                e.__cause__ = err
                return e
        return None

    def _teardown_workers(self) -> None:
        for g in self.groups:
            g.shutdown()
        self.groups = []
        if self.resource_pool_manager is not None:
            self.resource_pool_manager.remove()
            self.resource_pool_manager = None
