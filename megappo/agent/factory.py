"""The multi-turn agent loop a rollout engine runs, built by its caller (not by the engine):

    rollout = VLLMRollout(model, cfg.rollout, agent=agent_loop_builder(cfg.rollout.multi_turn))

`agent_loop_builder` returns None when multi-turn is off, else a builder that VLLMRollout calls once its
vLLM engine and tokenizer exist: `builder(llm, tokenizer) -> AgentLoop` (agent/loop.py; the loop owns its
tools and their thread pool).
"""

from __future__ import annotations

import importlib
import inspect
from functools import partial
from pathlib import Path
from typing import Callable, Optional


def agent_loop_builder(multi_turn) -> Optional[Callable]:
    """None when `multi_turn` (rollout.multi_turn) is absent or off; else `(llm, tokenizer) -> AgentLoop`."""
    if multi_turn is None or not multi_turn.enable:
        return None
    from megappo.agent.loop import AgentLoop

    return partial(AgentLoop, config=multi_turn)


def is_async_agent(fn) -> bool:
    """An agent whose call is a coroutine: an `async def`, or an object whose `__call__` is one (a class instance
    holding a framework's agent); anything else is called in a thread, with a synchronous client."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def load_agent(target: str) -> Callable:
    """'pkg.module:fn' or '/path/to/file.py:fn' -> the agent: an async or a plain function, or a callable object,
    taking (client, row) (one line when it is not one)."""
    from megappo.rewards.rules import _import_file, is_file, split_target

    module, name = split_target("rollout.agent", target, "my_pkg.my_agent:run")
    try:
        mod = _import_file(Path(module).expanduser().resolve()) if is_file(module) else importlib.import_module(module)
        fn = getattr(mod, name)
    except (ImportError, AttributeError, OSError) as e:
        raise ValueError(f"rollout.agent={target}: cannot load it ({type(e).__name__}: {e}); put the module on "
                         "PYTHONPATH or fix the name") from None
    if not callable(fn):
        raise ValueError(f"rollout.agent={target} is a {type(fn).__name__}, not something to call; name a function "
                         "or an object with __call__(client, row)")
    try:
        inspect.signature(fn).bind(None, None)
    except (TypeError, ValueError):
        raise ValueError(f"rollout.agent={target} must take (client, row): an OpenAI client and the row") from None
    return fn
