"""Environments of other libraries as `rollout.agent`: thin adapters from their rollout / step interface to a
sample's gateway session (the OpenAI client rollout.agent is given), so their samples are trained on exactly the
ids the engine sampled. Agent frameworks (the OpenAI Agents SDK, LangGraph over ChatOpenAI) need none: they take
the client, or its base_url and key, as they are (docs/agents.md).

    # my_envs.py, then rollout.agent=my_envs:solve
    import verifiers as vf
    from megappo.gateway.adapters import verifiers_agent
    solve = verifiers_agent(vf.SingleTurnEnv(dataset=..., rubric=vf.Rubric(funcs=[correct])))

    from megappo.gateway.adapters import openenv_agent
    solve = openenv_agent(lambda row: GuessEnv(), action_of=lambda text: Guess(n=int(text.split()[0])))

The libraries are imported by the code that builds the environment, never here.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

MODEL = "policy"  # the name the adapters send (the gateway serves any)


def verifiers_agent(env, sampling_args: Optional[dict] = None) -> Callable:
    """A `verifiers` environment (its classic API: SingleTurnEnv, MultiTurnEnv, ToolEnv, ...) as rollout.agent:
    each sample is one `env.run_rollout` over the session's client, from the row's messages, answer and
    extra_info; its reward is the environment's rubric's."""
    async def run(client, row: dict) -> float:
        import verifiers as vf

        rollout = {"prompt": list(row["messages"]), "example_id": int(row.get("index") or 0),
                   "answer": str(row.get("ground_truth", "")), "info": dict(row.get("extra_info") or {})}
        out = await env.run_rollout(rollout, vf.OpenAIChatCompletionsClient(client), MODEL, dict(sampling_args or {}))
        if out.get("error"):
            raise RuntimeError(f"verifiers rollout failed: {out['error']}")
        return float(out["reward"])

    return run


def openenv_agent(make_env: Callable, action_of: Callable, prompt_of: Optional[Callable] = None,
                  max_steps: int = 8, max_tokens: Optional[int] = None) -> Callable:
    """An OpenEnv environment (openenv.core's Environment: reset / step with Action and Observation) as rollout.agent,
    the session's model its policy: a new environment per sample (`make_env(row)`), reset; the row's messages and
    each observation as a user message (`prompt_of(observation)`, default its `text` field or its repr); the model's
    reply becomes an action (`action_of(text)`) for `step`, until the observation is done or `max_steps`; the reward
    is the sum of the observations' rewards. A reply `action_of` cannot read ends the episode with what it has."""
    show = prompt_of or (lambda obs: str(getattr(obs, "text", None) or obs))

    async def run(client, row: dict) -> float:
        env = make_env(row)
        obs = await _call(env, "reset")
        messages, total = list(row["messages"]), float(getattr(obs, "reward", None) or 0.0)
        for _ in range(max_steps):
            if getattr(obs, "done", False):
                break
            messages.append({"role": "user", "content": show(obs)})
            kwargs = {"max_tokens": max_tokens} if max_tokens else {}
            reply = await client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            try:
                action = action_of(text)
            except (ValueError, TypeError, KeyError, IndexError):  # a reply that is no action: the episode ends
                break
            obs = await _call(env, "step", action)
            total += float(getattr(obs, "reward", None) or 0.0)
        return total

    return run


async def _call(env, method: str, *args):
    """The environment's async method when it has one (OpenEnv's reset_async / step_async), else the sync one off
    the event loop (an environment may block)."""
    fn = getattr(env, f"{method}_async", None)
    if fn is not None:
        return await fn(*args)
    return await asyncio.to_thread(getattr(env, method), *args)
