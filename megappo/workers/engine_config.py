"""What a MegatronEngine is asked to be: `EngineConfig` (device, head, optimizer, precision, recompute, offload,
packing, MoE and LoRA settings) and `engine_config_from(cfg, role)`, the one translation from a run's config to
it (with `lora_config_from` and `optimizer_steps`, the LR schedule's length). Plain data: nothing is built here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megappo.config.schema import OptimConfig
from megappo.models.lora import LoraConfig
from megappo.parallel.megatron_init import resolve_device

HEADS = ("lm", "value")


@dataclass
class EngineConfig:
    device: str = "cpu"  # cpu | cuda: where params, activations and batches live (resolve_device)
    head: str = "lm"  # lm (log-probs, entropy) | value (one scalar per position: critic, reward model)
    optim: Optional[OptimConfig] = None  # None: forward-only engine (ref policy, reward model, scoring)
    schedule_steps: int = 1000  # optimizer steps the LR schedule spans
    params_dtype: Optional[torch.dtype] = None  # default: bf16 on GPU, fp32 on CPU
    recompute: bool = False  # full activation recompute, one layer at a time
    sequence_parallel: bool = False
    offload: bool = False  # keep params / grads / optimizer states in host memory outside `resident()`
    seed: int = 1234
    on_nan: str = "skip"  # a non-finite loss: skip the optimizer step (nan_skipped=1) | stop (FloatingPointError)
    transformer_engine: Optional[bool] = None  # TE's layer spec on GPU: None = when usable (gpt.use_transformer_engine)
    # sequence packing (workers/packing.py): a micro-batch's rows as one sequence, real tokens only;
    # max_tokens_per_micro_batch (packing only): micro-batches by token budget instead of row count
    pack_sequences: bool = False
    max_tokens_per_micro_batch: Optional[int] = None
    # MoE (config/schema.py MoEConfig): aux / z-loss coefficients, token dispatcher
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_token_dispatcher: str = "alltoall"
    # LoRA (models/lora.py; actor only): adapters on the frozen base, applied after the HF weights load and
    # before DDP and the optimizer (the base gets no grad buffer and no optimizer state). None = off
    lora: Optional[LoraConfig] = None
    # a vision-language model (models/vision_gpt.py): its vision tower and merger frozen (no grads, no optimizer state)
    freeze_vision: bool = False


def lora_config_from(cfg) -> Optional[LoraConfig]:
    """actor.lora as a models/lora.LoraConfig (A's init seeded by trainer.seed); None when rank is 0."""
    lo = cfg.actor.lora
    if not lo.rank:
        return None
    return LoraConfig(rank=int(lo.rank), alpha=float(lo.alpha), dropout=float(lo.dropout),
                      target_modules=list(lo.target_modules), init=str(lo.init), seed=int(cfg.trainer.seed),
                      experts=bool(lo.experts))


def engine_config_from(cfg, role: str) -> EngineConfig:
    """The EngineConfig of `role` (actor | ref | critic | reward_model | teacher) in a run's config."""
    sections = {"actor": cfg.actor, "ref": cfg.ref, "critic": cfg.critic, "reward_model": cfg.reward.model,
                "teacher": cfg.teacher}
    if role not in sections:
        raise ValueError(f"engine_config_from: unknown role {role!r}; choose one of {', '.join(sections)}")
    section = sections[role]
    trains = role in ("actor", "critic")
    return EngineConfig(
        device=resolve_device(cfg.resources.device),
        head="lm" if role in ("actor", "ref", "teacher") else "value",
        optim=_plain_optim(section.optim) if trains else None,
        schedule_steps=optimizer_steps(cfg, section) if trains else 1000,
        params_dtype={"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}[cfg.model.dtype],
        recompute=bool(getattr(section, "recompute_activations", False)),
        offload=bool(getattr(section, "offload", False)),
        seed=int(cfg.trainer.seed),
        on_nan=cfg.trainer.on_nan,
        transformer_engine=cfg.model.transformer_engine,
        pack_sequences=bool(getattr(section, "pack_sequences", False)),
        max_tokens_per_micro_batch=getattr(section, "max_tokens_per_micro_batch", None),
        moe_aux_loss_coeff=float(cfg.model.moe.aux_loss_coeff),
        moe_z_loss_coeff=float(cfg.model.moe.z_loss_coeff),
        moe_token_dispatcher=cfg.model.moe.token_dispatcher,
        lora=lora_config_from(cfg) if role == "actor" else None,
        freeze_vision=bool(cfg.model.freeze_vision),
    )


def optimizer_steps(cfg, role_cfg) -> int:
    """Optimizer steps over the whole run (the LR schedule's length): steps x epochs x mini-batches."""
    sequences = cfg.data.train_batch_size * cfg.rollout.n
    return cfg.trainer.total_steps * max(1, role_cfg.ppo_epochs) * max(1, sequences // role_cfg.ppo_mini_batch_size)


def _plain_optim(optim) -> OptimConfig:
    """The config section as a plain OptimConfig (an OmegaConf node does not pickle into workers well)."""
    import dataclasses

    from omegaconf import OmegaConf

    if OmegaConf.is_config(optim):
        return OptimConfig(**OmegaConf.to_container(optim))
    return dataclasses.replace(optim)

