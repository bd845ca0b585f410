"""reward.judge.model: the judge on an engine of megappo's own. A Ray actor on this node (its own process, on
reward.judge.gpus GPUs: 0 = the CPU) holds a vLLM engine of the HF dir and serves it as `megappo serve` does
(gateway/app.Gateway over an AsyncTokenEngine) on loopback, under a key made here and never shown; JudgeReward
(rewards/judge.py) asks that URL as it asks any endpoint, so every scoring path is the endpoint's code.

    engine = JudgeEngine.start(cfg.reward.judge)   # returns once the server answers; ValueError in one line
    engine.url, engine.key                         # http://127.0.0.1:PORT/v1, the key
    engine.stop()                                  # the actor (and its GPU) goes

Not colocated with the rollout (sharing its GPUs by sleep mode): a GPU of the node is the judge's alone.
Starts a local Ray when none runs here (`megappo reward`) and stops it with the engine.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

START_TIMEOUT_S = 900  # placement, vLLM's import, the weights' load and the server's start


class StartFailed(RuntimeError):
    """The engine did not build: what vLLM said, in one line."""


class _JudgeServer:
    """The actor: the process's device environment first (parallel/device.worker_env), then the engine and its
    server (`start`); uvicorn answers from a thread of this process."""

    def __init__(self, env: dict):
        os.environ.update(env)
        self.server = None

    def start(self, model: str, name: str, key: str, max_model_len: int, max_tokens: int, dtype,
              gpu_memory_utilization: float, kv_cache_memory_mb: int) -> str:
        from megappo.config.schema import RolloutConfig
        from megappo.gateway.app import Gateway, make_app
        from megappo.gateway.serve import GatewayServer
        from megappo.workers.rollout.async_engine import AsyncTokenEngine
        from megappo.workers.rollout.vllm_rollout import VLLMRollout

        engine = RolloutConfig(max_new_tokens=max_tokens, gpu_memory_utilization=gpu_memory_utilization,
                               kv_cache_memory_mb=kv_cache_memory_mb, free_cache_engine=False)  # never put to sleep
        try:
            rollout = VLLMRollout(model, engine, dtype=dtype, max_model_len=max_model_len)
        except Exception as e:  # noqa: BLE001 - what vLLM says, as one line (its own may span many, or not pickle)
            raise StartFailed(f"{type(e).__name__}: {' '.join(str(e).split())[:400]}") from None
        gateway = Gateway(AsyncTokenEngine.for_llm(rollout.llm), rollout.tokenizer, model_name=name,
                          max_model_len=max_model_len, max_tokens=max_tokens, open_key=key)
        self.server = GatewayServer(make_app(gateway))
        return self.server.start() + "/v1"


class JudgeEngine:
    def __init__(self, actor, url: str, key: str, own_ray: bool):
        self.actor, self.url, self.key, self.own_ray = actor, url, key, own_ray

    @classmethod
    def start(cls, judge) -> "JudgeEngine":
        """reward.judge's engine, up and answering; ValueError in one line naming the fix."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from megappo.model_dirs import positions_of
        from megappo.parallel import device
        from megappo.utils.ray_env import one_line, setup_env

        where = f"reward.judge.model={judge.model}"
        positions = positions_of(judge.model)
        max_model_len = judge.max_model_len or positions
        if max_model_len > positions:
            raise ValueError(f"reward.judge.max_model_len={max_model_len} exceeds the judge's {positions} positions "
                             "(config.json max_position_embeddings); lower it or leave it out")
        own_ray = not ray.is_initialized()
        if own_ray:
            setup_env()  # as `megappo train` starts its Ray
            ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
        node = ray.get_runtime_context().get_node_id()  # loopback: the driver's node
        node_gpus = next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == node), 0)
        gpus = (1 if node_gpus else 0) if judge.gpus is None else judge.gpus
        engine = cls(None, "", "mp-judge-" + secrets.token_urlsafe(24), own_ray)
        try:
            if gpus > node_gpus:
                raise ValueError(f"reward.judge.gpus={gpus} but this node has {node_gpus:g} GPUs in Ray; set "
                                 "reward.judge.gpus=0 to run the judge on the CPU")
            engine.actor = ray.remote(_JudgeServer).options(
                num_cpus=0, num_gpus=gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(device.worker_env("cuda" if gpus else "cpu"))
            call = engine.actor.start.remote(str(judge.model), Path(judge.model).resolve().name, engine.key,
                                             max_model_len, min(judge.max_tokens, max_model_len - 1), judge.dtype,
                                             judge.gpu_memory_utilization, judge.kv_cache_memory_mb)
            try:
                engine.url = ray.get(call, timeout=START_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise ValueError(f"{where}: the judge's engine did not start in {START_TIMEOUT_S} s (no room for it "
                                 f"on this node: {gpus} GPUs, or a slow load); free a GPU here, or serve it yourself "
                                 "(megappo serve) and set reward.judge.endpoint") from None
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None)
                why = str(cause) if isinstance(cause, StartFailed) else one_line(e)
                raise ValueError(f"{where}: the judge's engine failed to start ({why})") from None
            return engine
        except BaseException:
            engine.stop()
            raise

    def stop(self) -> None:
        """The actor killed (its engine, server and GPU with it), and a Ray this started."""
        import ray

        if self.actor is not None:
            ray.kill(self.actor)
            try:  # returns once Ray holds it dead: a call after the kill fails then
                ray.get(self.actor.__ray_ready__.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            self.actor = None
        if self.own_ray:
            ray.shutdown()
            self.own_ray = False


def start_judges(scorers: dict) -> list:
    """Start reward.judge.model's engine among `scorers` (rewards/rules.load_rewards' {data_source: Rule}) and
    point its judge at it; the judges started, to `close()` at shutdown (the trainer, `megappo reward`)."""
    from megappo.rewards.judge import judges_of

    started = []
    try:
        for judge in judges_of(scorers):
            if judge.cfg.model and judge.engine is None:
                judge.attach(JudgeEngine.start(judge.cfg))
                started.append(judge)
    except BaseException:
        for judge in started:
            judge.close()
        raise
    return started
