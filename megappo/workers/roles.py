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
  out:  compute_log_prob -> old_log_probs [B, R], entropy [B, R] (+ routed_experts [B, S, layers, k] under
        actor.router_replay=r2: the MoE routes the update replays)
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

Split by responsibility: this file holds the roles (`Role`) and the worker classes; the rollout half of
ActorRolloutRefWorker (vLLM, generation, the fully_async stream, the weight sync) is rollout_role.py, mixed
into it; the batch plumbing the workers share (`_forward`, `_train`) is role_batches.py.
"""

from __future__ import annotations

import contextlib
from enum import Enum
from pathlib import Path
from typing import Optional

from megappo.controller.dispatch import Dispatch, register
from megappo.controller.worker import Worker
from megappo.protocol import DataProto
from megappo.models.routing_replay import ROUTES
from megappo.workers.role_batches import _forward, _logprob_temperature, _response_length, _train
from megappo.workers.rollout_role import RolloutRole

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


def _layout(parallel):
    from megappo.parallel.layout import ParallelLayout

    return ParallelLayout(tp=parallel.tp, pp=parallel.pp, dp=parallel.dp, vpp=parallel.vpp, ep=parallel.ep, cp=parallel.cp)


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


class ActorRolloutRefWorker(RolloutRole, _MegatronRoleWorker):  # the mixin first: its _reset_rollout is the one
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
        # actor.router_replay=r2: the routes of this forward are the ones the update replays; r3: this forward
        # replays the rollout's (pi_old is then the network that sampled)
        mode = self.config.actor.router_replay
        record = mode == "r2"
        out = _forward(engine, data, _response_length(data), self.config.actor.log_prob_micro_batch_size,
                       temperature=_logprob_temperature(data), compute_entropy=True, record_routes=record,
                       replay_routes=mode == "r3")
        if out is None:
            return None
        routes = {ROUTES: out[ROUTES]} if record else {}
        return DataProto.from_dict({"old_log_probs": out["logprobs"], "entropy": out["entropy"], **routes})

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_ref_log_prob(self, data: DataProto) -> Optional[DataProto]:
        if self._ref_is_actor_base:  # actor.lora: the reference is the actor's base, its adapters off
            engine = self._need(self.actor, "actor")
            ref = engine.base_model()
        else:
            engine, ref = self._need(self.ref, "ref"), contextlib.nullcontext()
        with ref:  # a reference model of its own: a frozen forward (the actor's base: the actor's cache)
            out = _forward(engine, data, _response_length(data), self.config.ref.log_prob_micro_batch_size,
                           frozen=not self._ref_is_actor_base and self.actor is None,
                           temperature=_logprob_temperature(data), compute_entropy=False)
        if out is None:
            return None
        return DataProto.from_dict({"ref_log_prob": out["logprobs"]})

    @register(Dispatch.MEGATRON_COMPUTE, pad=False)
    def update_actor(self, data: DataProto, loss) -> dict:
        """One PPO update of the actor on this DP rank's rows with `loss` (megappo.ppo.losses.PolicyLoss)."""
        engine = self._need(self.actor, "actor")
        return _train(engine, data, loss, self.config.actor, self.layout.dp, temperature=_logprob_temperature(data))

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
                       frozen=True, temperature=_logprob_temperature(data), compute_entropy=False)
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
        out = _forward(self.rm, DataProto.from_dict(batch), r + 1, self.config.reward.model.micro_batch_size,
                       frozen=True)
        if out is None:
            return None
        s = ids.shape[1]
        last = (torch.arange(s, device=mask.device)[None, :] * mask.long()).amax(-1)  # index of the last valid token
        col = last - (s - r - 1)  # its column in values[:, 0..R]
        if (col < 0).any():
            raise ValueError("compute_rm_score: a sequence ends before its response starts (empty prompt+response?)")
        return DataProto.from_dict({"rm_scores": out["values"].gather(1, col[:, None])[:, 0]})
