"""The PPO workers the driver talks to, on top of MegatronEngine (one engine per model per process).

- ActorRolloutRefWorker(config, role): role is one of "actor", "rollout", "ref", "actor_rollout"
  (hybrid engine), "actor_ref" or "actor_rollout_ref". Fused roles share one process, one
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
  update_actor needs old_log_probs, advantages, response_mask (+ ref_log_prob with actor.use_kl_loss,
  + rollout_log_probs for truncated importance sampling when present); update_critic needs values,
  returns, response_mask. Both return a metrics dict (same on every rank) and do not pad: the batch
  must be a multiple of dp and of ppo_mini_batch_size / dp.

Every method is declared with @register: ONE_TO_ALL for init/checkpoints/generation (every rank gets
the whole prompt batch; the vLLM replicas split it themselves, see hybrid_engine.replicated_generate,
because rollout replicas = world / rollout.tp, not megatron's dp), MEGATRON_COMPUTE for the batch
methods (the group pads, splits by dp and reads tp==0 on the last pp stage).

Async weight sync (see rollout/weight_sync.py): `weight_sync_address()` on the actor group, then
`init_weight_sync(host, port, world)` on the actor and rollout groups concurrently; per step
`send_weights()` (actor) together with `receive_weights()` (rollout).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional

from megappo.protocol import DataProto
from megappo.workers.base_worker import Worker
from megappo.workers.dispatch import Dispatch, register

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker", "ACTOR_ROLES", "check_reward_model_vocab"]

ACTOR_ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_ref", "actor_rollout_ref")
_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")


def _layout(parallel):
    from megappo.parallel.layout import ParallelLayout

    return ParallelLayout(tp=parallel.tp, pp=parallel.pp, dp=parallel.dp, vpp=parallel.vpp)


def _engine_optim(optim, total_steps: int):
    from megappo.workers.megatron_engine import OptimConfig

    import dataclasses

    from omegaconf import OmegaConf

    keys = OmegaConf.to_container(optim) if OmegaConf.is_config(optim) else dataclasses.asdict(optim)
    return OptimConfig(**keys, total_steps=total_steps)


def _optimizer_steps(cfg, role_cfg) -> int:
    """Optimizer steps over the whole run (the LR schedule's length): steps x epochs x mini-batches."""
    sequences = cfg.data.train_batch_size * cfg.rollout.n
    return cfg.trainer.total_steps * max(1, role_cfg.ppo_epochs) * max(1, sequences // role_cfg.ppo_mini_batch_size)


def _params_dtype(dtype: str):
    import torch

    return {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]


def _response_length(data: DataProto) -> int:
    if "responses" not in data.batch:
        raise KeyError("batch needs 'responses' [B, R] (the last R columns of input_ids) to know the response length")
    return int(data.batch["responses"].shape[1])


def _forward(engine, data: DataProto, response_length: int, micro_batch_size: int, **kw) -> Optional[dict]:
    """engine.forward_only over this rank's rows, padding them to a multiple of the micro-batch size."""
    n = len(data)
    mbs = max(1, min(int(micro_batch_size), n))
    keys = [k for k in _MODEL_KEYS if k in data.batch]
    padded, _ = data.select(batch_keys=keys, non_tensor_keys=[], meta_info_keys=[]).pad_to_divisor(mbs)
    out = engine.forward_only(dict(padded.batch), response_length=response_length, micro_batch_size=mbs, **kw)
    if out is None:  # not the last pipeline stage: the group does not read this rank
        return None
    return {k: v[:n] for k, v in out.items()}


def _dp_all_reduce_sum(value: float) -> float:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    t = torch.tensor([float(value)], dtype=torch.float64)
    if mpu.get_data_parallel_world_size() > 1:
        dist.all_reduce(t, group=mpu.get_data_parallel_group())
    return float(t)


def _rng_state() -> dict:
    """This process's RNG states as JSON-able lists (torch, megatron's tracker, numpy, python)."""
    import random

    import numpy as np
    import torch

    state = {"torch": torch.get_rng_state().tolist(), "python": list(random.getstate()[1]),
             "python_pos": random.getstate()[2], "numpy": np.random.get_state()[1].tolist(),
             "numpy_pos": int(np.random.get_state()[2])}
    try:
        from megatron.core import tensor_parallel

        state["tracker"] = {k: v.tolist() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    except Exception:  # noqa: BLE001 - no megatron tracker in this process
        pass
    return state


def _set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch

    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    if "tracker" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(
            {k: torch.tensor(v, dtype=torch.uint8) for k, v in state["tracker"].items()})


def _vllm_dtype(dtype: str):
    return {"auto": None, "fp32": "float32", "bf16": "bfloat16"}[dtype]


def _mini_batches(data: DataProto, mini_batch_size: int, dp: int, what: str) -> list[DataProto]:
    if mini_batch_size % dp:
        raise ValueError(f"{what}.ppo_mini_batch_size={mini_batch_size} is not a multiple of dp={dp}")
    local = mini_batch_size // dp
    if len(data) % local:
        raise ValueError(f"{what}: {len(data)} rows per dp rank is not a multiple of the per-rank mini-batch "
                         f"{local} (= ppo_mini_batch_size {mini_batch_size} / dp {dp})")
    return data.split(local)


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
        self.layout = _layout(parallel)
        self.init_megatron(self.layout, seed=self.config.trainer.seed)

    def _make_engine(self, path, role: str, optim=None, offload: bool = False):
        from megappo.workers.megatron_engine import EngineConfig, MegatronEngine

        cfg = EngineConfig(role=role, optim=optim, params_dtype=_params_dtype(self.config.model.dtype),
                           seed=self.config.trainer.seed, temperature=self.config.rollout.temperature,
                           offload=bool(offload))
        return MegatronEngine(path, self.layout, cfg)

    def _ckpt(self, path, name: str) -> Path:
        return Path(path) / name

    def _save_rng(self, path, name: str) -> None:
        import json

        d = Path(path) / "rng"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}_rank{self.rank}.json").write_text(json.dumps(_rng_state()))

    def _load_rng(self, path, name: str) -> None:
        import json

        f = Path(path) / "rng" / f"{name}_rank{self.rank}.json"
        if f.is_file():  # checkpoints written before RNG states were saved have none
            _set_rng_state(json.loads(f.read_text()))


class ActorRolloutRefWorker(_MegatronRoleWorker):
    def __init__(self, config, role: str = "actor_rollout_ref"):
        super().__init__(config)
        if role not in ACTOR_ROLES:
            raise ValueError(f"ActorRolloutRefWorker role must be one of {ACTOR_ROLES}, got {role!r}")
        self.role = role
        self.is_actor = role in ("actor", "actor_rollout", "actor_ref", "actor_rollout_ref")
        self.is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self.is_ref = role in ("ref", "actor_ref", "actor_rollout_ref")
        self.actor = None
        self.ref = None
        self.rollout = None  # VLLMRollout, built by init_rollout()
        self.hybrid = None  # HybridEngine (actor + rollout in this process)
        self._sync_group = None  # async mode: the trainer <-> rollout-pool weight group
        self._sender = None
        self._receiver = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.config
        if self.role == "rollout":  # a rollout-pool worker: vLLM only, no megatron
            if self.world_size > 1:
                self.init_distributed()
            return {"role": self.role, "layout": f"rollout TP{cfg.rollout.tp} x {self.world_size // cfg.rollout.tp}"}
        self._bring_up(cfg.ref.parallel if self.role == "ref" else cfg.actor.parallel)
        if self.is_actor:
            optim = _engine_optim(cfg.actor.optim, _optimizer_steps(cfg, cfg.actor))
            self.actor = self._make_engine(cfg.model.path, "actor", optim, offload=cfg.actor.offload)
        if self.is_ref:
            self.ref = self._make_engine(cfg.model.path, "actor", None, offload=cfg.ref.offload)
        return {"role": self.role, "layout": str(self.layout)}

    def _need(self, engine, what: str):
        if engine is None:
            raise RuntimeError(f"ActorRolloutRefWorker(role={self.role!r}) has no {what} engine "
                               "(call init_model first, or use a role that includes it)")
        return engine

    def _temperature(self, data: DataProto) -> float:
        return float(data.meta_info.get("temperature", self.config.rollout.temperature))

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_log_prob(self, data: DataProto) -> Optional[DataProto]:
        engine = self._need(self.actor, "actor")
        out = _forward(engine, data, _response_length(data), self.config.actor.log_prob_micro_batch_size,
                       temperature=self._temperature(data), compute_entropy=True)
        if out is None:
            return None
        return DataProto.from_dict({"old_log_probs": out["logprobs"], "entropy": out["entropy"]},
                                   meta_info={"temperature": self._temperature(data)})

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_ref_log_prob(self, data: DataProto) -> Optional[DataProto]:
        engine = self._need(self.ref, "ref")
        out = _forward(engine, data, _response_length(data), self.config.ref.log_prob_micro_batch_size,
                       temperature=self._temperature(data), compute_entropy=False)
        if out is None:
            return None
        return DataProto.from_dict({"ref_log_prob": out["logprobs"]})

    @register(Dispatch.MEGATRON_COMPUTE, pad=False)
    def update_actor(self, data: DataProto) -> dict:
        from megappo.ppo import core_algos as algos

        engine = self._need(self.actor, "actor")
        cfg = self.config.actor
        r = _response_length(data)
        mode = cfg.loss_agg_mode
        needed = ["old_log_probs", "advantages", "response_mask"] + (["ref_log_prob"] if cfg.use_kl_loss else [])
        missing = [k for k in needed if k not in data.batch]
        if missing:
            raise KeyError(f"update_actor: batch lacks {missing}")
        keys = [k for k in _MODEL_KEYS if k in data.batch] + needed + \
            (["rollout_log_probs"] if "rollout_log_probs" in data.batch else [])
        temperature = self._temperature(data)
        history = defaultdict(list)
        minis = _mini_batches(data.select(batch_keys=keys), cfg.ppo_mini_batch_size, self.layout.dp, "actor")
        with engine.resident():  # offload=true: one reload / offload for the whole update
            for mini in minis * cfg.ppo_epochs:
                norm = _dp_all_reduce_sum(algos.loss_normalizer(mini.batch["response_mask"], mode))
                n_tokens = _dp_all_reduce_sum(float(mini.batch["response_mask"].sum()))

                def loss_fn(outs, mb, norm=norm, n_tokens=n_tokens):
                    mask = mb["response_mask"]
                    weights = None
                    if "rollout_log_probs" in mb:
                        weights, _ = algos.compute_importance_weights(mb["old_log_probs"], mb["rollout_log_probs"],
                                                                      mask)
                    pg, clipfrac, approx_kl, dual = algos.compute_policy_loss(
                        mb["old_log_probs"], outs["logprobs"], mb["advantages"], mask, cfg.clip_ratio,
                        cfg.clip_ratio_c, mode, normalizer=1.0, importance_weights=weights)
                    loss = pg
                    share = float(mask.sum()) / max(n_tokens, 1.0)  # token-weighted means sum to the mini-batch mean
                    metrics = {"actor/pg_loss": pg.detach() / norm, "actor/pg_clipfrac": clipfrac * share,
                               "actor/ppo_kl": approx_kl.detach() * share, "actor/pg_clipfrac_lower": dual * share}
                    if cfg.entropy_coeff:
                        ent = algos.compute_entropy_loss(outs["entropy"], mask, mode, normalizer=1.0)
                        loss = loss - cfg.entropy_coeff * ent
                        metrics["actor/entropy"] = ent.detach() / norm
                    if cfg.use_kl_loss:
                        kl = algos.agg_loss(algos.kl_penalty(outs["logprobs"], mb["ref_log_prob"], cfg.kl_loss_type),
                                            mask, mode, normalizer=1.0)
                        loss = loss + cfg.kl_loss_coef * kl
                        metrics["actor/kl_loss"] = kl.detach() / norm
                    return loss, metrics

                mbs = min(cfg.micro_batch_size, len(mini))
                step = engine.train_step(dict(mini.batch), loss_fn, normalizer=norm, response_length=r,
                                         micro_batch_size=mbs, temperature=temperature)
                for k, v in step.items():
                    history[k if "/" in k else f"actor/{k}"].append(float(v))
        return {k: sum(v) / len(v) for k, v in history.items()}

    # ---- rollout ---------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def init_rollout(self) -> dict:
        """Build this process's vLLM engine (+ the hybrid engine when the actor lives here too)."""
        from megappo.workers.rollout.hybrid_engine import HybridEngine
        from megappo.workers.rollout.vllm_rollout import VLLMRollout

        cfg = self.config
        if not self.is_rollout:
            raise RuntimeError(f"ActorRolloutRefWorker(role={self.role!r}) has no rollout")
        self.rollout = VLLMRollout(cfg.model.path, cfg.rollout, seed=cfg.trainer.seed,
                                   dtype=_vllm_dtype(cfg.model.dtype),
                                   max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
                                   tokenizer_path=cfg.model.tokenizer or cfg.model.path)
        if self.actor is not None:
            self.hybrid = HybridEngine(self.actor, self.rollout, bucket_mb=cfg.rollout.weight_sync_bucket_mb)
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
        else:
            t0 = time.perf_counter()
            out = replicated_generate(self.rollout, prompts)
            metrics = {"timing/rollout_s": time.perf_counter() - t0}
        out.meta_info["metrics"] = metrics
        return out if self.rank == 0 else None

    # ---- async weight sync (rollout/weight_sync.py) ----------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def weight_sync_address(self) -> tuple:
        """(host, free port) for the weight-sync group's rendezvous (the driver uses rank 0's)."""
        from megappo.workers.base_worker import _free_port

        return self.master_addr, _free_port(self.master_addr)

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
                                        self.config.rollout.weight_sync_bucket_mb)
        elif self.role == "rollout":
            if self.rollout is None:
                raise RuntimeError("call init_rollout() before init_weight_sync()")
            self._sync_group = StatelessGroup(host, port, 1 + self.rank, world, timeout_s=timeout)
            self._receiver = WeightReceiver(self.rollout, self._sync_group)
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
    def save_checkpoint(self, path) -> None:
        if self.actor is not None:
            self.actor.save_checkpoint(self._ckpt(path, "actor"))
        elif self.ref is not None:
            self.ref.save_checkpoint(self._ckpt(path, "ref"))
        self._save_rng(path, "actor" if self.actor is not None else self.role)

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
        optim = _engine_optim(cfg.critic.optim, _optimizer_steps(cfg, cfg.critic))
        self.critic = self._make_engine(cfg.model.critic_path or cfg.model.path, "critic", optim,
                                        offload=cfg.critic.offload)
        return {"role": "critic", "layout": str(self.layout),
                "value_head_initialised": list(self.critic.value_head_initialised)}

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_values(self, data: DataProto) -> Optional[DataProto]:
        out = _forward(self.critic, data, _response_length(data), self.config.critic.micro_batch_size)
        return None if out is None else DataProto.from_dict({"values": out["values"]})

    @register(Dispatch.MEGATRON_COMPUTE, pad=False)
    def update_critic(self, data: DataProto) -> dict:
        from megappo.ppo import core_algos as algos

        cfg = self.config.critic
        r = _response_length(data)
        needed = ["values", "returns", "response_mask"]
        missing = [k for k in needed if k not in data.batch]
        if missing:
            raise KeyError(f"update_critic: batch lacks {missing}")
        keys = [k for k in _MODEL_KEYS if k in data.batch] + needed
        history = defaultdict(list)
        minis = _mini_batches(data.select(batch_keys=keys), cfg.ppo_mini_batch_size, self.layout.dp, "critic")
        with self.critic.resident():  # offload=true: one reload / offload for the whole update
            for mini in minis * cfg.ppo_epochs:
                norm = _dp_all_reduce_sum(algos.loss_normalizer(mini.batch["response_mask"], "token-mean"))

                def loss_fn(outs, mb, norm=norm):
                    mask = mb["response_mask"]
                    loss, clipfrac = algos.compute_value_loss(outs["values"], mb["values"], mb["returns"], mask,
                                                              cfg.cliprange_value, "token-mean", normalizer=1.0)
                    share = float(mask.sum()) / max(norm, 1.0)
                    return loss, {"critic/vf_loss": loss.detach() / norm, "critic/vf_clipfrac": clipfrac * share}

                step = self.critic.train_step(dict(mini.batch), loss_fn, normalizer=norm, response_length=r,
                                              micro_batch_size=min(cfg.micro_batch_size, len(mini)))
                for k, v in step.items():
                    history[k if "/" in k else f"critic/{k}"].append(float(v))
        return {k: sum(v) / len(v) for k, v in history.items()}

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path) -> None:
        self.critic.save_checkpoint(self._ckpt(path, "critic"))
        self._save_rng(path, "critic")

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path, load_optimizer: bool = True) -> None:
        self.critic.load_checkpoint(self._ckpt(path, "critic"), load_optimizer=load_optimizer)
        self._load_rng(path, "critic")


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
        self.rm = self._make_engine(rm.path, "critic", None)
        if self.rm.value_head_initialised and any(n.endswith("weight") for n in self.rm.value_head_initialised):
            raise ValueError(f"reward model {rm.path} has no `score` head: it must be a *ForSequenceClassification "
                             "checkpoint (num_labels=1)")
        return {"role": "reward_model", "layout": str(self.layout)}

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_rm_score(self, data: DataProto) -> Optional[DataProto]:
        import torch

        ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
        # The engine returns the output at positions [S-R-1, S-2] for R response columns; one appended
        # pad column makes that [S-R-1, S-1], so the last valid token is always covered.
        r = _response_length(data)
        pad_col = torch.zeros_like(ids[:, :1])
        batch = {"input_ids": torch.cat([ids, pad_col], 1),
                 "attention_mask": torch.cat([mask, pad_col.to(mask.dtype)], 1)}
        if "position_ids" in data.batch:
            pos = data.batch["position_ids"]
            batch["position_ids"] = torch.cat([pos, pos[:, -1:]], 1)
        out = _forward(self.rm, DataProto.from_dict(batch), r + 1, self.config.reward.model.micro_batch_size)
        if out is None:
            return None
        s = ids.shape[1]
        last = (torch.arange(s)[None, :] * mask.long()).amax(-1)  # index of the last valid token
        col = last - (s - r - 1)  # its column in values[:, 0..R]
        if (col < 0).any():
            raise ValueError("compute_rm_score: a sequence ends before its response starts (empty prompt+response?)")
        return DataProto.from_dict({"rm_scores": out["values"].gather(1, col[:, None])[:, 0]})
