"""Code megappo's tests did not write, unchanged, trains through `rollout.agent`: an agent of the OpenAI Agents
SDK (on its default Responses API), one of LangGraph over langchain-openai's chat model, a `verifiers`
environment and an OpenEnv environment (through megappo.gateway.adapters), each written as its library's docs
write it (tests/framework_agents.py). lm-evaluation-harness against the gateway: tests/test_openai_compat.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import agents  # noqa: F401 - the OpenAI Agents SDK, pinned in requirements-cpu.txt: missing, collection fails


def session_rows(requests: list[dict]) -> list[tuple]:
    """The rows a session's requests are trained as (ppo/segments.py): a request whose prompt continues the last
    row (its prompt, the ids sampled and those sent between) extends it, the ids between attended, not trained;
    any other starts a row of its own."""
    rows = []
    for r in requests:
        if rows:
            prompt, response, mask = rows[-1]
            sent = prompt + response
            if r["prompt"][:len(sent)] == sent:
                between = r["prompt"][len(sent):]
                rows[-1] = (prompt, response + between + r["sampled"],
                            mask + [0] * len(between) + [1] * len(r["sampled"]))
                continue
        rows.append((r["prompt"], r["sampled"], [1] * len(r["sampled"])))
    return [(tuple(p), tuple(s), tuple(m)) for p, s, m in rows]


def test_each_frameworks_agent_trains_on_exactly_the_sampled_tokens(ray_session, tiny_assets, data_dir, tmp_path):
    """rollout.agent = four libraries' agents in turn (tests/framework_agents.py), trained by sync PPO for 2 steps:
    no agent fails, each library ran its sessions, and every trained row is exactly what a
    session sent and was sampled (prompt ids as rendered for its first request, tools and instructions included;
    the engine's sampled ids trained, the ids sent between two requests attended only)."""
    from test_agent import trained_rows
    from trainer_utils import config, recording_rewarded, run

    log = tmp_path / "sessions.jsonl"
    source = (Path(__file__).parent / "framework_agents.py").read_text()
    (tmp_path / "agents.py").write_text(source.replace('LOG = ""', f"LOG = {str(log)!r}", 1))
    cfg = config(tiny_assets, data_dir, tmp_path / "run", f"rollout.agent={tmp_path / 'agents.py'}:run",
                 "rollout.max_new_tokens=40", "data.max_prompt_length=320",
                 "rollout.multi_turn.tool_prompt='You can use tools: {tools}'", "reward.non_stop_penalty=false",
                 "trainer.total_steps=2", "trainer.save_every=0", "trainer.val_every=0", "trainer.export_hf=false")
    batches = []
    history, _ = run(cfg, setup=recording_rewarded(batches))
    sessions = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(history) == 2 and len(batches) == 2
    for h in history:
        assert h["rollout/agent_errors"] == 0 and h["rollout/agent_timeouts"] == 0, h
        assert h["rollout/agent_sessions"] == 8 and h["rollout/weights_fingerprint_ok"] == 1.0
    ran = Counter(s["framework"] for s in sessions)
    assert set(ran) == {"agents_sdk", "langgraph", "verifiers", "openenv"} and len(sessions) == 16, ran
    assert all(s["requests"] for s in sessions)
    trained = [row for batch in batches for row in trained_rows(batch.batch)]
    expected = [row for s in sessions for row in session_rows(s["requests"])]
    assert sorted(trained) == sorted(expected)
    assert history[0]["rollout/logprob_diff_max"] < 1e-4
