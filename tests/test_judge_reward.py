"""The generative judge (issue #75, rewards/judge.py, reward.judge): P(positive) from a real `megappo serve` of the
tiny llama equals the probability transformers computes on the same weights (fp32), for chat: false and
chat: true, through the RewardManager as the trainer's reward step runs it (a judge source and a combine term);
a stand-in server (tests/distill_helpers.FakeTeacher) for the concurrency cap, a judge dropping connections
mid-run (retried, counted) and one that fails every try (the fallback, reward/judge_errors); reward.judge.model
through `megappo reward`: the judge on its own engine (a Ray actor) gives the same probability, and is stopped;
bad input in one line each."""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest
import torch

from distill_helpers import FakeTeacher, fake_log_prob
from megappo.config import ConfigError, load_config
from megappo.rewards.manager import RewardManager
from megappo.rewards.rules import PROMPT, load_rewards
from test_reward_rules import BASE, batch

TEMPLATE = "Question: {prompt} Answer: {response} Reference: {ground_truth} Is the answer right?"
PROMPTS = ["What is 2+3?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]]
RESPONSES, TRUTHS = ["5", "blue"], ["5", "red"]
QUESTIONS = ["What is 2+3?", "Name a color."]  # what the judge reads of PROMPTS (a chat prompt: its last user turn)


def judge_config(tiny_assets, url: str, *overrides: str):
    return load_config(BASE, [f"reward.judge.endpoint={url}", f"reward.judge.tokenizer={tiny_assets['tiny-llama']}",
                              f"reward.judge.prompt='{TEMPLATE}'", "reward.judge.fallback=0.5",
                              "reward.judge.backoff_s=0.01", *overrides])


def judge_batch(tokenizer, sources, prompts, responses, truths):
    data = batch(tokenizer, responses, sources, truths)
    raw = np.empty(len(prompts), dtype=object)
    raw[:] = prompts
    data.non_tensor_batch["raw_prompt"] = raw
    return data


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets["tiny-llama"])


@pytest.fixture(scope="module")
def judge_server(served_tiny_llama):
    """The session's `megappo serve` of the tiny llama (conftest `served_tiny_llama`, test_distillation's teacher
    too), its key in $MEGAPPO_JUDGE_API_KEY as reward.judge reads it."""
    url, key = served_tiny_llama
    mp = pytest.MonkeyPatch()
    mp.setenv("MEGAPPO_JUDGE_API_KEY", key)
    yield f"{url}/v1"
    mp.undo()


@pytest.fixture
def fake():
    servers = []

    def start(*faults):
        servers.append(FakeTeacher(faults))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def transformers_p(model, tokenizer, prompt, response, truth, chat: bool) -> float:
    """P(" Yes") / (P(" Yes") + P(" No")) as transformers computes it on the judge model (fp32, summed in fp64)."""
    text = TEMPLATE.format(prompt=prompt, response=response, ground_truth=truth)
    if chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]

    def log_p(verdict):
        with torch.no_grad():
            logits = model(torch.tensor([ids + verdict])).logits[0].double().log_softmax(-1)
        return sum(float(logits[len(ids) + j - 1, t]) for j, t in enumerate(verdict))

    yes, no = (log_p(tokenizer(v, add_special_tokens=False)["input_ids"]) for v in (" Yes", " No"))
    return float(np.exp(yes) / (np.exp(yes) + np.exp(no)))


@pytest.fixture(scope="module")
def judge_model(tiny_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_assets["tiny-llama"], dtype=torch.float32).eval()


@pytest.mark.parametrize("chat", [False, True])
def test_p_positive_is_the_judge_models_own(tiny_assets, tokenizer, judge_model, judge_server, chat):
    cfg = judge_config(tiny_assets, judge_server, f"reward.judge.chat={str(chat).lower()}",
                       "reward.judge.sources=[judged]",
                       "reward.combine={mix: [{term: judge, weight: 0.75}, {term: 'rule:arithmetic', weight: 0.25}]}")
    manager = RewardManager(tokenizer, 0, non_stop_penalty=False, scorers=load_rewards(cfg.reward))
    rows = manager.score_rows(judge_batch(tokenizer, ["judged", "mix"], PROMPTS, RESPONSES, TRUTHS))
    for i, row in enumerate(rows):
        want = transformers_p(judge_model, tokenizer, QUESTIONS[i], RESPONSES[i], TRUTHS[i], chat)
        got = row.extras["term/judge"] if row.source == "mix" else row.rule_score
        assert not row.scorer_error and got == pytest.approx(want, abs=1e-4), (i, got, want)
        assert 0.0 < got < 1.0
    assert rows[1].rule_score == pytest.approx(0.75 * rows[1].extras["term/judge"])  # arithmetic: "blue" is 0


def expected(judge, prompt, response, truth):
    """What the stand-in server's log-probs (fake_log_prob) make of a row."""
    ids = judge.prompt_ids(prompt, response, truth)
    lp = [sum(fake_log_prob(len(ids) + j, t) for j, t in enumerate(judge.verdict_ids(v))) for v in (" Yes", " No")]
    return judge.probability(*lp)


def test_64_judgments_keep_to_the_cap(tiny_assets, tokenizer, fake):
    server = fake()
    cfg = judge_config(tiny_assets, server.url, "reward.judge.concurrency=4", "reward.judge.sources=[judged]")
    rule = load_rewards(cfg.reward)["judged"]
    responses = [f"answer {i}" for i in range(64)]
    scored = rule.fn(responses, ["42"] * 64, [{PROMPT: f"question {i}"} for i in range(64)])
    assert [s.score for s in scored] == pytest.approx([expected(rule.fn, f"question {i}", r, "42")
                                                       for i, r in enumerate(responses)], abs=1e-12)
    assert server.requests == 128 and 2 <= server.most_in_flight <= 4 and rule.fn.max_in_flight <= 4
    assert all(s.extras == {"judge_errors": 0.0} and not s.failure for s in scored)
    # parse: a grade read from the judge's text (the stand-in says nothing: no grade, the fallback, counted)
    cfg = judge_config(tiny_assets, server.url, "reward.judge.parse='Grade: (\\d+)'", "reward.judge.sources=[judged]")
    scored = load_rewards(cfg.reward)["judged"].fn(["x"], ["42"], [{PROMPT: "q"}])
    assert [(s.score, s.failure) for s in scored] == [(0.5, "error")] and server.bodies[-1]["temperature"] == 0.0


def test_a_failing_judge_is_retried_counted_and_the_row_gets_the_fallback(tiny_assets, tokenizer, fake):
    # a judge dropping a connection and answering 503 mid-run: retried, the rows scored as a healthy one scores them
    server = fake("drop", "503")
    cfg = judge_config(tiny_assets, server.url, "reward.judge.retries=3", "reward.judge.sources=[judged]")
    manager = RewardManager(tokenizer, 0, non_stop_penalty=False, scorers=load_rewards(cfg.reward))
    judge = manager.scorers["judged"].fn
    _, metrics = manager(judge_batch(tokenizer, ["judged"] * 2, PROMPTS, RESPONSES, TRUTHS))
    want = [expected(judge, q, r, t) for q, r, t in zip(["What is 2+3?", "Name a color."], RESPONSES, TRUTHS)]
    assert server.requests == 4 + 2 and judge.retries == 2
    assert metrics["reward/judge_errors"] == 0 and metrics["reward/judged/score"] == pytest.approx(sum(want) / 2)
    # one that fails every try: each row gets the fallback, counted, not a silent 0
    server = fake(*["503"] * 8)
    cfg = judge_config(tiny_assets, server.url, "reward.judge.retries=1", "reward.judge.fallback=0.25",
                       "reward.judge.sources=[judged]")
    manager = RewardManager(tokenizer, 0, non_stop_penalty=False, scorers=load_rewards(cfg.reward))
    scores, metrics = manager(judge_batch(tokenizer, ["judged"] * 2, PROMPTS, RESPONSES, TRUTHS))
    assert server.requests == 8 and scores.sum(-1).tolist() == [0.25, 0.25]
    assert metrics["reward/judge_errors"] == 2 and metrics["reward/num_scorer_errors"] == 2


def test_an_endpoint_that_never_answers_is_one_line_and_the_fallback(tiny_assets, tokenizer, caplog):
    with socket.socket() as silent:  # accepts connections (the backlog), never reads or answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        cfg = judge_config(tiny_assets, url, "reward.judge.timeout_s=0.2", "reward.judge.retries=1",
                           "reward.judge.sources=[judged]")
        with caplog.at_level(logging.WARNING, logger="megappo.rewards.judge"):
            scored = load_rewards(cfg.reward)["judged"].fn(["5"], ["5"], [{PROMPT: "What is 2+3?"}])
    assert [(s.score, s.failure, s.extras) for s in scored] == [(0.5, "error", {"judge_errors": 1.0})]
    [line] = [r.getMessage() for r in caplog.records]
    assert f"reward.judge.endpoint {url} failed the model list 2 times (last: ReadTimeout" in line
    assert "\n" not in line and "raise reward.judge.retries / timeout_s" in line


@pytest.mark.parametrize("override, message", [
    ("reward.judge.prompt='Is it right? {prompt}'", "reward.judge.prompt has no {response}: the judge would never see "
                                                     "the answer; add {response}"),
    ("reward.judge.prompt='{answer} right?'", "reward.judge.prompt names ['answer']; its fields are {prompt}, "
                                              "{response}, {ground_truth}"),
    ("reward.judge.positive=''", "reward.judge.positive is empty; give the verdict text the judge answers, "
                                 "e.g. ' Yes'"),
    ("reward.judge.negative=''", "reward.judge.negative is empty; give the verdict text the judge answers, e.g. ' No'"),
    ("reward.judge.fallback=null", "reward.judge.fallback=None must be a finite number: the score a row gets"),
    ("reward.judge.tokenizer=/nonexistent", "reward.judge.tokenizer=/nonexistent is not a directory"),
    # where the judge runs: a server or a model megappo serves (one of them); the model a HF dir, on 0 or 1 GPUs
    ("reward.judge.model=TINY", "reward.judge sets both endpoint (a server) and model (a judge megappo serves); "
                                "set one"),
    ("reward.judge.endpoint=null", "reward.judge needs reward.judge.endpoint, an OpenAI-compatible server, e.g. "
                                   "http://127.0.0.1:8000/v1 (megappo serve --model DIR, vllm serve), or "
                                   "reward.judge.model, a HF dir"),
    (("reward.judge.endpoint=null", "reward.judge.model=/nonexistent"),
     "reward.judge.model=/nonexistent is not a HF model dir (config.json + *.safetensors)"),
    (("reward.judge.endpoint=null", "reward.judge.model=TINY", "reward.judge.gpus=2"),
     "reward.judge.gpus=2 must be 0 (the CPU) or 1; a judge on more GPUs: serve"),
])
def test_bad_judge_settings_are_one_line(tiny_assets, override, message):
    with pytest.raises(ConfigError) as e:
        judge_config(tiny_assets, "http://127.0.0.1:9/v1", "reward.judge.sources=[judged]",
                     *(o.replace("TINY", str(tiny_assets["tiny-llama"])) for o in
                       ((override,) if isinstance(override, str) else override)))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_judge_term_without_the_judge_and_a_source_claimed_twice_are_one_line(tiny_assets):
    with pytest.raises(ConfigError, match=r"reward.combine.a\[0\].term=judge needs the judge's server: set "
                                          "reward.judge.endpoint"):
        load_config(BASE, ["reward.combine={a: [{term: judge, weight: 1}]}"])
    with pytest.raises(ConfigError, match="reward.judge.sources names 'a', which reward.combine.a also scores"):
        judge_config(tiny_assets, "http://127.0.0.1:9/v1", "reward.judge.sources=[a]",
                     "reward.combine={a: [{term: judge, weight: 1}]}")


def test_megappo_reward_passes_the_rows_prompt_to_the_judge(tiny_assets, judge_server, tmp_path):
    import json

    from cli_helpers import run_cli

    args = [f"reward.judge.endpoint={judge_server}", f"reward.judge.tokenizer={tiny_assets['tiny-llama']}",
            f"reward.judge.prompt='{TEMPLATE}'", "reward.judge.fallback=0.5", "reward.judge.sources=[judged]"]
    rows = [{"data_source": "judged", "prompt": p, "response": r, "ground_truth": t}
            for p, r, t in zip(PROMPTS, RESPONSES, TRUTHS)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, _, stderr = run_cli("reward", "--config", BASE, "--input", tmp_path / "rows.jsonl", "--out",
                            tmp_path / "s.jsonl", *args)
    assert rc == 0, stderr
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    judge = load_rewards(judge_config(tiny_assets, judge_server, "reward.judge.sources=[judged]").reward)["judged"].fn
    want = judge(RESPONSES, TRUTHS, [{PROMPT: "What is 2+3?"}, {PROMPT: "Name a color."}])
    assert [x["score"] for x in lines] == pytest.approx([w.score for w in want], abs=1e-6)
    assert [x["metrics"] for x in lines] == [{"judge_errors": 0.0}] * 2
    (tmp_path / "rows.jsonl").write_text(json.dumps({**rows[0], "prompt": None}) + "\n")
    rc, _, stderr = run_cli("reward", "--config", BASE, "--input", tmp_path / "rows.jsonl", "--out",
                            tmp_path / "s.jsonl", *args)
    assert rc == 1 and "row 1 has no prompt, which reward.judge.prompt's {prompt} reads" in stderr.strip()


def test_megappo_reward_serves_reward_judge_model_on_its_own_engine(tiny_assets, tokenizer, judge_model, ray_session,
                                                                    tmp_path):
    """reward.judge.model: `megappo reward` starts the judge on its own vLLM engine (a Ray actor serving it on
    loopback), scores each row through it as through an endpoint (echoed verdict log-probs), and stops it; the
    probability is the judge model's own. An engine that cannot start is one line."""
    import json

    from ray._private.state import actors

    from cli_helpers import run_cli

    args = [f"reward.judge.model={tiny_assets['tiny-llama']}", f"reward.judge.prompt='{TEMPLATE}'",
            "reward.judge.fallback=0.5", "reward.judge.sources=[judged]", "reward.judge.chat=false",
            "reward.judge.max_model_len=256", "reward.judge.max_tokens=8", "reward.judge.kv_cache_memory_mb=32"]
    rows = [{"data_source": "judged", "prompt": p, "response": r, "ground_truth": t}
            for p, r, t in zip(PROMPTS, RESPONSES, TRUTHS)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def judge_actors(state=None):
        return [a for a in actors().values() if a["ActorClassName"].endswith("_JudgeServer")
                and (state is None or a["State"] == state)]

    before = len(judge_actors())
    rc, _, stderr = run_cli("reward", "--config", BASE, "--input", tmp_path / "rows.jsonl", "--out",
                            tmp_path / "s.jsonl", *args)
    assert rc == 0, stderr
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    for i, line in enumerate(lines):
        want = transformers_p(judge_model, tokenizer, QUESTIONS[i], RESPONSES[i], TRUTHS[i], chat=False)
        assert line["metrics"] == {"judge_errors": 0.0} and line["score"] == pytest.approx(want, abs=1e-4), (i, line)
    # one engine started for the run, and stopped with it
    assert len(judge_actors()) == before + 1 and judge_actors("ALIVE") == []
    # an engine that cannot start: one line, before anything is scored
    for override, message in [("reward.judge.gpus=1", "reward.judge.gpus=1 but this node has 0 GPUs in Ray; set "
                                                      "reward.judge.gpus=0 to run the judge on the CPU"),
                              ("reward.judge.max_model_len=4096", "reward.judge.max_model_len=4096 exceeds the "
                                                                  "judge's 512 positions")]:
        rc, _, stderr = run_cli("reward", "--config", BASE, "--input", tmp_path / "rows.jsonl", "--out",
                                tmp_path / "t.jsonl", *args, override)
        assert rc == 1 and stderr.strip().startswith(f"megappo reward: {message}") and "\n" not in stderr.strip()
    assert not (tmp_path / "t.jsonl").exists() and judge_actors("ALIVE") == []
