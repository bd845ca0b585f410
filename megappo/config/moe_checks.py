"""The config checks of a mixture-of-experts run (validate.py calls them): the MoE knobs, and routing replay
(actor.router_replay) with what the rollout's route capture covers, which the rollout itself checks too
(workers/rollout/vllm_rollout.py), from the one rule here."""

from __future__ import annotations

from typing import Optional

from megappo.config.errors import ConfigError
from megappo.config.schema import recomputes_old_log_probs
from megappo.parallel.model_dims import ModelDims


def route_capture_problem(enforce_eager: bool) -> Optional[str]:
    """Why actor.router_replay=r3 cannot capture the rollout's routes (one line), or None. The capture is a Python
    hook that vLLM's routers call in each forward (workers/rollout/route_capture.py), the same on every device and in
    every trainer.mode: only an eager engine calls it (a CUDA graph replays the kernels without Python;
    torch.compile, on CPU too, traces the hook into its graph or away)."""
    if not enforce_eager:
        return ("actor.router_replay=r3 captures routes through vLLM's router hook, which CUDA graphs and "
                "torch.compile skip: set rollout.enforce_eager=true (the default), or actor.router_replay=r2")
    return None


def check_moe(cfg, dims: ModelDims) -> None:
    m = cfg.model.moe
    for key in ("aux_loss_coeff", "z_loss_coeff"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.moe.{key}={getattr(m, key)} must be >= 0 (0 = off)")
    if not dims.num_experts:
        return
    if m.token_dispatcher == "flex" and cfg.resources.device == "cpu":
        raise ConfigError("model.moe.token_dispatcher=flex needs DeepEP on GPUs; use alltoall on CPU")
    eps = {role: getattr(cfg, role).parallel.ep for role in ("actor", "critic", "ref")}
    if m.token_dispatcher == "allgather" and max(eps.values()) > 1:
        raise ConfigError("model.moe.token_dispatcher=allgather needs the same token count on every rank of an "
                          "expert-parallel group, which right-aligned micro-batches do not have; use alltoall")


def check_router_replay(cfg, dims: ModelDims) -> None:
    mode = cfg.actor.router_replay
    if mode == "off":
        return
    if not dims.num_experts:
        raise ConfigError(f"actor.router_replay={mode} replays mixture-of-experts routes, and {cfg.model.path} is a "
                          "dense model: set actor.router_replay=off")
    if mode == "r3":
        problem = route_capture_problem(cfg.rollout.enforce_eager)
        if problem:
            raise ConfigError(problem)
        return
    if not recomputes_old_log_probs(cfg.actor):
        raise ConfigError("actor.router_replay=r2 replays the routes of the pi_old forward, which this config skips "
                          "(actor.use_rollout_log_probs=true or actor.proximal=loglinear): set "
                          "actor.use_rollout_log_probs=false and actor.proximal=recompute, or actor.router_replay=off")
