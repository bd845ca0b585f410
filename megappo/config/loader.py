"""Load a config: YAML defaults chain -> dotted CLI overrides -> typed schema -> validation.

A YAML file may start with `defaults: [base.yaml, ...]` (paths relative to that file); those are
loaded first (recursively), then the file itself is merged on top, then the `key=value` overrides.
Every problem is a `ConfigError` whose message is one line naming the key and the fix.
"""

from __future__ import annotations

import difflib
import os
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megappo.config.errors import ConfigError
from megappo.config.schema import MegappoConfig, ParallelConfig
from megappo.config.validate import validate_config


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> DictConfig:
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"{path}: defaults chain loops back to itself ({' -> '.join(p.name for p in chain)})")
    if not path.is_file():
        where = f" (listed in the defaults of {chain[-1]})" if chain else ""
        raise ConfigError(f"config file {path}{where} does not exist; pass an existing YAML, e.g. configs/ppo_tiny.yaml")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    defaults = raw.pop("defaults", []) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    merged = OmegaConf.create()
    for d in defaults:
        merged = OmegaConf.merge(merged, _read_yaml(path.parent / d, chain + (path,)))
    return OmegaConf.merge(merged, OmegaConf.create(raw))


def _check_unknown_keys(node: Any, schema_cls, prefix: str = "") -> None:
    """Raise on the first key the schema does not declare, suggesting the closest declared one."""
    if not isinstance(node, (dict, DictConfig)):
        return
    declared = [f.name for f in fields(schema_cls)]
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in declared:
            close = difflib.get_close_matches(str(key), list(declared), n=1, cutoff=0.5)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"valid keys here: {', '.join(declared)}"
            raise ConfigError(f"unknown config key '{full}': {hint}")
        sub_cls = typing.get_type_hints(schema_cls).get(key)
        if is_dataclass(sub_cls):
            _check_unknown_keys(node[key], sub_cls, full + ".")


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for o in overrides:
        if "=" not in o or o.startswith("="):
            raise ConfigError(f"override '{o}' is not key=value; write e.g. trainer.total_steps=10")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot parse overrides: {str(e).splitlines()[0]}") from None


def load_config(path: str | os.PathLike, overrides: list[str] = (), validate: bool = True,
                check_paths: bool = False) -> MegappoConfig:
    """Resolve `path` + `overrides` into a typed MegappoConfig (an OmegaConf structured object)."""
    user = OmegaConf.merge(_read_yaml(Path(path)), _parse_overrides(list(overrides)))
    _check_unknown_keys(user, MegappoConfig)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(MegappoConfig), user)
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        first = str(e).splitlines()[0]
        key = getattr(e, "full_key", None)
        raise ConfigError(f"config key '{key}': {first}" if key else first) from None
    _absolute_rule_files(cfg)
    _default_teacher_layout(cfg, user)
    if validate:
        validate_config(cfg, check_paths=check_paths)
    return cfg


def _absolute_rule_files(cfg) -> None:
    """reward.rules' and rollout.agent's file targets (path/to/file.py:fn) as absolute paths: the saved config.json (megappo eval
    --config) and any process loads the same file wherever it runs."""
    from megappo.rewards.rules import absolute_target

    for source, spec in cfg.reward.rules.items():
        if isinstance(spec, str):
            cfg.reward.rules[source] = absolute_target(spec)
        elif isinstance(spec, DictConfig) and isinstance(spec.get("fn"), str):
            spec.fn = absolute_target(spec.fn)
    if isinstance(cfg.rollout.agent, str):  # rollout.agent=path/to/agent.py:run, loaded by every rollout worker
        cfg.rollout.agent = absolute_target(cfg.rollout.agent)


def _default_teacher_layout(cfg, user) -> None:
    """A teacher.model without a teacher.parallel of its own: the actor's tp / pp / dp (the pool's workers, as every
    colocated role), or dp over resources.teacher_workers on a pool of its own."""
    if not cfg.teacher.model or OmegaConf.select(user, "teacher.parallel") is not None:
        return
    own, a = cfg.resources.teacher_workers, cfg.actor.parallel
    cfg.teacher.parallel = ParallelConfig(dp=own) if own else ParallelConfig(tp=a.tp, pp=a.pp, dp=a.dp, cp=a.cp)


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(cfg)


def to_dict(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
