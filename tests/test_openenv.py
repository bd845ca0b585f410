"""OpenEnv through megappo.gateway.adapters.openenv_agent, and the threads synchronous code runs in (a plain-function
agent, an environment's blocking reset / step), against a real vLLM engine (tiny llama, one for the module) behind
the gateway, run by AgentRunner:

- OpenEnv's own client (an `EnvClient` subclass, async, and its `.sync()` wrapper) against a real OpenEnv server
  (openenv.core's create_app under uvicorn on loopback): the episode ends when the server says done, its rewards
  arrive, the model is shown the observation (not the StepResult around it), and every episode's session closes;
- an in-process `Environment` whose (inherited) step_async would run its blocking step on the event loop: two
  episodes' steps run at once;
- more synchronous agents at once than asyncio's default thread pool has threads all run together, none timing
  out; a hung one does not hold up the runner's return.
"""

import os
import threading

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402

from gateway_helpers import MAX_LEN, MAX_TOKENS, served_gateway  # noqa: E402
from waiting import wait_for  # noqa: E402

import openenv  # noqa: E402,F401 (openenv-core is a pinned dependency: its absence is an error, not a skip)


@pytest.fixture(scope="module")
def served(tiny_assets):
    yield from served_gateway(tiny_assets)


def run_agents(served, agent, rows, concurrency, timeout_s=120.0, max_new_tokens=64):
    """AgentRunner on the module's engine: one sample per row, all at once; its trajectories."""
    from megappo.gateway.agents import AgentRunner
    from megappo.workers.rollout.async_engine import AsyncTokenEngine
    from megappo.workers.rollout.sampling import SamplingSpec

    rollout, _, gateway, _ = served
    runner = AgentRunner(AsyncTokenEngine.for_llm(rollout.llm), rollout.tokenizer, agent, max_model_len=MAX_LEN,
                         max_tokens=MAX_TOKENS, concurrency=concurrency, timeout_s=timeout_s)
    prompts = [gateway.renderer.prompt_ids(r["messages"]) for r in rows]
    try:
        return runner.run(prompts, SamplingSpec(n=1, temperature=1.0, max_new_tokens=max_new_tokens, seed=3), 3, rows)
    finally:
        runner.close()


ROWS = [{"messages": [{"role": "user", "content": f"Talk with the environment ({k})."}]} for k in range(2)]


def openenv_types():
    from openenv.core.env_server.types import Action, Observation

    class Say(Action):
        text: str

    class Heard(Observation):
        text: str = ""

    return Say, Heard


def test_openenvs_own_client_against_an_openenv_server(served):
    """make_env returns OpenEnv's client of a real OpenEnv server (async EnvClient, then its .sync() wrapper): each
    episode ends at the server's done (2 steps of max_steps=4), its reward the sum of the steps' (1 + 2), the model
    shown each observation's text; the adapter closes each client (the server closes the episode's environment)."""
    from openenv.core import EnvClient
    from openenv.core.client_types import StepResult
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import State

    from megappo.gateway.adapters import openenv_agent
    from megappo.gateway.serve import GatewayServer

    Say, Heard = openenv_types()
    closed = []

    class Echo(Environment):  # served: each WebSocket session its own instance
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kw):
            self._state = State(episode_id=episode_id, step_count=0)
            return Heard(text="Say something.")

        def step(self, action, timeout_s=None, **kw):
            self._state.step_count += 1
            n = self._state.step_count
            return Heard(text=f"Heard {len(action.text)} characters.", reward=float(n), done=n == 2)

        @property
        def state(self):
            return self._state

        def close(self):
            closed.append(self._state.step_count)

    class EchoClient(EnvClient):  # the client an OpenEnv environment ships
        def _step_payload(self, action):
            return action.model_dump()

        def _parse_result(self, payload):
            return StepResult(observation=Heard(**payload.get("observation", {})), reward=payload.get("reward"),
                              done=payload.get("done", False))

        def _parse_state(self, payload):
            return State(**payload)

    server = GatewayServer(create_app(Echo, Say, Heard, max_concurrent_envs=4))
    url = server.start()
    tokenizer = served[0].tokenizer
    try:
        for wrap in (lambda c: c, lambda c: c.sync()):
            agent = openenv_agent(lambda row: wrap(EchoClient(base_url=url)), action_of=lambda text: Say(text=text),
                                  max_steps=4, max_tokens=4)
            for t in run_agents(served, agent, ROWS, concurrency=2):
                assert t.stats["agent_errors"] == 0 and t.stats["agent_timeouts"] == 0, t.turns
                assert t.turns[-1] == {"role": "reward", "value": 3.0} and t.stats["agent_requests"] == 2
                seen = tokenizer.decode(t.prompt + t.tokens)
                assert "Say something." in seen and "Heard" in seen and "StepResult" not in seen, seen
        wait_for(lambda: closed == [2] * 4, "every episode's environment closed on the server")
    finally:
        server.stop()


def test_an_in_process_environments_blocking_step_runs_off_the_event_loop(served):
    """An Environment that implements step alone (its step_async, inherited, calls step): two episodes' steps block
    until both have begun, which they can only if neither runs on the agents' event loop."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import State

    from megappo.gateway.adapters import openenv_agent

    Say, Heard = openenv_types()
    both = threading.Barrier(2)

    class Blocking(Environment):
        def reset(self, seed=None, episode_id=None, **kw):
            return Heard(text="Say something.")

        def step(self, action, timeout_s=None, **kw):
            both.wait(timeout=30)  # the other episode's step must begin meanwhile
            return Heard(text="Done.", reward=1.0, done=True)

        @property
        def state(self):
            return State()

    agent = openenv_agent(lambda row: Blocking(), action_of=lambda text: Say(text=text), max_tokens=4)
    for t in run_agents(served, agent, ROWS, concurrency=2):
        assert t.stats["agent_errors"] == 0 and t.turns[-1] == {"role": "reward", "value": 1.0}, t.turns


def test_more_synchronous_agents_than_the_default_thread_pool_run_at_once(served):
    """33 plain-function agents (asyncio's default pool has min(32, cpus + 4) threads) all wait for each other
    before their request: each runs in a thread of its own from the start, none queued, none timed out."""
    n = 33
    everyone = threading.Barrier(n)

    def agent(client, row):
        everyone.wait(timeout=30)
        r = client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)
        return float(len(r.choices) == 1)

    rows = [{"messages": [{"role": "user", "content": f"Count to {k}."}]} for k in range(n)]
    trajs = run_agents(served, agent, rows, concurrency=n, max_new_tokens=2)
    for t in trajs:
        assert t.stats["agent_errors"] == 0 and t.stats["agent_timeouts"] == 0, t.turns
        assert t.stats["agent_requests"] == 1 and t.turns[-1] == {"role": "reward", "value": 1.0}


def test_a_hung_synchronous_agent_does_not_hold_up_the_runner(served):
    """A plain-function agent that never returns by itself: its sample times out, and the runner's run and close
    return while it still hangs (a thread cannot be killed; nothing waits for it). Released only after (or, should
    the runner wait for it, by a watchdog long after its timeout)."""
    events, release = [], threading.Event()

    def hangs(client, row):
        release.wait()
        events.append("agent released")
        return 1.0

    watchdog = threading.Timer(60, release.set)
    watchdog.start()
    try:
        trajs = run_agents(served, hangs, ROWS[:1], concurrency=1, timeout_s=0.5)
        events.append("runner returned")
    finally:
        release.set()
        watchdog.cancel()
    wait_for(lambda: len(events) == 2, "the hung agent's thread to end")
    assert events == ["runner returned", "agent released"]
    assert trajs[0].stats["agent_timeouts"] == 1 and trajs[0].tokens == []
