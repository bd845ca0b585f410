"""The multi-turn agent loop a rollout engine runs, built by its caller (not by the engine):

    rollout = VLLMRollout(model, cfg.rollout, agent=agent_loop_builder(cfg.rollout.multi_turn))

`agent_loop_builder` returns None when multi-turn is off, else a builder that VLLMRollout calls once its
vLLM engine and tokenizer exist: `builder(llm, tokenizer) -> AgentLoop` (agent/loop.py; the loop owns its
tools and their thread pool).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional


def agent_loop_builder(multi_turn) -> Optional[Callable]:
    """None when `multi_turn` (rollout.multi_turn) is absent or off; else `(llm, tokenizer) -> AgentLoop`."""
    if multi_turn is None or not multi_turn.enable:
        return None
    from megappo.agent.loop import AgentLoop

    return partial(AgentLoop, config=multi_turn)
