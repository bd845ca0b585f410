"""Environments the tests register by name (rollout.multi_turn.environments.SOURCE=agent_envs:NAME): the
form a user's own module takes. Importable because tests/ is on sys.path under pytest (a `megappo eval`
subprocess gets it through PYTHONPATH)."""

from megappo.agent.environment import Environment


class CountToolCalls(Environment):
    """The reward of a trajectory is its number of tool calls: nothing a rule on the response text sees."""

    tools = ("calculator",)

    def score(self, episode) -> float:
        return float(len(episode.tool_calls))


class PythonOnly(Environment):
    tools = ("python",)

    def score(self, episode) -> float:
        return float(episode.answer.strip() == str(episode.ground_truth))


NOT_AN_ENVIRONMENT = 42
