"""The PPO workers the driver talks to, on top of MegatronEngine (one engine per model per process).

- ActorRolloutRefWorker(config, role): role (a `Role`, or its value) is one of "actor", "rollout", "ref",
  "actor_rollout" (hybrid engine), "actor_ref" or "actor_rollout_ref". Fused roles share one process, one
  torch.distributed world and one megatron parallel_state (so a fused ref uses the actor's layout); a
  separate ref group uses `ref.parallel`. A "rollout" worker (async mode's rollout pool) holds only a
  vLLM engine: no megatron; its group's torch.distributed world is brought up when it has > 1 worker.
  The vLLM engine is built by `init_rollout()` (after `init_model()`), so groups that never generate
  pay nothing for it.
- CriticWorker(config): value model (megatron GPT + value head), init from `model.critic_path` (a causal
  LM or a *ForSequenceClassification dir) or `model.path`.
- RewardModelWorker(config): a HF *ForSequenceClassification reward model (num_labels=1) that shares the
  policy's vocab (checked: a different vocab is a ValueError).

Batch keys (DataProto, one row per sequence; prompts left-padded, responses right-padded):
  in:   input_ids [B, S], attention_mask [B, S], responses [B, R] (R = response length, the last R
        columns of input_ids), optional position_ids [B, S]
  out:  compute_log_prob -> old_log_probs [B, R], entropy [B, R]
        compute_ref_log_prob -> ref_log_prob [B, R]
        compute_values -> values [B, R]
        compute_rm_score -> rm_scores [B] (the RM's score at the last valid token)
        generate_sequences(prompts) -> vllm_rollout.py's output (responses, response_mask,
        rollout_log_probs, stopped, ...; meta_info["metrics"]: rollout/*, timing/*), from rank 0
  update_actor(data, loss) / update_critic(data, loss): the loss (megappo.ppo.losses, built by the
  driver) names the keys it needs (the actor's: old_log_probs, advantages, response_mask, +
  ref_log_prob with actor.use_kl_loss, + rollout_log_probs for truncated importance sampling when
  present; the critic's: values, returns, response_mask). Both return a metrics dict (same on every
  rank) and do not pad: the batch must be a multiple of dp and of ppo_mini_batch_size / dp.
  Log-probs are taken at the temperature of the SamplingSpec in meta_info["sampling"] (1 without one).

Every method is declared with @register: ONE_TO_ALL for init/checkpoints/generation (every rank gets
the whole prompt batch; the vLLM replicas split it themselves, see hybrid_engine.replicated_generate,
because rollout replicas = world / rollout.tp, not megatron's dp), MEGATRON_COMPUTE for the batch
methods (the group pads, splits by dp and reads tp==0 on the last pp stage).

Async weight sync (see rollout/weight_sync.py): `weight_sync_address()` on the actor group, then
`init_weight_sync(host, port, world)` on the actor and rollout groups concurrently; per step
`send_weights()` (actor) together with `receive_weights()` (rollout).
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import Optional

from megappo.controller.dispatch import Dispatch, register
from megappo.controller.worker import Worker
from megappo.protocol import DataProto

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "ActorCriticWorker", "RewardModelWorker", "ACTOR_ROLES",
           "Role", "fused_role", "check_reward_model_vocab", "TeacherWorker"]


class Role(str, Enum):
    """What a worker does, one vocabulary: ppo/ray_trainer.py keys its resource pools by the members, an
    ActorRolloutRefWorker is given one (or its value), and the workers report the values."""

    Actor = "actor"
    Rollout = "rollout"
    ActorRollout = "actor_rollout"  # hybrid engine: actor + rollout in one process
    Critic = "critic"
    RefPolicy = "ref"
    RewardModel = "reward_model"
    Teacher = "teacher"  # on-policy distillation's frozen teacher (teacher.model)
    ActorRolloutRef = "actor_rollout_ref"  # actor + rollout + ref in one process
    ActorRef = "actor_ref"  # async mode's actor with the ref fused (the rollout is a pool of its own)


# an ActorRolloutRefWorker's role <-> what it holds: (actor, rollout, ref)
_PARTS = {Role.Actor: (True, False, False), Role.Rollout: (False, True, False), Role.RefPolicy: (False, False, True),
          Role.ActorRollout: (True, True, False), Role.ActorRef: (True, False, True),
          Role.ActorRolloutRef: (True, True, True)}
ACTOR_ROLES = tuple(r.value for r in _PARTS)


def fused_role(actor: bool = False, rollout: bool = False, ref: bool = False) -> Role:
    """The role of an ActorRolloutRefWorker holding these parts in one process."""
    return next(r for r, parts in _PARTS.items() if parts == (actor, rollout, ref))
_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")


def _layout(parallel):
    from megappo.parallel.layout import ParallelLayout

    return ParallelLayout(tp=parallel.tp, pp=parallel.pp, dp=parallel.dp, vpp=parallel.vpp, ep=parallel.ep)


def _response_length(data: DataProto) -> int:
    if "responses" not in data.batch:
        raise KeyError("batch needs 'responses' [B, R] (the last R columns of input_ids) to know the response length")
    return int(data.batch["responses"].shape[1])


def _logprob_temperature(data: DataProto) -> float:
    """The temperature the rows were sampled at: their SamplingSpec travels in meta_info["sampling"]
    (set by the driver, kept by the rollout); rows without one are scored at temperature 1."""
    spec = data.meta_info.get("sampling")
    return 1.0 if spec is None else float(spec.logprob_temperature)


def _forward(engine, data: DataProto, response_length: int, micro_batch_size: int, **kw) -> Optional[dict]:
    """engine.forward_only over this rank's rows, padding them to a multiple of the micro-batch size."""
    n = len(data)
    mbs = max(1, min(int(micro_batch_size), n))
    keys = [k for k in _MODEL_KEYS if k in data.batch]
    padded, _ = data.select(batch_keys=keys, non_tensor_keys=[], meta_info_keys=[]).pad_to_divisor(mbs)
    out = engine.forward_only(dict(padded.batch), response_length=response_length, micro_batch_size=mbs, **kw)
    if out is None:  # not the last pipeline stage: the group does not read this rank
        return None
    return {k: v[:n].cpu() for k, v in out.items()}  # the driver gets CPU tensors


def _dp_all_reduce(values: list[float], op: str = "SUM") -> list[float]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device="cpu")  # over gloo
    if mpu.get_data_parallel_world_size() > 1:
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=mpu.get_data_parallel_group())
    return t.tolist()


def _peak_memory_gb() -> list[float]:
    """This process's peak resident memory (the hybrid engine's vLLM included) and its device's peak allocated
    memory (0 without a GPU), in GB, since the process started."""
    import resource

    import torch

    device = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0
    return [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, device]  # ru_maxrss: KiB on Linux


def _mini_batches(data: DataProto, mini_batch_size: int, dp: int, what: str) -> list[DataProto]:
    if mini_batch_size % dp:
        raise ValueError(f"{what}.ppo_mini_batch_size={mini_batch_size} is not a multiple of dp={dp}")
    local = mini_batch_size // dp
    if len(data) % local:
        raise ValueError(f"{what}: {len(data)} rows per dp rank is not a multiple of the per-rank mini-batch "
                         f"{local} (= ppo_mini_batch_size {mini_batch_size} / dp {dp})")
    return data.split(local)


def _train(engine, data: DataProto, loss, role_cfg, dp: int, temperature: float = 1.0) -> dict:
    """`role_cfg.ppo_epochs` passes over this DP rank's rows in mini-batches, one optimizer step each.
    `loss` (megappo.ppo.losses) says which batch keys it needs, its normaliser and its value; this
    function is the plumbing every loss shares. Returns the metrics averaged over the steps."""
    missing = [k for k in loss.required_keys if k not in data.batch]
    if missing:
        raise KeyError(f"{loss.name} update: batch lacks {missing}")
    keys = [k for k in _MODEL_KEYS if k in data.batch] + list(loss.required_keys) + \
        [k for k in loss.optional_keys if k in data.batch]
    r = _response_length(data)
    history = defaultdict(list)
    tokens = [0.0, 0.0, 0.0]  # real, computed (after right_align), in the padded batch
    empty = 0  # mini-batches with no trained token on any DP rank (every row's agent failed): no step
    # mini_batch_rows: a batch with rows of rewritten histories (ppo/segments.py), filled to equal mini-batches
    mini_batch_size = data.meta_info.get("mini_batch_rows", role_cfg.ppo_mini_batch_size)
    minis = _mini_batches(data.select(batch_keys=keys), mini_batch_size, dp, loss.name)
    with engine.resident():  # offload=true: one reload / offload for the whole update
        for mini in minis * role_cfg.ppo_epochs:
            mask = mini.batch["response_mask"]
            norm, n_tokens = _dp_all_reduce([loss.normalizer(mask), float(mask.sum())])
            if n_tokens == 0:  # all ranks agree (all-reduced): nothing to learn from, and Adam would still move
                empty += 1
                continue
            first = not history  # no optimizer step yet (an empty mini-batch takes none): the weights as given
            step = engine.train_step(dict(mini.batch), functools.partial(loss, norm=norm, n_tokens=n_tokens, first=first),
                                     normalizer=norm, response_length=r,
                                     micro_batch_size=min(role_cfg.micro_batch_size, len(mini)),
                                     temperature=temperature, compute_entropy=loss.needs_entropy)
            tokens[1] += step.pop("computed_tokens")
            for k, v in step.items():
                history[k if "/" in k else f"{loss.name}/{k}"].append(float(v))
            ids = mini.batch["input_ids"]
            tokens[0] += float(mini.batch["attention_mask"].sum())
            tokens[2] += float(ids.numel())
    metrics = {k: sum(v) / len(v) for k, v in history.items()}
    metrics[f"{loss.name}/empty_minibatches"] = float(empty)
    # the waste padding would cost, made visible; and the rows trained on (all DP ranks, one pass)
    real, computed, padded, rows = _dp_all_reduce(tokens + [len(data)])
    metrics.update({f"tokens/{loss.name}_real": real, f"tokens/{loss.name}_computed": computed,
                    f"tokens/{loss.name}_padded_batch": padded, f"{loss.name}/rows": rows})
    rss, device = _dp_all_reduce(_peak_memory_gb(), op="MAX")  # the largest DP rank's
    metrics[f"perf/{loss.name}_peak_rss_gb"] = rss
    if device:
        metrics[f"perf/{loss.name}_peak_device_memory_gb"] = device
    return metrics


def check_reward_model_vocab(rm_path, policy_path) -> None:
    """A reward model scores the policy's token ids, so both must share one vocab."""
    from transformers import AutoConfig

    rm_vocab = AutoConfig.from_pretrained(str(rm_path)).vocab_size
    policy_vocab = AutoConfig.from_pretrained(str(policy_path)).vocab_size
    if rm_vocab != policy_vocab:
        raise ValueError(f"reward model vocab_size {rm_vocab} ({rm_path}) != policy vocab_size {policy_vocab} "
                         f"({policy_path}): the reward model must use the policy's tokenizer")


class _MegatronRoleWorker(Worker):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def _bring_up(self, parallel) -> None:
        layout = _layout(parallel)
        if getattr(self, "layout", None) == layout:  # a colocated role: the process's megatron world is up
            return
        self.layout = layout
        self.init_megatron(self.layout, seed=self.config.trainer.seed)

    def _make_engine(self, path, role: str):
        from megappo.workers.engine_config import engine_config_from
        from megappo.workers.megatron_engine import MegatronEngine

        return MegatronEngine(path, self.layout, engine_config_from(self.config, role))

    # ---- another run on this process (ppo/workers.WarmWorkers: tests that share a layout) -----------

    def _engines(self) -> dict:
        """{role: MegatronEngine} of this process (engine_config_from's role names)."""
        return {}

    @register(Dispatch.ONE_TO_ALL)
    def keep_initial_state(self) -> None:
        """After the group's start-up (models, vLLM, weight sync): copy each engine's weights and this process's
        RNG states, which `reset_run` puts back."""
        from megappo.utils.checkpoint import rng_state

        for engine in self._engines().values():
            engine.keep_initial_state()
        self._rng_after_start = rng_state()

    @register(Dispatch.ONE_TO_ALL)
    def reset_run(self, config) -> None:
        """This process as a new run of `config` would start it (WarmWorkers checked that the two runs build
        the same workers): its config, each engine's weights as built with a new optimizer and LR schedule
        (MegatronEngine.reset), its RNG states as after start-up."""
        from megappo.utils.checkpoint import set_rng_state
        from megappo.workers.engine_config import engine_config_from

        self.config = config
        for role, engine in self._engines().items():
            engine.reset(engine_config_from(config, role))
        self._reset_rollout(config)
        set_rng_state(self._rng_after_start)

    def _reset_rollout(self, config) -> None:
        pass

    def _ckpt(self, path, name: str) -> Path:
        return Path(path) / name

    def _save_rng(self, path, name: str) -> None:
        import json

        from megappo.utils.checkpoint import rng_state

        d = Path(path) / "rng"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}_rank{self.rank}.json").write_text(json.dumps(rng_state()))

    def _load_rng(self, path, name: str) -> None:
        import json

        from megappo.utils.checkpoint import set_rng_state

        f = Path(path) / "rng" / f"{name}_rank{self.rank}.json"
        if f.is_file():  # checkpoints written before RNG states were saved have none
            set_rng_state(json.loads(f.read_text()))


class ActorRolloutRefWorker(_MegatronRoleWorker):
    def __init__(self, config, role: str = Role.ActorRolloutRef.value):
        super().__init__(config)
        if role not in ACTOR_ROLES:
            raise ValueError(f"ActorRolloutRefWorker role must be one of {ACTOR_ROLES}, got {role!r}")
        self.role = Role(role).value
        self.is_actor, self.is_rollout, self.is_ref = _PARTS[Role(role)]
        self.actor = None
        self.ref = None
        self.rollout = None  # VLLMRollout, built by init_rollout()
        self.hybrid = None  # HybridEngine (actor + rollout in this process)
        self._sync_group = None  # async mode: the trainer <-> rollout-pool weight group
        self._sender = None
        self._receiver = None
        self._stream = None  # fully_async: RolloutStream, continuous generation on this rollout worker
        self._replica = None  # fully_async with rollout.tp > 1: (this rank's replica group, its first rank)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.config
        if self.role == Role.Rollout:  # a rollout-pool worker: vLLM only, no megatron
            if self.world_size > 1:
                self.init_distributed()
            return {"role": self.role, "layout": f"rollout TP{cfg.rollout.tp} x {self.world_size // cfg.rollout.tp}"}
        self._bring_up(cfg.ref.parallel if self.role == Role.RefPolicy else cfg.actor.parallel)
        if self.is_actor:
            self.actor = self._make_engine(cfg.model.path, "actor")
        if self.is_ref and not self._ref_is_actor_base:  # a LoRA actor's base is the reference: no model of its own
            self.ref = self._make_engine(cfg.model.path, "ref")
        return {"role": self.role, "layout": str(self.layout)}

    def _engines(self) -> dict:
        return {role: e for role, e in (("actor", self.actor), ("ref", self.ref)) if e is not None}

    def _reset_rollout(self, config) -> None:
        """vLLM: the rollout section's sampling defaults, no cached prefix, no stream left running
        (fully_async's stream_start builds the next run's)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self.rollout is not None:
            self.rollout.reset(config.rollout)

    @property
    def _ref_is_actor_base(self) -> bool:
        return self.is_actor and self.config.actor.lora.rank > 0

    def _need(self, engine, what: str):
        if engine is None:
            raise RuntimeError(f"ActorRolloutRefWorker(role={self.role!r}) has no {what} engine "
                               "(call init_model first, or use a role that includes it)")
        return engine

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_log_prob(self, data: DataProto) -> Optional[DataProto]:
        engine = self._need(self.actor, "actor")
        out = _forward(engine, data, _response_length(data), self.config.actor.log_prob_micro_batch_size,
                       temperature=_logprob_temperature(data), compute_entropy=True)
        if out is None:
            return None
        return DataProto.from_dict({"old_log_probs": out["logprobs"], "entropy": out["entropy"]})

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_ref_log_prob(self, data: DataProto) -> Optional[DataProto]:
        if self._ref_is_actor_base:  # actor.lora: the reference is the actor's base, its adapters off
            engine = self._need(self.actor, "actor")
            ref = engine.base_model()
        else:
            engine, ref = self._need(self.ref, "ref"), contextlib.nullcontext()
        with ref:
            out = _forward(engine, data, _response_length(data), self.config.ref.log_prob_micro_batch_size,
                           temperature=_logprob_temperature(data), compute_entropy=False)
        if out is None:
            return None
        return DataProto.from_dict({"ref_log_prob": out["logprobs"]})

    @register(Dispatch.MEGATRON_COMPUTE, pad=False)
    def update_actor(self, data: DataProto, loss) -> dict:
        """One PPO update of the actor on this DP rank's rows with `loss` (megappo.ppo.losses.PolicyLoss)."""
        engine = self._need(self.actor, "actor")
        return _train(engine, data, loss, self.config.actor, self.layout.dp, temperature=_logprob_temperature(data))

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

    # ---- checkpoints -----------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path, background: bool = False) -> None:
        """Every rank's shards (+ its RNG states); background: the files are written by a thread until
        finish_checkpoint() (the next call that must see them whole)."""
        if self.actor is not None:
            self.actor.save_checkpoint(self._ckpt(path, "actor"), background)
        elif self.ref is not None:
            self.ref.save_checkpoint(self._ckpt(path, "ref"), background)
        self._save_rng(path, "actor" if self.actor is not None else self.role)

    @register(Dispatch.ONE_TO_ALL)
    def finish_checkpoint(self) -> None:
        for engine in (self.actor, self.ref):
            if engine is not None:
                engine.finish_save()

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path, load_optimizer: bool = True) -> None:
        if self.actor is not None:
            self.actor.load_checkpoint(self._ckpt(path, "actor"), load_optimizer=load_optimizer)
        elif self.ref is not None:
            self.ref.load_checkpoint(self._ckpt(path, "ref"), load_optimizer=False)
        self._load_rng(path, "actor" if self.actor is not None else self.role)


class CriticWorker(_MegatronRoleWorker):
    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.config
        self._bring_up(cfg.critic.parallel)
        self.critic = self._make_engine(cfg.model.critic_path or cfg.model.path, "critic")
        return {"role": Role.Critic.value, "layout": str(self.layout),
                "value_head_initialised": list(self.critic.value_head_initialised)}

    def _engines(self) -> dict:
        return {"critic": self.critic}

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_values(self, data: DataProto) -> Optional[DataProto]:
        out = _forward(self.critic, data, _response_length(data), self.config.critic.micro_batch_size)
        return None if out is None else DataProto.from_dict({"values": out["values"]})

    @register(Dispatch.MEGATRON_COMPUTE, pad=False)
    def update_critic(self, data: DataProto, loss) -> dict:
        """One update of the value model on this DP rank's rows with `loss` (megappo.ppo.losses.ValueLoss)."""
        return _train(self.critic, data, loss, self.config.critic, self.layout.dp)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path, background: bool = False) -> None:
        self.critic.save_checkpoint(self._ckpt(path, "critic"), background)
        self._save_rng(path, "critic")

    @register(Dispatch.ONE_TO_ALL)
    def finish_checkpoint(self) -> None:
        self.critic.finish_save()

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path, load_optimizer: bool = True) -> None:
        self.critic.load_checkpoint(self._ckpt(path, "critic"), load_optimizer=load_optimizer)
        self._load_rng(path, "critic")


class ActorCriticWorker(ActorRolloutRefWorker, CriticWorker):
    """The actor (+ rollout, + ref) and the critic in one process, on one megatron world: the roles
    share a layout (resources.colocate), so the driver's actor and critic groups are this one group.
    Each role keeps its own engine, optimizer and checkpoint dir; calls run one after another."""

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        info = ActorRolloutRefWorker.init_model(self)
        info["critic"] = CriticWorker.init_model(self)
        return info

    def _engines(self) -> dict:
        return {**ActorRolloutRefWorker._engines(self), **CriticWorker._engines(self)}

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path, background: bool = False) -> None:
        ActorRolloutRefWorker.save_checkpoint(self, path, background)
        CriticWorker.save_checkpoint(self, path, background)

    @register(Dispatch.ONE_TO_ALL)
    def finish_checkpoint(self) -> None:
        # both roles' writers end (and run their collective finalize) even when the first one failed: a
        # writer left running would keep filling the temp dir the trainer removes after the failure
        try:
            ActorRolloutRefWorker.finish_checkpoint(self)
        finally:
            CriticWorker.finish_checkpoint(self)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path, load_optimizer: bool = True) -> None:
        ActorRolloutRefWorker.load_checkpoint(self, path, load_optimizer)
        CriticWorker.load_checkpoint(self, path, load_optimizer)


class TeacherWorker(_MegatronRoleWorker):
    """On-policy distillation's teacher (teacher.model): a frozen causal LM of any supported family with its
    own layout (teacher.parallel), scoring the student's tokens as the reference does (at the sampling
    temperature)."""

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        from megappo.model_dirs import check_same_tokenizer

        cfg = self.config
        check_same_tokenizer(cfg.teacher.model, cfg.model.tokenizer or cfg.model.path)
        self._bring_up(cfg.teacher.parallel)
        self.teacher = self._make_engine(cfg.teacher.model, "teacher")
        return {"role": Role.Teacher.value, "layout": str(self.layout)}

    def _engines(self) -> dict:
        return {"teacher": self.teacher}

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_teacher_log_prob(self, data: DataProto) -> Optional[DataProto]:
        out = _forward(self.teacher, data, _response_length(data), self.config.teacher.log_prob_micro_batch_size,
                       temperature=_logprob_temperature(data), compute_entropy=False)
        if out is None:
            return None
        return DataProto.from_dict({"teacher_log_prob": out["logprobs"]})


class RewardModelWorker(_MegatronRoleWorker):
    """Scores whole sequences with a HF *ForSequenceClassification model (value at the last valid token)."""

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.config
        rm = cfg.reward.model
        if not rm.path:
            raise ValueError("reward.model.path is not set (a HF *ForSequenceClassification dir)")
        check_reward_model_vocab(rm.path, cfg.model.path)
        self._bring_up(rm.parallel)
        self.rm = self._make_engine(rm.path, "reward_model")
        if self.rm.value_head_initialised and any(n.endswith("weight") for n in self.rm.value_head_initialised):
            raise ValueError(f"reward model {rm.path} has no `score` head: it must be a *ForSequenceClassification "
                             "checkpoint (num_labels=1)")
        return {"role": Role.RewardModel.value, "layout": str(self.layout)}

    def _engines(self) -> dict:
        return {"reward_model": self.rm}

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_rm_score(self, data: DataProto) -> Optional[DataProto]:
        import torch

        ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
        # The engine returns the output at positions [S-R-1, S-2] for R response columns; one appended
        # pad column makes that [S-R-1, S-1], so the last valid token is always covered.
        r = _response_length(data)
        pad_col = torch.zeros_like(ids[:, :1])  # on the batch's (CPU) device, like the rest of the rows
        batch = {"input_ids": torch.cat([ids, pad_col], 1),
                 "attention_mask": torch.cat([mask, pad_col.to(mask.dtype)], 1)}
        if "position_ids" in data.batch:
            pos = data.batch["position_ids"]
            batch["position_ids"] = torch.cat([pos, pos[:, -1:]], 1)
        out = _forward(self.rm, DataProto.from_dict(batch), r + 1, self.config.reward.model.micro_batch_size)
        if out is None:
            return None
        s = ids.shape[1]
        last = (torch.arange(s, device=mask.device)[None, :] * mask.long()).amax(-1)  # index of the last valid token
        col = last - (s - r - 1)  # its column in values[:, 0..R]
        if (col < 0).any():
            raise ValueError("compute_rm_score: a sequence ends before its response starts (empty prompt+response?)")
        return DataProto.from_dict({"rm_scores": out["values"].gather(1, col[:, None])[:, 0]})
