"""The config's checks of what is on disk (validate_config's check_paths=True: `megappo train`, `megappo config
check`): the model and tokenizer dirs, their safetensors headers and routed experts, the data files, the output dir
and the checkpoint a resume starts from. Each failure is one ConfigError line naming the fix; nothing is loaded
beyond file headers (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

from megappo.config.errors import ConfigError
from megappo.parallel.model_dims import ModelDims


def hf_config_json(cfg) -> dict | None:
    """model.path's config.json, when it has one (None: no path, or a dir without it)."""
    path = cfg.model.path
    if path and (Path(path) / "config.json").is_file():
        return json.loads((Path(path) / "config.json").read_text())
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_on_disk(cfg) -> None:
    """What the run will read, before any worker starts (`config check --paths`, `megappo train`):
    model dirs with a config.json and readable weights, a tokenizer, the data files, a writable output
    dir, and a resume checkpoint that is whole and of this model."""
    if not cfg.model.path:
        raise ConfigError("model.path is not set; point it at a HF model directory (config.json + *.safetensors)")
    checks = [("model.path", cfg.model.path)]
    if cfg.model.critic_path:
        checks.append(("model.critic_path", cfg.model.critic_path))
    if cfg.reward.model.enable:
        checks.append(("reward.model.path", cfg.reward.model.path))
    if cfg.teacher.model:
        checks.append(("teacher.model", cfg.teacher.model))
    for key, path in checks:
        _check_model_dir(key, Path(path))
    tok_key, tok = ("model.tokenizer", cfg.model.tokenizer) if cfg.model.tokenizer else ("model.path", cfg.model.path)
    if not Path(tok).is_dir():
        raise ConfigError(f"{tok_key}={tok} does not exist; point it at the model's tokenizer dir")
    if not any((Path(tok) / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"{tok_key}={tok} has no tokenizer ({' / '.join(TOKENIZER_FILES)}); copy the tokenizer "
                          "files of the model there, or set model.tokenizer")
    if cfg.rollout.agent_tool_parser is not None:  # its marker tokens in this vocabulary
        from transformers import AutoTokenizer

        from megappo.gateway.tool_calls import check_tool_parser

        try:
            check_tool_parser(cfg.rollout.agent_tool_parser, AutoTokenizer.from_pretrained(tok))
        except ValueError as e:
            raise ConfigError(f"rollout.agent_tool_parser: {e}") from None
    if cfg.teacher.model:
        from megappo.model_dirs import ModelDirError, check_same_tokenizer

        try:
            check_same_tokenizer(cfg.teacher.model, tok)
        except ModelDirError as e:
            raise ConfigError(str(e)) from None
    for key in ("train_files", "val_files"):
        for f in cfg.data[key]:
            if not Path(f).is_file():
                raise ConfigError(f"data.{key} entry {f} does not exist; create it (see megappo/data) or fix the path")
    _check_output_dir(Path(cfg.trainer.output_dir))
    _check_resume(cfg)


def _check_model_dir(key: str, p: Path) -> None:
    """config.json plus weights whose headers read: HF safetensors, or a megatron dist checkpoint."""
    if not p.is_dir():
        raise ConfigError(f"{key}={p} does not exist; point it at a HF model directory")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{key}={p} has no config.json; point it at a HF model directory")
    files = sorted(p.glob("*.safetensors"))
    if not files and not (p / "metadata.json").is_file():
        raise ConfigError(f"{key}={p} has no weights (*.safetensors, or a megatron dist checkpoint's metadata.json); "
                          "point it at a complete model directory")
    from safetensors import safe_open

    names: set = set()
    for f in files:
        try:
            with safe_open(str(f), "np") as h:  # the header only: no torch import
                names.update(h.keys())
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ConfigError(f"{key}: {f} is not a readable safetensors file ({str(e).splitlines()[0][:120]}); "
                              "re-download or re-export the model") from None
    if files:
        _check_expert_tensors(key, p, names)


def _check_expert_tensors(key: str, p: Path, names: set) -> None:
    """A mixture-of-experts checkpoint holds every routed expert of every MoE layer, and no expert beyond
    config.json's count (a checkpoint of another expert count under this config would load wrongly)."""
    import re

    from megappo.parallel.weight_mapping import hf_names, is_hf_moe_tensor, megatron_param_names, routed_expert

    try:
        dims = ModelDims.from_hf_dict(json.loads((p / "config.json").read_text()))
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{key}={p}: config.json: {e}") from None
    if not dims.num_experts:
        return
    held = [int(m.group(1)) for n in names if is_hf_moe_tensor(n) and (m := re.search(r"\.experts\.(\d+)\.", n))]
    if held and max(held) >= dims.num_experts:
        raise ConfigError(f"{key}={p} holds expert {max(held)} but its config.json says num_experts="
                          f"{dims.num_experts}; use the config.json that came with these weights")
    expected = [h for n in megatron_param_names(dims) if routed_expert(n) is not None for h in hf_names(n, dims)]
    missing = [n for n in expected if n not in names]
    if missing:
        raise ConfigError(f"{key}={p} lacks {len(missing)} routed-expert tensor(s) of its config.json's "
                          f"{dims.num_experts} experts, e.g. {missing[0]}; re-download or re-export the model")


def _check_output_dir(out: Path) -> None:
    import os

    blocker = next((p for p in [out, *out.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"trainer.output_dir={out} cannot be created: {blocker} is a file; choose another dir")
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not os.access(probe, os.W_OK):
        raise ConfigError(f"trainer.output_dir={out} is not writable ({probe} denies writes); choose another dir")


def _check_resume(cfg) -> None:
    """trainer.resume: an explicit checkpoint must be whole; any checkpoint resumed must be of this model."""
    from megappo.utils.checkpoint import MANIFEST, is_complete, latest_checkpoint, lora_checkpoint_problem, \
        megatron_format_problem, software_stack

    mode = cfg.trainer.resume
    if mode == "never":
        return
    if mode == "auto":
        path = latest_checkpoint(Path(cfg.trainer.output_dir) / "checkpoints")
    else:
        path = Path(mode)
        if not is_complete(path):
            raise ConfigError(f"trainer.resume={mode} is a torn checkpoint (no valid {MANIFEST}: its save was cut "
                              "short); point it at an earlier step, or use resume=auto")
    problem = path and megatron_format_problem(path, software_stack()["megatron-core"])
    if problem:
        raise ConfigError(f"trainer.resume={mode}: {problem}")
    problem = path and (path / "actor").is_dir() and lora_checkpoint_problem(path / "actor", cfg.actor.lora,
                                                                             cfg.model.path)
    if problem:  # the adapters of another rank or base, LoRA vs full: before any worker starts
        raise ConfigError(f"trainer.resume={mode}: {problem}")
    theirs = None if path is None else path / "actor" / "config.json"
    if theirs is None or not theirs.is_file():
        return  # checkpoints written before they carried their config: nothing to compare
    mine, saved = hf_config_json(cfg), json.loads(theirs.read_text())
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    diff = [f"{k} {saved.get(k)} vs {mine.get(k)}" for k in keys if mine and saved.get(k) != mine.get(k)]
    if diff:
        raise ConfigError(f"trainer.resume: checkpoint {path} is of another model ({', '.join(diff)} in model.path); "
                          "use its model, another trainer.output_dir, or trainer.resume=never")
