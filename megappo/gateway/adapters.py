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
    solve = openenv_agent(lambda row: GuessClient(base_url="http://127.0.0.1:8000"), action_of=...)  # a served one

The libraries are imported by the code that builds the environment, never here.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

from megappo.gateway.agents import in_thread

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
    """An OpenEnv environment as rollout.agent, the session's model its policy: `make_env(row)` returns, per
    sample, an in-process environment (openenv.core's Environment) or OpenEnv's client of a served one (an
    EnvClient subclass, or its `.sync()` wrapper), reset; the row's messages and each observation as a user message
    (`prompt_of(observation)`, default its `text` field or its repr); the model's reply becomes an action
    (`action_of(text)`) for `step`, until the episode is done or `max_steps`; the reward is the sum of the steps'
    rewards; the environment is closed. A client's StepResult is read as the observation it carries, with its
    reward and done. A reply `action_of` cannot read ends the episode with what it has."""
    show = prompt_of or _text

    async def run(client, row: dict) -> float:
        env = make_env(row)
        try:
            obs, total, done = _outcome(await _call(env, "reset"))
            messages = list(row["messages"])
            for _ in range(max_steps):
                if done:
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
                obs, reward, done = _outcome(await _call(env, "step", action))
                total += reward
            return total
        finally:
            if hasattr(env, "close"):  # a client's WebSocket session (a slot of the server's max_concurrent_envs)
                await _call(env, "close")

    return run


def _text(obs) -> str:
    text = obs.get("text") if isinstance(obs, dict) else getattr(obs, "text", None)  # GenericEnvClient's: a dict
    return str(text or obs)


def _outcome(result) -> tuple:
    """(observation, reward, done) of what reset / step returned: an Observation, or a client's StepResult, which
    carries the observation (its own reward and done unset) with the step's reward and done."""
    return (getattr(result, "observation", result), float(getattr(result, "reward", None) or 0.0),
            bool(getattr(result, "done", False)))


async def _call(env, method: str, *args):
    """The environment's `method`: its own `{method}_async` (OpenEnv's Environment: one it overrides) or an
    `async def method` (OpenEnv's EnvClient) on the event loop; else the synchronous one in a thread (an
    Environment's inherited step_async only calls its step, on the loop, blocking every other sample; a
    SyncEnvClient blocks until its own loop answers)."""
    fn = getattr(env, f"{method}_async", None)
    if fn is None or _default_async(type(env), method):
        fn = getattr(env, method)
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await in_thread(fn, *args)
    return await result if inspect.isawaitable(result) else result


def _default_async(cls, method: str) -> bool:
    """Whether `cls`'s `{method}_async` is a base class's default: `method` is defined below the class that defines
    it (OpenEnv's own server asks the same: `step_async is not Environment.step_async`)."""
    owner = {name: next((c for c in cls.__mro__ if name in vars(c)), None) for name in (method, f"{method}_async")}
    sync, default = owner[method], owner[f"{method}_async"]
    return sync is not None and default is not None and sync is not default and issubclass(sync, default)
