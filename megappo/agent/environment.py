"""Environments: what a row's trajectory runs against and how it is scored, chosen per row by its
data_source (as reward rules are for single-turn rows).

    envs = Environments(cfg.rollout.multi_turn, rules=DEFAULT_SCORERS)  # in the driver
    envs.tools_for("arithmetic")       # ('calculator',): the tools this row is shown and may call
    envs.score("arithmetic", turns, ground_truth, stopped)   # the finished trajectory's reward

An Environment is plain Python: `tools` (names from agent/tools.TOOLS; None = rollout.multi_turn.tools)
and `score(episode) -> float`, where the Episode is the whole trajectory: every assistant turn's text,
every tool call with its arguments, result and whether it failed, the row's ground truth and whether
the sample ended with an answer. Every data_source with a reward rule gets a RuleEnvironment (the
config's tools; the rule applied to the final answer, the last assistant turn). Others are registered
in the config, as an Environment subclass or a factory called with no arguments:

    rollout.multi_turn.environments: {my_source: my_pkg.envs:SearchEnv}

The module must be importable by the driver (the reward is computed there; the rollout workers are
sent the row's tool names, never the object). A row whose data_source has no environment is refused
before any worker starts (RayPPOTrainer._check_inputs).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


@dataclass(frozen=True)
class Episode:
    """A finished multi-turn trajectory, as an environment's reward sees it."""

    turns: tuple  # {"role": "assistant", "text"} | {"role": "tool", "name", "arguments", "text", "error"}
    ground_truth: Any
    data_source: str
    stopped: bool  # ended with an answer turn (not cut by the token budget, max_turns or max_tool_calls)
    extra_info: Any = None  # the row's extra_info dict (the reward rule's third argument)

    @property
    def answer(self) -> str:
        """The last assistant turn's text ('' when there is none)."""
        return next((t["text"] for t in reversed(self.turns) if t["role"] == "assistant"), "")

    @property
    def tool_calls(self) -> list[dict]:
        return [t for t in self.turns if t["role"] == "tool"]


class Environment:
    tools: Optional[Sequence[str]] = None  # None: rollout.multi_turn.tools

    def score(self, episode: Episode) -> float:
        raise NotImplementedError


class RuleEnvironment(Environment):
    """A reward rule (rewards/rules.py: response text, ground truth, extra_info) -> score, applied to the
    episode's final answer."""

    def __init__(self, rule: Callable, tools: Optional[Sequence[str]] = None):
        self.rule, self.tools = rule, tools

    def score(self, episode: Episode) -> float:
        from megappo.rewards.rules import score_one

        return score_one(self.rule, episode.answer, episode.ground_truth, episode.extra_info or {})


def split_target(source: str, target: str) -> tuple[str, str]:
    from megappo.rewards.rules import split_target as split

    return split(f"rollout.multi_turn.environments.{source}", target, "my_pkg.envs:SearchEnv", what="attribute")


def load_environment(source: str, target: str) -> Environment:
    """'pkg.module:attr' -> the Environment it names (a class or factory is called with no arguments)."""
    where = f"rollout.multi_turn.environments.{source}={target}"
    module, attr = split_target(source, target)
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}: cannot load it ({type(e).__name__}: {e}); put the module on PYTHONPATH or "
                         "fix the name") from None
    env = obj() if callable(obj) and not isinstance(obj, Environment) else obj
    if not callable(getattr(env, "score", None)):
        raise ValueError(f"{where} gave {type(env).__name__}, which has no score(episode) method; subclass "
                         "megappo.agent.environment.Environment")
    return env


class Environments:
    """data_source -> Environment for a multi-turn run: rule environments for every reward rule, then
    the configured ones (which win)."""

    def __init__(self, multi_turn, rules: dict[str, Callable]):
        from megappo.agent.tools import TOOLS

        self.default_tools = tuple(multi_turn.tools)
        self.envs: dict[str, Environment] = {source: RuleEnvironment(rule) for source, rule in rules.items()}
        self.tool_prompt = multi_turn.tool_prompt
        for source, target in dict(getattr(multi_turn, "environments", None) or {}).items():
            self.envs[str(source)] = load_environment(str(source), str(target))
        for source, env in self.envs.items():
            unknown = [t for t in (env.tools or ()) if t not in TOOLS]
            if unknown:
                raise ValueError(f"the environment of data_source {source!r} names unknown tool(s) {unknown}; known: "
                                 f"{', '.join(sorted(TOOLS))}")
            if "python" in (env.tools or ()) and "python" not in self.default_tools:
                from megappo.sandbox.run import isolation_problem

                problem = isolation_problem()
                if problem:
                    raise ValueError(f"the environment of data_source {source!r} offers the python tool, whose "
                                     f"sandbox this machine cannot make ({problem}); enable user namespaces")

    def get(self, source: str) -> Environment:
        try:
            return self.envs[source]
        except KeyError:
            raise ValueError(
                f"no environment for data_source {source!r} (known: {', '.join(sorted(self.envs))}); register one "
                f"with rollout.multi_turn.environments.{source}=my_pkg.envs:MyEnv (an agent.environment.Environment)"
            ) from None

    def tools_for(self, source: str) -> tuple[str, ...]:
        env = self.get(source)
        return tuple(env.tools) if env.tools is not None else self.default_tools

    def prompt_args(self) -> dict:
        """RLHFDataset's arguments: each row is shown (and may call) its environment's tools."""
        return {"tools_for": self.tools_for, "tool_prompt": self.tool_prompt}

    def score(self, source: str, turns, ground_truth, stopped: bool, extra_info=None) -> float:
        """The environment's score of the trajectory; a reward its own agent returned (rollout.agent: a last
        turn {"role": "reward", "value": r}, gateway/agents.py) wins when it is set."""
        turns = tuple(turns)
        if turns and turns[-1].get("role") == "reward":
            if turns[-1].get("value") is not None:
                return float(turns[-1]["value"])
            turns = turns[:-1]
        return float(self.get(source).score(Episode(turns, ground_truth, source, bool(stopped), extra_info)))


__all__ = ["Episode", "Environment", "RuleEnvironment", "Environments", "load_environment"]
