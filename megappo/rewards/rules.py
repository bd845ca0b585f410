"""Reward rules: the function that scores the responses of one data_source. One calling convention for
every rule, the built-in ones below and those a config names:

    fn(response: str, ground_truth, extra_info: dict) -> float | {"score": float, <metric>: number, ...}

A dict's other numbers are logged per data_source (reward/<source>/<metric> in training, the source's
line of `megappo eval`'s by_source); its other values are ignored. A batched rule is called once per
data_source and batch, with lists (for a scorer that calls a service, e.g. an LLM judge over HTTP):

    fn(responses: list[str], ground_truths: list, extra_infos: list[dict]) -> list[float | dict]

A rule that raises, returns something else, or runs past its timeout_s scores 0 on the rows of that
call, counted in reward/num_scorer_errors (timeouts also in reward/num_scorer_timeouts). Config:

    reward.rules:
      my_source: my_pkg.rewards:score                  # an importable module
      other: /path/to/file.py:score                    # a script; a relative path is made absolute at load
      judged: {fn: my_pkg.judge:score_batch, batched: true, timeout_s: 30}

A config rule for a built-in data_source (gsm8k, math, arithmetic, code, ...) replaces the built-in one,
with a warning. The built-in `code` source runs the response's program against the row's tests in the
sandbox (rewards/code.py, reward.code); reward.combine makes a source's score a weighted sum of terms
(rewards/combine.py). load_rewards(cfg.reward) is every rule the config gives, RewardManager's scorers.
Rules run in the driver (the trainer's reward step, megappo eval, megappo reward); no worker imports them.
This module imports no torch (the config loader uses it).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from megappo.rewards import arithmetic, gsm8k

log = logging.getLogger(__name__)
SPEC_KEYS = ("fn", "batched", "timeout_s")
# extra_info's reserved key for the row's prompt text, filled for a rule whose fn has `needs_prompt` (the judge):
# the RewardManager and `megappo reward` put it there; other rules never see it
PROMPT = "_megappo_prompt"


@dataclass(frozen=True)
class Rule:
    fn: Callable
    batched: bool = False
    timeout_s: Optional[float] = None  # per call (a row, or a batched call); None = no limit


@dataclass(frozen=True)
class Scored:
    """One row's rule result: its score, the rule's extra metrics, and "" | "error" | "timeout"."""

    score: float
    extras: dict = field(default_factory=dict)
    failure: str = ""


class RuleTimeout(Exception):
    pass


def _gsm8k(response: str, ground_truth, extra_info) -> float:
    return gsm8k.compute_score(response, ground_truth)


def _arithmetic(response: str, ground_truth, extra_info) -> float:
    return arithmetic.compute_score(response, ground_truth)


def _math(response: str, ground_truth, extra_info) -> float:
    from megappo.rewards import math as math_scorer  # math-verify pulls in sympy: import on first use

    return math_scorer.compute_score(response, ground_truth)


def _code(responses: list, ground_truths: list, extra_infos: list) -> list:
    from megappo.rewards import code  # the program against its tests, in the sandbox (rewards/code.py)

    return code.score_batch(responses, ground_truths, extra_infos)


DEFAULT_SCORERS: dict[str, Callable | Rule] = {
    "gsm8k": _gsm8k,
    "openai/gsm8k": _gsm8k,
    "math": _math,
    "lighteval/MATH": _math,
    "math_dapo": _math,
    "arithmetic": _arithmetic,
    "code": Rule(_code, batched=True),  # reward.code's defaults; load_rewards gives the config's settings
}


def as_rule(rule) -> Rule:
    return rule if isinstance(rule, Rule) else Rule(rule)


def needs_prompt(rule) -> bool:
    """The rule reads the row's prompt (extra_info[PROMPT]): the judge, or a combination with a judge term."""
    return bool(getattr(as_rule(rule).fn, "needs_prompt", False))


def prompt_text(prompt) -> str:
    """A row's prompt as the judge reads it: text as it is; chat messages: the last user turn's content."""
    if isinstance(prompt, str):
        return prompt
    try:
        users = [m["content"] for m in prompt if m.get("role") == "user"]
    except (TypeError, AttributeError, KeyError):
        return "" if prompt is None else str(prompt)
    return str(users[-1]) if users else ""


# ---- loading (config) ------------------------------------------------------------------------------

def spec_fields(source: str, spec) -> tuple[str, bool, Optional[float]]:
    """A reward.rules value -> (target "module:fn" or "file.py:fn", batched, timeout_s)."""
    where = f"reward.rules.{source}"
    if isinstance(spec, str):
        return spec, False, None
    if not hasattr(spec, "keys"):
        raise ValueError(f"{where}={spec!r} is neither 'module:function' nor {{fn: ..., batched: ..., timeout_s: ...}}; "
                         "write e.g. my_pkg.rewards:score")
    unknown = [k for k in spec.keys() if k not in SPEC_KEYS]
    if unknown or not isinstance(spec.get("fn"), str):
        what = f"has unknown key(s) {unknown}" if unknown else "has no fn"
        raise ValueError(f"{where} {what}; its keys are {', '.join(SPEC_KEYS)}, e.g. {{fn: my_pkg.judge:score_batch, "
                         "batched: true, timeout_s: 30}")
    timeout = spec.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"{where}.timeout_s={timeout!r} must be a number of seconds > 0 (or null: no limit)")
    batched = spec.get("batched", False)
    if not isinstance(batched, bool):
        raise ValueError(f"{where}.batched={batched!r} must be true or false")
    return spec["fn"], batched, None if timeout is None else float(timeout)


def split_target(where: str, target: str, example: str, what: str = "function") -> tuple[str, str]:
    """'pkg.mod:fn' or '/path/file.py:fn' -> (module or path, name); the last ':' splits them. The one
    parser of the config's code references (reward rules, environments, rollout.agent)."""
    module, _, name = str(target).rpartition(":")
    if not module or not name:
        raise ValueError(f"{where}={target} is not 'module:{what}'; write e.g. {example}")
    return module, name


def is_file(module: str) -> bool:
    return module.endswith(".py") or "/" in module


def absolute_target(target: str) -> str:
    """A file target's path made absolute (against the current dir), so the rule loads from anywhere."""
    module, sep, name = target.rpartition(":")
    if not sep or not is_file(module):
        return target
    return f"{Path(module).expanduser().resolve()}:{name}"


def _import_file(path: Path):
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"megappo_rule_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(source: str, module: str):
    path = Path(module).expanduser().resolve() if is_file(module) else None
    if path is not None and not path.is_file():
        raise ValueError(f"reward.rules.{source}: file {path} does not exist; fix the path (a relative one is taken "
                         "from the directory megappo runs in)")
    try:
        return _import_file(path) if path is not None else importlib.import_module(module)
    except ModuleNotFoundError as e:
        if path is None and e.name and (module == e.name or module.startswith(f"{e.name}.")):
            raise ValueError(f"reward.rules.{source}: cannot import {module} ({e}); put its directory on PYTHONPATH, "
                             "pip install it, or name the file: /path/to/file.py:function") from None
        raise ValueError(f"reward.rules.{source}: importing {module} failed ({e}); install what it "
                         "imports") from None
    except Exception as e:  # noqa: BLE001 - the module's own code failed at import
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"reward.rules.{source}: importing {module} raised {type(e).__name__}: {first}; "
                         "fix the module") from None


def check_signature(where: str, fn: Callable, batched: bool) -> None:
    """The rule must take 3 positional arguments (lists of them when batched)."""
    if not callable(fn):
        raise ValueError(f"{where} is a {type(fn).__name__}, not a function; name a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its first call tells
    try:
        sig.bind(None, None, None)
    except TypeError:
        want = ("fn(responses, ground_truths, extra_infos) -> list of scores (batched: lists)" if batched
                else "fn(response, ground_truth, extra_info) -> score")
        raise ValueError(f"{where} has the signature {sig}, but a rule is {want}; give it 3 positional "
                         "parameters") from None


def load_rule(source: str, spec) -> Rule:
    """One reward.rules entry -> its Rule (imported, signature checked); ValueError naming the fix."""
    target, batched, timeout = spec_fields(source, spec)
    module, name = split_target(f"reward.rules.{source}", target, "my_pkg.rewards:score or /path/to/file.py:score")
    obj = getattr(_import(source, module), name, None)
    if obj is None:
        raise ValueError(f"reward.rules.{source}: {module} has no {name!r}; fix the function name after the ':'")
    check_signature(f"reward.rules.{source}={target}", obj, batched)
    return Rule(obj, batched, timeout)


def load_rewards(reward) -> dict[str, Rule]:
    """The config's reward section -> {data_source: Rule}, RewardManager's scorers: reward.rules, the built-in
    `code` source with reward.code's settings, the sources reward.judge.sources names (the judge alone), and
    each reward.combine source (rewards/combine.py), which replaces a rule of the same source. ValueError
    naming the fix."""
    from megappo.rewards.code import CodeReward
    from megappo.rewards.combine import load_combine

    code = Rule(CodeReward.from_config(reward.code), batched=True)
    judge = load_judge(reward)
    rules = {"code": code, **load_rules(reward.rules)}
    sources = [str(s) for s in (judge_cfg(reward).sources or [])] if judge is not None else []
    for source in sources:
        if source in reward.rules or source in (reward.combine or {}):
            where = "reward.rules" if source in reward.rules else "reward.combine"
            raise ValueError(f"reward.judge.sources names {source!r}, which {where}.{source} also scores; give the "
                             f"source one reward (a combine term `judge` mixes the judge with others)")
    rules.update({source: judge for source in sources})
    return {**rules, **load_combine(reward.combine, code, {**DEFAULT_SCORERS, **rules}, reward.model.enable, judge)}


def judge_cfg(reward):
    return getattr(reward, "judge", None)


def load_judge(reward) -> Optional[Rule]:
    """reward.judge as a batched Rule, or None when the section is unset (no endpoint, model or sources)."""
    judge = judge_cfg(reward)
    if judge is None or not (judge.endpoint or judge.model or judge.sources):
        return None
    from megappo.rewards.judge import JudgeReward

    return Rule(JudgeReward(judge), batched=True)


def load_rules(rules) -> dict[str, Rule]:
    """reward.rules -> {data_source: Rule}; one overriding a built-in rule is allowed, with a warning."""
    out = {str(source): load_rule(str(source), spec) for source, spec in dict(rules or {}).items()}
    for source in sorted(set(out) & set(DEFAULT_SCORERS)):
        log.warning("reward.rules.%s replaces megappo's built-in %r rule", source, source)
    return out


# ---- scoring ---------------------------------------------------------------------------------------

def _call(rule: Rule, args: tuple):
    """rule.fn(*args), or RuleTimeout after rule.timeout_s (the call is left running in a daemon thread)."""
    if rule.timeout_s is None:
        return rule.fn(*args)
    out: dict = {}

    def run():
        try:
            out["value"] = rule.fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    t = threading.Thread(target=run, name="reward-rule", daemon=True)
    t.start()
    t.join(rule.timeout_s)
    if t.is_alive():
        raise RuleTimeout(f"no result within timeout_s={rule.timeout_s}")
    if "error" in out:
        raise out["error"]
    return out["value"]


def as_reward(value) -> float:
    """A reward as a float: a finite real number (a Python, numpy or 0-d torch number; not a bool, a string, None,
    NaN or inf), else ValueError. The one rule for every reward: a rule's score (a NaN would poison its group's
    advantages) and your own agent's (gateway/app.py)."""
    number = None
    if not (value is None or isinstance(value, (str, bytes, bytearray)) or type(value).__name__ in ("bool", "bool_")
            or getattr(value, "ndim", 0) != 0):  # not a bool, a string or an array of more than a number
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            pass
    if number is None or not math.isfinite(number):
        try:
            shown = str(value)[:40]
        except ValueError:  # an integer past Python's str() digit limit
            shown = f"<{type(value).__name__}>"
        raise ValueError(f"reward {shown!r} is not a finite number")
    return number


def parse(value) -> Scored:
    """A rule's return value -> Scored: a number, or a dict with a "score" and extra numbers (as_reward's rule:
    a NaN, an inf or a non-number fails the call, which scores its rows 0 as failed), or a Scored as it is (a
    batched rule that failed on some rows only: rewards/code.py, rewards/combine.py)."""
    if isinstance(value, Scored):
        return value
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without a 'score' key (keys: {sorted(value)})")
        extras = {str(k): float(v) for k, v in value.items() if k != "score" and isinstance(v, (int, float))}
        return Scored(as_reward(value["score"]), extras)
    return Scored(as_reward(value))


def _results(rule: Rule, args: tuple, n: int) -> list[Scored]:
    if not rule.batched:
        return [parse(_call(rule, args))]
    values = _call(rule, args)
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} results" if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"a batched rule returned {got} for {n} rows; return one score (or dict) per row")
    return [parse(v) for v in values]


def score_group(rule, source: str, responses: list, ground_truths: list, extra_infos: list) -> list[Scored]:
    """The rows of one data_source scored by its rule (per row, or in one call when batched). A failed call
    scores its rows 0 with failure "error" or "timeout", warned once per group."""
    rule = as_rule(rule)
    calls = ([(list(responses), list(ground_truths), list(extra_infos))] if rule.batched
             else list(zip(responses, ground_truths, extra_infos)))
    out, failed, first = [], 0, None
    for args in calls:
        n = len(args[0]) if rule.batched else 1
        try:
            out += _results(rule, args, n)
        except Exception as e:  # noqa: BLE001 - a user's rule failing scores its rows 0
            first, failed = first or e, failed + n
            out += [Scored(0.0, {}, "timeout" if isinstance(e, RuleTimeout) else "error")] * n
    if first is not None:
        log.warning("reward rule for data_source %r failed on %d of %d rows (%s: %s); scored them 0",
                    source, failed, len(responses), type(first).__name__, first)
    return out


def score_one(rule, response: str, ground_truth, extra_info) -> float:
    """One row's score (a multi-turn episode's final answer); raises what the rule raises."""
    rule = as_rule(rule)
    args = ([response], [ground_truth], [extra_info]) if rule.batched else (response, ground_truth, extra_info)
    return _results(rule, args, 1)[0].score
