"""The trainer's worker groups: resource pools, one NVMegatronRayWorkerGroup per role (roles that share a
layout share processes: the hybrid engine's actor + rollout (+ ref, + critic with resources.colocate)),
models, then vLLM engines and, in the async modes, the weight-sync group; their teardown, and which dead
worker an error came from. RayPPOTrainer's (ppo/ray_trainer.py) through WorkersMixin: it reads
self.config / self.async_mode and sets self.groups and the *_wg attributes the loop calls.

WarmWorkers keeps a run's worker groups up for the next run that would build the same workers (the tests
that share a layout; a sweep over learning rates or algorithms): that run starts from the workers as built
(each process's `reset_run`) instead of starting processes, models and vLLM engines again."""

from __future__ import annotations

import time
from typing import Optional

from megappo.parallel.layout import same_layout
from megappo.workers.roles import Role, fused_role  # Role: what a worker group does (one group per role)

# What a new run on warm workers may change: keys the workers read per call or never (the driver's data,
# rewards, algorithm and schedule; the update's batch sizes and loss), and the optimizers' hyper-parameters (the
# reset rebuilds the schedule and zeroes the state; distributed_optimizer is not one: the DP wrapper is built
# with it). Every other key builds something in the workers (model, layouts, engines, vLLM, the modes).
_RUN_PREFIXES = ("algorithm.", "reward.", "data.")
_BUILD_KEYS = ("reward.model.", "data.max_prompt_length")  # under those prefixes, but the workers build from them
_OPTIM_RUN_KEYS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "lr_schedule",
                   "warmup_steps")
_RUN_KEYS = {f"trainer.{k}" for k in ("total_steps", "output_dir", "resume", "save_every", "async_save", "val_every",
                                      "project", "experiment", "loggers", "max_restarts", "export_hf",
                                      "phase_timeout_s", "worker_timeout_s", "max_staleness", "partial_rollout",
                                      "pause_mode", "rollout_check", "rollout_check_steps", "rollout_check_every",
                                      "rollout_logprob_bound")} | \
    {f"{role}.optim.{k}" for role in ("actor", "critic") for k in _OPTIM_RUN_KEYS} | \
    {f"actor.{k}" for k in ("ppo_mini_batch_size", "micro_batch_size", "log_prob_micro_batch_size", "ppo_epochs",
                            "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff",
                            "loss_agg_mode", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "use_rollout_log_probs",
                            "policy_loss", "behav_imp_weight_cap", "proximal")} | \
    {f"critic.{k}" for k in ("ppo_mini_batch_size", "micro_batch_size", "ppo_epochs", "cliprange_value")} | \
    {"ref.log_prob_micro_batch_size", "rollout.n", "teacher.log_prob_micro_batch_size"} | \
    {f"teacher.{k}" for k in ("endpoint", "endpoint_model", "api_key_env", "concurrency", "timeout_s", "retries",
                              "backoff_s")}  # a teacher server: the driver's client
_WORKER_ATTRS = ("groups", "resource_pool_manager", "actor_wg", "critic_wg", "ref_wg", "rm_wg", "teacher_wg",
                 "rollout_wg")


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def build_key(cfg) -> Optional[tuple]:
    """What the workers of `cfg`'s run are built from (its keys less the run-level ones); None when its workers
    cannot be reused: adapter sync (vLLM keeps every adapter id it was given) or a fully_async pool at
    rollout.tp > 1 (the lockstep follower replays one stream for the worker's life)."""
    from omegaconf import OmegaConf

    if cfg.rollout.lora_sync == "adapter" and cfg.actor.lora.rank > 0 or \
            cfg.trainer.mode == "fully_async" and cfg.rollout.tp > 1:
        return None
    flat = _flat(OmegaConf.to_container(cfg, resolve=True))
    return tuple(sorted((k, repr(v)) for k, v in flat.items()
                        if k.startswith(_BUILD_KEYS) or not (k.startswith(_RUN_PREFIXES) or k in _RUN_KEYS)))


class WarmWorkers:
    """Worker groups kept up between trainer runs: `RayPPOTrainer(cfg, warm=warm)` for each run. A run whose
    `build_key` equals the kept one's takes its groups and resets them (~10x faster than starting them on CPU);
    another run ends them and keeps its own when it shuts down cleanly. A reset run equals a fresh start step
    for step (tests/test_trainer.py). `close()` ends what is kept."""

    def __init__(self):
        self._kept: Optional[tuple] = None  # (build key, {attribute: value} of the trainer's workers)
        self.reused = self.started = 0

    def take(self, cfg) -> Optional[dict]:
        key = build_key(cfg)
        if key is not None and self._kept is not None and self._kept[0] == key:
            parts, self._kept = self._kept[1], None
            self.reused += 1
            return parts
        self.close()  # another config's workers: their resources go to this run's
        self.started += 1
        return None

    def keep(self, cfg, parts: dict) -> None:
        self.close()
        self._kept = (build_key(cfg), parts)

    def close(self) -> None:
        if self._kept is not None:
            parts, self._kept = self._kept[1], None
            for g in parts["groups"]:
                g.shutdown()
            parts["resource_pool_manager"].remove()


class WorkersMixin:
    def init_workers(self) -> None:
        """Pools (Ray placement groups), one worker group per role (roles that share a layout share
        processes), models, then vLLM engines."""
        from megappo.controller.resource_pool import ResourcePoolManager
        from megappo.controller.worker_group import NVMegatronRayWorkerGroup, RayWorkerGroup
        from megappo.workers.roles import (ActorCriticWorker, ActorRolloutRefWorker, CriticWorker, RewardModelWorker,
                                           TeacherWorker)

        cfg, res = self.config, self.config.resources
        if self._reuse_warm_workers():
            return
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
        if cfg.teacher.model:  # resources.teacher_workers: a pool of its own
            mapping[Role.Teacher] = "teacher" if res.teacher_workers else "train"
            if res.teacher_workers:
                spec["teacher"] = [res.teacher_workers]
        if self.async_mode:
            spec["rollout"] = [res.rollout_workers]
            mapping[Role.Rollout] = "rollout"
        mgr = self.resource_pool_manager = ResourcePoolManager(spec, mapping, use_gpu=self.on_gpu(),
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
        self.teacher_wg = group(TeacherWorker, "teacher", pool=mgr.pools[mapping[Role.Teacher]]) \
            if cfg.teacher.model else None
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
        if self.warm is not None and build_key(cfg) is not None:  # what reset_run will put back
            for c in [g.submit("keep_initial_state") for g in self.groups]:
                c.result(timeout_s=t.worker_timeout_s)

    def on_gpu(self) -> bool:
        """One decision for every worker (parallel/device.py): resources.device, auto = GPUs when the Ray cluster
        has them."""
        import ray

        from megappo.parallel import device
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        return device.resolve(self.config.resources.device, gpus_available=gpus) == "cuda"

    def _reuse_warm_workers(self) -> bool:
        """Take warm workers built for this config and reset them for this run (WarmWorkers)."""
        parts = self.warm.take(self.config) if self.warm is not None else None
        if parts is None:
            return False
        t0 = time.perf_counter()
        for name, value in parts.items():
            setattr(self, name, value)
        for g in self.groups:
            g.timeout_s = self.config.trainer.phase_timeout_s
        for c in [g.submit("reset_run", self.config) for g in self.groups]:
            c.result()
        self.startup_s = {"reset": time.perf_counter() - t0}
        return True

    def shutdown(self, stop_ray: bool = False) -> None:
        """Stop every worker group and release the pools (or hand them to `self.warm` after a run that
        ended cleanly); give the preemption signals back; with `stop_ray`, Ray too (~1.3 s, while fit's
        reward-curve PNG is still being drawn). Returns once the PNG is written."""
        if self.warm is not None and self.clean_finish and self.groups and build_key(self.config) is not None:
            self.warm.keep(self.config, {name: getattr(self, name) for name in _WORKER_ATTRS})
            self.groups, self.resource_pool_manager = [], None
        self._teardown_workers()
        if self.teacher_endpoint is not None:
            self.teacher_endpoint.close()
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
