"""Cross-key checks on a resolved config. Each failure is one ConfigError line naming the keys and
the fix. Model shapes come from `<model.path>/config.json` when it exists, else from `model.arch`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megappo.config.loader import ConfigError, check_choices


@dataclass(frozen=True)
class ModelDims:
    family: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int


HF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}


def model_dims(cfg) -> ModelDims:
    """Shapes of the configured model: from the HF config.json when model.path has one, else model.arch."""
    path = cfg.model.path
    if path and (Path(path) / "config.json").is_file():
        hf = json.loads((Path(path) / "config.json").read_text())
        family = hf.get("model_type", "?")
        if family not in HF_FAMILIES:
            raise ConfigError(
                f"model.path {path} is a {family!r} model; supported families: {', '.join(HF_FAMILIES)}")
        heads = hf["num_attention_heads"]
        return ModelDims(family, hf["hidden_size"], hf["num_hidden_layers"], heads,
                         hf.get("num_key_value_heads") or heads, hf["vocab_size"])
    a = cfg.model.arch
    return ModelDims(a.family, a.hidden_size, a.num_layers, a.num_attention_heads, a.num_kv_heads, a.vocab_size)


def pool_size(cfg) -> int:
    """Workers in the training pool (every colocated role's tp*pp*dp must equal it)."""
    return cfg.resources.nodes * cfg.resources.workers_per_node


def check_parallel(name: str, par, dims: ModelDims, world: int) -> None:
    for k in ("tp", "pp", "dp"):
        if getattr(par, k) < 1:
            raise ConfigError(f"{name}.parallel.{k}={getattr(par, k)} must be >= 1")
    if par.tp * par.pp * par.dp != world:
        raise ConfigError(
            f"{name}.parallel tp*pp*dp = {par.tp}*{par.pp}*{par.dp} = {par.tp * par.pp * par.dp} but the pool has "
            f"{world} workers (resources.nodes*resources.workers_per_node); change dp to {world // (par.tp * par.pp)}"
            if world % (par.tp * par.pp) == 0 else
            f"{name}.parallel tp*pp = {par.tp * par.pp} does not divide the pool's {world} workers "
            f"(resources.nodes*resources.workers_per_node); pick tp and pp whose product divides {world}")
    if dims.num_attention_heads % par.tp:
        raise ConfigError(f"{name}.parallel.tp={par.tp} does not divide the model's {dims.num_attention_heads} "
                          f"attention heads; use a tp that divides it")
    if dims.num_kv_heads % par.tp:
        raise ConfigError(f"{name}.parallel.tp={par.tp} does not divide the model's {dims.num_kv_heads} "
                          f"key/value heads (GQA); use a tp that divides it")
    if par.vpp is not None:
        if par.pp == 1:
            raise ConfigError(f"{name}.parallel.vpp={par.vpp} needs pipeline parallelism; set {name}.parallel.pp>=2 "
                              f"or {name}.parallel.vpp=null")
        if par.vpp < 2:
            raise ConfigError(f"{name}.parallel.vpp={par.vpp} must be >= 2 (or null for no interleaving)")
    chunks = par.pp * (par.vpp or 1)
    if dims.num_layers % chunks:
        raise ConfigError(f"{name}.parallel pp*vpp = {chunks} does not divide the model's {dims.num_layers} layers; "
                          f"choose pp (and vpp) whose product divides {dims.num_layers}")


def check_batches(name: str, sequences: int, mini: int, micro: int, dp: int) -> None:
    if mini < 1 or micro < 1:
        raise ConfigError(f"{name}.ppo_mini_batch_size and {name}.micro_batch_size must be >= 1")
    if sequences % mini:
        raise ConfigError(f"{name}.ppo_mini_batch_size={mini} does not divide the {sequences} sequences per step "
                          f"(data.train_batch_size*rollout.n); pick a divisor of {sequences}")
    if mini % (dp * micro):
        raise ConfigError(f"{name}.ppo_mini_batch_size={mini} is not divisible by dp*micro_batch_size = "
                          f"{dp}*{micro} = {dp * micro}; make it a multiple of {dp * micro}")


def check_weight_load(r) -> None:
    """rollout.weight_load / rollout.cpu_linear (also checked by VLLMRollout built without a config)."""
    if r.weight_load not in ("auto", "reload", "direct"):
        raise ConfigError(f"rollout.weight_load={r.weight_load!r} is not one of auto, reload, direct")
    if r.cpu_linear not in ("packed", "plain"):
        raise ConfigError(f"rollout.cpu_linear={r.cpu_linear!r} is not one of packed, plain")
    if r.cpu_linear == "plain" and r.weight_load == "reload":
        raise ConfigError("rollout.cpu_linear=plain needs rollout.weight_load=direct (reload re-packs every linear)")


def validate_config(cfg, check_paths: bool = False) -> None:
    check_choices(cfg)
    dims = model_dims(cfg)
    world = pool_size(cfg)
    if world < 1:
        raise ConfigError("resources.nodes and resources.workers_per_node must be >= 1")

    check_parallel("actor", cfg.actor.parallel, dims, world)
    if cfg.critic.enable:
        check_parallel("critic", cfg.critic.parallel, dims, world)
    if cfg.ref.enable:
        check_parallel("ref", cfg.ref.parallel, dims, world)
    if cfg.reward.model.enable:
        check_parallel("reward.model", cfg.reward.model.parallel, dims, world)
        if not cfg.reward.model.path:
            raise ConfigError("reward.model.enable=true needs reward.model.path (a HF *ForSequenceClassification dir)")

    r = cfg.rollout
    rollout_world = cfg.resources.rollout_workers or world
    if r.tp < 1 or rollout_world % r.tp:
        which = "resources.rollout_workers" if cfg.resources.rollout_workers else "the actor world size"
        raise ConfigError(f"rollout.tp={r.tp} does not divide {which} ({rollout_world}); pick a divisor of it")
    if dims.num_attention_heads % r.tp or dims.num_kv_heads % r.tp:
        raise ConfigError(f"rollout.tp={r.tp} does not divide the model's {dims.num_attention_heads} attention / "
                          f"{dims.num_kv_heads} key/value heads; use a tp that divides both")
    if r.n < 1:
        raise ConfigError(f"rollout.n={r.n} must be >= 1")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature} must be > 0 (PPO needs sampled responses)")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if r.max_new_tokens < 1:
        raise ConfigError(f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1")
    check_weight_load(r)

    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and r.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares responses to the same "
                          f"prompt; set rollout.n>=2")
    if cfg.algorithm.adv_estimator == "gae" and not cfg.critic.enable:
        raise ConfigError("algorithm.adv_estimator=gae needs a value model; set critic.enable=true or choose grpo/rloo")
    if cfg.algorithm.use_kl_in_reward and cfg.actor.use_kl_loss:
        raise ConfigError("KL is applied twice: set algorithm.use_kl_in_reward=false or actor.use_kl_loss=false")
    if (cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss) and not cfg.ref.enable:
        raise ConfigError("a KL penalty needs the reference model; set ref.enable=true or turn the KL off")

    d = cfg.data
    if d.train_batch_size < 1:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} must be >= 1")
    sequences = d.train_batch_size * r.n
    check_batches("actor", sequences, cfg.actor.ppo_mini_batch_size, cfg.actor.micro_batch_size,
                  cfg.actor.parallel.dp)
    if cfg.critic.enable:
        check_batches("critic", sequences, cfg.critic.ppo_mini_batch_size, cfg.critic.micro_batch_size,
                      cfg.critic.parallel.dp)
    if d.max_prompt_length + r.max_new_tokens > dims_max_positions(cfg):
        raise ConfigError(f"data.max_prompt_length + rollout.max_new_tokens = {d.max_prompt_length + r.max_new_tokens}"
                          f" exceeds the model's {dims_max_positions(cfg)} positions; shorten one of them")

    t = cfg.trainer
    if t.total_steps < 1:
        raise ConfigError(f"trainer.total_steps={t.total_steps} must be >= 1")
    if t.save_every < 0 or t.val_every < 0:
        raise ConfigError("trainer.save_every and trainer.val_every must be >= 0 (0 = never)")
    if t.mode == "async" and cfg.resources.rollout_workers < 1:
        raise ConfigError("trainer.mode=async runs rollout on its own pool; set resources.rollout_workers>=1")
    if t.resume not in ("auto", "never") and check_paths and not Path(t.resume).is_dir():
        raise ConfigError(f"trainer.resume={t.resume} is not a checkpoint directory; use auto, never or an existing dir")

    if check_paths:
        _check_paths(cfg)


def dims_max_positions(cfg) -> int:
    path = cfg.model.path
    if path and (Path(path) / "config.json").is_file():
        return json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings", 1 << 30)
    return cfg.model.arch.max_position_embeddings


def _check_paths(cfg) -> None:
    """Existence checks for files the run will read (used by `config check --paths` and the trainer)."""
    if not cfg.model.path:
        raise ConfigError("model.path is not set; point it at a HF model directory (config.json + *.safetensors)")
    checks = [("model.path", cfg.model.path, "config.json")]
    if cfg.model.tokenizer:
        checks.append(("model.tokenizer", cfg.model.tokenizer, None))
    if cfg.model.critic_path:
        checks.append(("model.critic_path", cfg.model.critic_path, "config.json"))
    if cfg.reward.model.enable:
        checks.append(("reward.model.path", cfg.reward.model.path, "config.json"))
    for key, path, must_have in checks:
        p = Path(path)
        if not p.is_dir():
            raise ConfigError(f"{key}={path} does not exist; point it at a HF model directory")
        if must_have and not (p / must_have).is_file():
            raise ConfigError(f"{key}={path} has no {must_have}; point it at a HF model directory")
    for key in ("train_files", "val_files"):
        for f in cfg.data[key]:
            if not Path(f).is_file():
                raise ConfigError(f"data.{key} entry {f} does not exist; create it (see megappo/data) or fix the path")
    out = Path(cfg.trainer.output_dir)
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    import os

    if not os.access(probe, os.W_OK):
        raise ConfigError(f"trainer.output_dir={out} is not writable ({probe} denies writes); choose another dir")
