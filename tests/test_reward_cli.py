"""Rewards combined per data source (issue #75, rewards/combine.py) through the RewardManager on a DataProto, as the
trainer's reward step runs it: the logged terms, weighted, sum to the trained score. Their bad inputs and
reward.code's as one ConfigError line; `megappo reward` (rows scored with a config's reward, no training) and its
bad rows; `megappo data` reading a code set's rows (a question and its tests)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from cli_helpers import run_cli
from megappo.config import ConfigError, load_config
from megappo.rewards.code import parse_tests
from megappo.rewards.manager import RewardManager
from megappo.rewards.rules import load_rewards
from test_reward_rules import BASE, batch

SHORT = ("def score(response, ground_truth, extra_info):\n"
         "    return {'score': float(len(response) < 60), 'chars': len(response)}\n")
ADD = {"inputs": ["1 2\n", "3 4\n", "10 -5\n"], "outputs": ["3\n", "7\n", "5\n"]}
RIGHT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"  # 57 characters: short
PARTLY = "Mine:\n```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
MIX = "{mix: [{term: code, weight: 0.75}, {term: 'rule:short', weight: 0.25}%s]}"
CODE = ["reward.code.timeout_s=1", "reward.code.wall_s=120"]  # a bound on the sandbox's start no busy machine reaches


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])


@pytest.fixture
def short_rule(tmp_path) -> str:
    (tmp_path / "short.py").write_text(SHORT)
    return f"reward.rules={{short: {tmp_path / 'short.py'}:score}}"


def test_the_logged_terms_weighted_sum_to_the_trained_score(tokenizer, tiny_assets, short_rule):
    rm = ["reward.model.enable=true", f"reward.model.path={tiny_assets['tiny-llama']}", "reward.model.parallel.dp=2"]
    combine = f"reward.combine={{{MIX[1:-1] % ', {term: rm, weight: 0.5}'}, alone: [{{term: code, weight: 2}}]}}"
    cfg = load_config(BASE, [short_rule, combine, *rm, *CODE])
    manager = RewardManager(tokenizer, 0, non_stop_penalty=False, scorers=load_rewards(cfg.reward))
    texts = [RIGHT, PARTLY, "no idea", PARTLY, "#### 7"]
    sources = ["mix", "mix", "mix", "alone", "arithmetic"]
    rm_scores = [0.5, -1.0, 2.0, 3.0, 0.25]
    scores, metrics = manager(batch(tokenizer, texts, sources, [ADD] * 4 + ["7"], resp_len=96, rm_scores=rm_scores))
    trained = scores.sum(-1).tolist()
    code, short = [1.0, 2 / 3, 0.0, 2 / 3], [float(len(t) < 60) for t in texts]
    for i in range(3):  # a combination with an rm term: the reward model counts with its weight
        assert trained[i] == pytest.approx(0.75 * code[i] + 0.25 * short[i] + 0.5 * rm_scores[i]), i
    assert trained[3] == pytest.approx(2 * code[3])  # one without: the reward model is not part of its score
    assert trained[4] == pytest.approx(1.0 + rm_scores[4])  # a source without reward.combine: its rule + the RM
    terms = {"code": 0.75, "rule:short": 0.25, "rm": 0.5}
    logged = sum(w * metrics[f"reward/mix/term/{t}"] for t, w in terms.items())
    assert logged == pytest.approx(metrics["reward/mix/score"]) == pytest.approx(sum(trained[:3]) / 3)
    assert metrics["reward/alone/score"] == pytest.approx(2 * metrics["reward/alone/term/code"]) and \
        "reward/alone/term/rm" not in metrics
    # each term's own metrics, per source: the code reward's outcomes, the rule's extras
    assert metrics["reward/mix/code/passed"] == pytest.approx(1 / 3) and metrics["reward/mix/code/no_code"] == \
        pytest.approx(1 / 3) and metrics["reward/mix/rule:short/chars"] == pytest.approx(sum(map(len, texts[:3])) / 3)


@pytest.mark.parametrize("overrides, expected", [
    (["reward.combine={a: [{term: magic, weight: 1}]}"],
     "reward.combine.a[0].term='magic' names nothing; a term is code, rm, judge or rule:<name>"),
    (["reward.combine={a: [{term: 'rule:nope', weight: 1}]}"], "reward.combine.a[0].term='rule:nope': no rule 'nope' "
                                                               "(rules: arithmetic, code, gsm8k"),
    (["reward.combine={a: [{term: judge, weight: 1}]}"], "reward.combine.a[0].term=judge needs the judge's server: "
                                                         "set reward.judge.endpoint"),
    (["reward.combine={a: [{term: rm, weight: 1}]}"], "term=rm is the reward model's score, but "
                                                      "reward.model.enable=false"),
    (["reward.combine={a: [{term: code, weight: lots}]}"], "reward.combine.a[0].weight='lots' must be a finite number"),
    (["reward.combine={a: code}"], "reward.combine.a must be a list of {term, weight}, e.g. [{term: code"),
    (["reward.combine={a: [{term: code}]}"], "reward.combine.a[0] is ['term'], not {term: ..., weight: ...}"),
    (["reward.combine={a: [{term: code, weight: 1}, {term: code, weight: 2}]}"], "the term 'code' is listed twice"),
    (["reward.code.score=best"], "reward.code.score='best' must be one of fraction, all"),
    (["reward.code.concurrency=0"], "reward.code.concurrency=0 must be a whole number >= 1"),
])
def test_bad_combine_and_code_settings_are_one_config_error_line(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(BASE, overrides)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- megappo reward ----------------------------------------------------------------------------------------

def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_megappo_reward_scores_rows_with_the_configs_reward(tmp_path, short_rule):
    rows = [{"data_source": "code", "prompt": "add two numbers", "response": RIGHT, "ground_truth": ADD},
            {"data_source": "code", "prompt": "add", "response": PARTLY, "ground_truth": json.dumps(ADD)},
            {"data_source": "mix", "prompt": "add", "response": PARTLY, "ground_truth": ADD, "extra_info": {"k": 1}},
            {"data_source": "mix", "prompt": "add", "response": "no idea", "ground_truth": ADD},
            {"data_source": "arithmetic", "prompt": "3 + 4?", "response": "#### 7", "ground_truth": "7"}]
    out = tmp_path / "scores" / "scores.jsonl"
    rc, stdout, stderr = run_cli("reward", "--config", BASE, "--input", write_jsonl(tmp_path / "rows.jsonl", rows),
                                 "--out", out, short_rule, f"reward.combine={MIX % ''}", *CODE)
    assert rc == 0, stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["data_source"] for line in lines] == [r["data_source"] for r in rows]  # the input's order
    assert lines[0] == {"data_source": "code", "score": 1.0, "terms": {"rule:code": 1.0},
                        "metrics": {"passed": 1.0, "wrong_answer": 0.0, "timeout": 0.0, "runtime_error": 0.0,
                                    "no_code": 0.0}}
    assert lines[1]["score"] == pytest.approx(2 / 3) and lines[1]["metrics"]["wrong_answer"] == 1.0
    for line, code, short in ((lines[2], 2 / 3, 0.0), (lines[3], 0.0, 1.0)):
        assert line["terms"] == pytest.approx({"code": code, "rule:short": short})
        assert line["score"] == pytest.approx(0.75 * code + 0.25 * short)
    assert lines[3]["metrics"]["code/no_code"] == 1.0 and lines[3]["metrics"]["rule:short/chars"] == len("no idea")
    assert lines[4]["score"] == 1.0 and lines[4]["terms"] == {"rule:arithmetic": 1.0}
    assert f"wrote 5 scores to {out}" in stdout and "mix: mean score 0.375 over 2 rows" in stdout


@pytest.mark.parametrize("row, overrides, expected", [
    ({"data_source": "code", "response": RIGHT, "ground_truth": "3"}, [],
     "rows.jsonl row 2: the code ground truth (int) is not the test JSON; give {\"inputs\": [...], \"outputs\": [...]}"),
    ({"data_source": "mine", "response": "x", "ground_truth": "1"}, [],
     "rows.jsonl row 2: no reward for data_source 'mine' (known: arithmetic, code, gsm8k"),
    ({"data_source": "code", "ground_truth": ADD}, [],
     "rows.jsonl row 2 has no response (its fields: data_source, ground_truth); each row is {data_source, response, "
     "ground_truth, prompt?, extra_info?}"),
    ({"data_source": "code", "response": ["x"], "ground_truth": ADD}, [], "rows.jsonl row 2: response is a list; "
                                                                           "give text"),
    ({"data_source": "r", "response": "x", "ground_truth": ADD}, ["reward.combine={r: [{term: rm, weight: 1}]}",
                                                                  "reward.model.enable=true", "reward.model.path=m",
                                                                  "reward.model.parallel.dp=2"],
     "rows.jsonl row 2: reward.combine.r has an rm term, and megappo reward does not run the reward model"),
    ({"data_source": "code", "response": RIGHT, "ground_truth": ADD}, ["reward.combine={a: [{term: judge, weight: 1}]}"],
     "--config: reward.combine.a[0].term=judge needs the judge's server: set reward.judge.endpoint"),
])
def test_megappo_reward_bad_rows_are_one_line(tmp_path, row, overrides, expected):
    good = {"data_source": "arithmetic", "response": "#### 7", "ground_truth": "7"}
    rows = write_jsonl(tmp_path / "rows.jsonl", [good, row])
    rc, _, stderr = run_cli("reward", "--config", BASE, "--input", rows, "--out", tmp_path / "s.jsonl", *overrides)
    assert rc == 1 and len(stderr.strip().splitlines()) == 1 and expected in stderr, stderr
    assert not (tmp_path / "s.jsonl").exists()


# ---- megappo data: a code set ------------------------------------------------------------------------------

def test_megappo_data_reads_a_code_set_of_questions_and_tests(tmp_path):
    call = {"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"}
    records = [{"question": "Add the two numbers on the line.", "tests": ADD},
               {"question": "Write add(a, b).", "tests": json.dumps(call)},
               {"question": "Echo.", "tests": [{"input": "x\n", "output": "x\n"}, {"input": "y\n", "output": "y\n"}]}]
    src = write_jsonl(tmp_path / "set.jsonl", records)
    rc, stdout, stderr = run_cli("data", "--input", src, "--prompt-key", "question", "--answer-key", "tests",
                                 "--data-source", "code", "--out", tmp_path / "data", "--test-fraction", "0")
    assert rc == 0 and "reward.rules" not in stdout, stderr  # a built-in source: no rule to name
    rows = pq.read_table(tmp_path / "data" / "train.parquet").to_pylist()
    rows.sort(key=lambda r: r["extra_info"]["index"])
    truths = [json.loads(r["reward_model"]["ground_truth"]) for r in rows]
    assert truths == [ADD, call, {"inputs": ["x\n", "y\n"], "outputs": ["x\n", "y\n"]}]
    assert all(parse_tests(t) for t in truths) and rows[0]["data_source"] == "code"
    write_jsonl(src, records + [{"question": "?", "tests": {"inputs": ["1"], "output": ["1"]}}])
    rc, _, stderr = run_cli("data", "--input", src, "--prompt-key", "question", "--answer-key", "tests",
                            "--data-source", "code", "--out", tmp_path / "bad")
    assert rc == 1 and stderr.strip() == (
        f"megappo data: {src} row 4: the code ground truth (['inputs', 'output']) is not the test JSON; give "
        '{"inputs": [...], "outputs": [...]} (+ "fn_name" for call-based tests) (in --answer-key\'s field)')
    assert not (tmp_path / "bad").exists()


def test_the_trainer_scores_with_the_configs_rewards(tiny_assets, data_dir, tmp_path):
    """The trainer's reward functions are built from the whole reward section (megappo eval calls the same
    load_rewards): reward.code's settings reach the code source and reward.combine replaces its source's rule (both
    called load_rules(reward.rules) alone: the code source kept its defaults, a combination was silently not trained)."""
    from megappo.ppo.ray_trainer import RayPPOTrainer
    from megappo.rewards.combine import Combined
    from trainer_utils import config

    cfg = config(tiny_assets, data_dir, tmp_path / "run", "reward.code.timeout_s=2", "reward.code.concurrency=3",
                 "reward.combine.arithmetic=[{term: 'rule:arithmetic', weight: 0.5}, {term: code, weight: 0.5}]")
    trainer = RayPPOTrainer(cfg, show_progress=False)
    try:
        for fn in (trainer.reward_fn, trainer.val_reward_fn):
            code = fn.scorers["code"].fn
            assert (code.timeout_s, code.concurrency) == (2, 3)
            assert isinstance(fn.scorers["arithmetic"].fn, Combined)
    finally:
        trainer.preemption.uninstall()
