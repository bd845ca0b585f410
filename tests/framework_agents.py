"""rollout.agent for tests/test_clients.py: one agent per library, each written as that library's docs write it
(the OpenAI Agents SDK on its default Responses API, LangGraph's ReAct agent over langchain-openai, a `verifiers`
environment and an OpenEnv environment through megappo's adapters), taken in turn (a counter per rollout worker).
Each request's prompt and sampled ids are logged from the HTTP answers (an httpx event hook, the libraries
unchanged) to LOG, one line per session, so the test can check the trained tokens against them."""
import itertools
import json

import httpx
import openai

LOG = ""  # the test writes a copy of this file with its log's path here
TURN = itertools.count()


def logged_http(log: list) -> httpx.AsyncClient:
    """An HTTP client that appends each answer's prompt and sampled ids to `log` as it arrives."""
    async def keep(response):
        await response.aread()
        if response.status_code == 200 and response.request.url.path.endswith(("/completions", "/responses")):
            body = response.json()
            sampled = body["choices"][0]["token_ids"] if "choices" in body else body["token_ids"]
            log.append({"prompt": body["prompt_token_ids"], "sampled": sampled})
    return httpx.AsyncClient(event_hooks={"response": [keep]}, timeout=120)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def agents_sdk(client, http, row):  # the OpenAI Agents SDK, its default Responses model
    from agents import Agent, ModelBehaviorError, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool

    agent = Agent(name="solver", instructions="Answer with a number.", tools=[function_tool(add)],
                  model=OpenAIResponsesModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=12))
    try:
        result = await Runner.run(agent, row["messages"][-1]["content"], max_turns=3,
                                  run_config=RunConfig(tracing_disabled=True))
    except ModelBehaviorError:  # the SDK raises on a reply cut at max_tokens (status "incomplete"): it scores 0
        return 0.0
    return float(str(row["ground_truth"]) in str(result.final_output))


async def langgraph(client, http, row):  # LangGraph's prebuilt ReAct agent over langchain-openai's chat model
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    model = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_tokens=12,
                       max_retries=0, http_async_client=http)
    graph = create_react_agent(model, tools=[add])
    state = await graph.ainvoke({"messages": row["messages"]})
    return float(str(row["ground_truth"]) in str(state["messages"][-1].content))


def _verifiers_env():
    import verifiers as vf
    from datasets import Dataset

    def correct(completion, answer) -> float:
        return float(answer in str(completion[-1]["content"]))

    examples = Dataset.from_list([{"question": "What is 2 + 3?", "answer": "5"}])  # the rows come from megappo's data
    return vf.SingleTurnEnv(eval_dataset=examples, rubric=vf.Rubric(funcs=[correct]))


def _openenv():
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class Guess(Action):
        n: int

    class Hint(Observation):
        text: str = ""

    class GuessEnv(Environment):
        def __init__(self):
            super().__init__()
            self._state, self.secret = State(step_count=0), 7

        def reset(self, seed=None, episode_id=None, **kw):
            self._state = State(episode_id=episode_id, step_count=0)
            return Hint(text="Guess a number from 0 to 9.")

        def step(self, action, timeout_s=None, **kw):
            self._state.step_count += 1
            hit = action.n == self.secret
            return Hint(text="yes" if hit else ("higher" if action.n < self.secret else "lower"), done=hit,
                        reward=float(hit))

        @property
        def state(self):
            return self._state

    return GuessEnv, Guess


async def verifiers(client, http, row):  # a verifiers environment through megappo's adapter
    from megappo.gateway.adapters import verifiers_agent

    return await verifiers_agent(_verifiers_env(), {"max_tokens": 12})(client, row)


async def openenv(client, http, row):  # an OpenEnv environment through megappo's adapter, the model its policy
    from megappo.gateway.adapters import openenv_agent

    env, guess = _openenv()
    return await openenv_agent(lambda row: env(), action_of=lambda text: guess(n=len(text) % 10), max_steps=2,
                               max_tokens=12)(client, row)


FRAMEWORKS = [agents_sdk, langgraph, verifiers, openenv]


async def run(client, row):
    framework = FRAMEWORKS[next(TURN) % len(FRAMEWORKS)]
    log = []
    http = logged_http(log)
    logged = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0, http_client=http)
    reward = await framework(logged, http, row)
    with open(LOG, "a") as f:
        f.write(json.dumps({"framework": framework.__name__, "requests": log}) + "\n")
    return reward
