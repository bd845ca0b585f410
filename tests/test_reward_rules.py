"""Your own task from the config (issue #42): reward.rules (a module, a file path, a batched rule with a
timeout), their bad inputs as one ConfigError line before any worker starts, `megappo data` (a .jsonl /
.json / .parquet of your rows -> megappo's train/test parquet) and its bad inputs, and the trainer's and
`megappo eval`'s reward paths using a rule the config declares."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megappo.config import ConfigError, load_config
from megappo.protocol import DataProto
from megappo.rewards.manager import RewardManager
from megappo.rewards.rules import load_rules

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "configs" / "ppo_tiny.yaml"
RULES = '''
import time


def score(response, ground_truth, extra_info):
    return {"score": float(ground_truth in response), "chars": len(response), "level": extra_info.get("level", -1)}


def score_batch(responses, ground_truths, extra_infos):
    return [float(g in r) for r, g in zip(responses, ground_truths)]


def slow_batch(responses, ground_truths, extra_infos):
    time.sleep(3)
    return [1.0] * len(responses)


def broken(response, ground_truth, extra_info):
    raise RuntimeError("judge unreachable")


def two_args(response, ground_truth):
    return 1.0


def nan_or_inf(response, ground_truth, extra_info):  # a judge's failure that comes back as a number
    return {"score": float("nan")} if ground_truth == "x" else float("inf")


NOT_A_FUNCTION = 3
'''


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])


@pytest.fixture
def rules_pkg(tmp_path, monkeypatch):
    """my_rules.rewards (RULES) importable as a package; tmp_path/judge.py the same code as a plain file."""
    (tmp_path / "my_rules").mkdir()
    (tmp_path / "my_rules" / "__init__.py").write_text("")
    (tmp_path / "my_rules" / "rewards.py").write_text(RULES)
    (tmp_path / "judge.py").write_text(RULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("my_rules", "my_rules.rewards"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def batch(tokenizer, texts, sources, truths, extra_infos=None, resp_len=24, rm_scores=None) -> DataProto:
    """Right-padded responses, each ended by eos (stopped); `rm_scores`: a reward model's score per row."""
    rows, masks = [], []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(ids + [tokenizer.pad_token_id] * (resp_len - len(ids)))
        masks.append([1] * len(ids) + [0] * (resp_len - len(ids)))
    rm = {} if rm_scores is None else {"rm_scores": torch.tensor(rm_scores)}
    return DataProto.from_dict(
        {"responses": torch.tensor(rows), "response_mask": torch.tensor(masks), **rm},
        {"data_source": np.array(sources, dtype=object), "reward_model": [{"ground_truth": t} for t in truths],
         "extra_info": extra_infos or [{} for _ in texts]})


def manager(tokenizer, *overrides) -> RewardManager:
    """The trainer's construction: the config's reward.rules loaded once, given to the RewardManager."""
    cfg = load_config(BASE, list(overrides))
    return RewardManager(tokenizer, 0, scorers=load_rules(cfg.reward.rules))


# ---- reward.rules ------------------------------------------------------------------------------------

def test_module_rule_scores_with_extra_info_and_logs_its_extras_per_source(tokenizer, rules_pkg):
    mgr = manager(tokenizer, "reward.rules.my_task=my_rules.rewards:score")
    data = batch(tokenizer, ["it is 7", "no idea", "#### 3"], ["my_task", "my_task", "arithmetic"], ["7", "7", "3"],
                 [{"level": 2}, {"level": 4}, {"split": "test"}])
    scores, metrics = mgr(data)
    assert scores.sum(-1).tolist() == [1.0, 0.0, 1.0]  # the built-in arithmetic rule still scores its row
    assert metrics["reward/my_task/correct_rate"] == 0.5 and metrics["reward/arithmetic/correct_rate"] == 1.0
    assert metrics["reward/my_task/level"] == 3.0  # extra_info reached the rule
    assert metrics["reward/my_task/chars"] == (len("it is 7") + len("no idea")) / 2
    assert "reward/arithmetic/chars" not in metrics and metrics["reward/num_scorer_errors"] == 0.0


def test_file_rule_is_made_absolute_at_load_and_a_batched_rule_gets_lists(tokenizer, rules_pkg, monkeypatch):
    monkeypatch.chdir(rules_pkg)
    cfg = load_config(BASE, ["reward.rules.f=judge.py:score", "reward.rules.b.fn=judge.py:score_batch",
                             "reward.rules.b.batched=true"])
    assert cfg.reward.rules.f == f"{(rules_pkg / 'judge.py').resolve()}:score"
    assert cfg.reward.rules.b.fn == f"{(rules_pkg / 'judge.py').resolve()}:score_batch"
    monkeypatch.chdir(REPO)  # e.g. `megappo eval --config <output_dir>/config.json` run from elsewhere
    mgr = RewardManager(tokenizer, 0, scorers=load_rules(cfg.reward.rules))
    scores, metrics = mgr(batch(tokenizer, ["a 1", "b 2", "a 9", "b 9"], ["f", "b", "f", "b"], ["1", "2", "1", "2"]))
    assert scores.sum(-1).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert metrics["reward/f/correct_rate"] == metrics["reward/b/correct_rate"] == 0.5


def test_a_rule_that_times_out_or_raises_scores_zero_and_is_counted(tokenizer, rules_pkg, caplog):
    mgr = manager(tokenizer, "reward.rules.slow.fn=my_rules.rewards:slow_batch", "reward.rules.slow.batched=true",
                  "reward.rules.slow.timeout_s=0.2", "reward.rules.bad=my_rules.rewards:broken")
    data = batch(tokenizer, ["x", "y", "z", "#### 3"], ["slow", "slow", "bad", "arithmetic"], ["x", "y", "z", "3"])
    with caplog.at_level(logging.WARNING, logger="megappo.rewards.rules"):
        scores, metrics = mgr(data)
    assert scores.sum(-1).tolist() == [0.0, 0.0, 0.0, 1.0]
    assert metrics["reward/num_scorer_errors"] == 3.0 and metrics["reward/num_scorer_timeouts"] == 2.0
    assert "data_source 'slow' failed on 2 of 2 rows (RuleTimeout: no result within timeout_s=0.2)" in caplog.text
    assert "data_source 'bad' failed on 1 of 1 rows (RuleTimeout" not in caplog.text
    assert "data_source 'bad' failed on 1 of 1 rows (RuntimeError: judge unreachable)" in caplog.text


def test_a_nan_or_inf_from_a_rule_scores_zero_and_is_counted(tokenizer, rules_pkg, caplog):
    """A NaN or inf score would poison its whole group's advantages: the same rule as a reward your own agent
    returns (rewards.rules.as_reward) refuses it, so its row scores 0 as a failed call, counted and warned."""
    import math

    mgr = manager(tokenizer, "reward.rules.judge=my_rules.rewards:nan_or_inf")
    data = batch(tokenizer, ["a", "b", "#### 3"], ["judge", "judge", "arithmetic"], ["x", "y", "3"])
    with caplog.at_level(logging.WARNING, logger="megappo.rewards.rules"):
        scores, metrics = mgr(data)
    assert all(math.isfinite(v) for v in scores.sum(-1).tolist()) and scores.sum(-1).tolist() == [0.0, 0.0, 1.0]
    assert metrics["reward/num_scorer_errors"] == 2.0
    assert "reward 'nan' is not a finite number" in caplog.text


@pytest.mark.parametrize("overrides, expected", [
    (["reward.rules.t=no_such_pkg.rewards:score"],
     "reward.rules.t: cannot import no_such_pkg.rewards (No module named 'no_such_pkg'); put its directory on "
     "PYTHONPATH, pip install it, or name the file: /path/to/file.py:function"),
    (["reward.rules.t=/nowhere/judge.py:score"],
     "reward.rules.t: file /nowhere/judge.py does not exist; fix the path"),
    (["reward.rules.t=my_rules.rewards:nope"],
     "reward.rules.t: my_rules.rewards has no 'nope'; fix the function name after the ':'"),
    (["reward.rules.t=my_rules.rewards:two_args"],
     "reward.rules.t=my_rules.rewards:two_args has the signature (response, ground_truth), but a rule is "
     "fn(response, ground_truth, extra_info) -> score; give it 3 positional parameters"),
    (["reward.rules.t.fn=my_rules.rewards:two_args", "reward.rules.t.batched=true"],
     "but a rule is fn(responses, ground_truths, extra_infos) -> list of scores"),
    (["reward.rules.t=my_rules.rewards:NOT_A_FUNCTION"], "is a int, not a function; name a function"),
    (["reward.rules.t=my_rules.rewards"], "reward.rules.t=my_rules.rewards is not 'module:function'"),
    (["reward.rules.t.fun=my_rules.rewards:score"], "reward.rules.t has unknown key(s) ['fun']; its keys are fn, "
                                                    "batched, timeout_s"),
    (["reward.rules.t.fn=my_rules.rewards:score", "reward.rules.t.timeout_s=-1"],
     "reward.rules.t.timeout_s=-1 must be a number of seconds > 0"),
])
def test_bad_rules_are_one_config_error_line(rules_pkg, overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(BASE, overrides)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_a_rule_for_a_builtin_source_replaces_it_with_a_warning(tokenizer, rules_pkg, caplog):
    with caplog.at_level(logging.WARNING, logger="megappo.rewards.rules"):
        mgr = manager(tokenizer, "reward.rules.arithmetic=my_rules.rewards:score")
    assert "reward.rules.arithmetic replaces megappo's built-in 'arithmetic' rule" in caplog.text
    _, metrics = mgr(batch(tokenizer, ["#### 3"], ["arithmetic"], ["3"]))
    assert "reward/arithmetic/chars" in metrics  # the config's rule scored it


def test_megappo_train_refuses_a_bad_rule_in_one_line(tmp_path):
    from cli_helpers import run_cli

    rc, _, stderr = run_cli("train", "--config", BASE, "reward.rules.t=no_such_pkg:score",
                            f"trainer.output_dir={tmp_path / 'run'}")
    assert rc == 2
    assert stderr.strip().splitlines() == ["megappo train: reward.rules.t: cannot import no_such_pkg (No module "
                                                "named 'no_such_pkg'); put its directory on PYTHONPATH, pip install it,"
                                                " or name the file: /path/to/file.py:function"]
    assert not (tmp_path / "run").exists()


# ---- megappo data ------------------------------------------------------------------------------------

def _data(*args) -> int:
    from megappo.cli import main

    return main(["data", *map(str, args)])


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_data_command_round_trip_into_the_trainers_dataset(tmp_path, tokenizer, capsys):
    from megappo.data import RLHFDataset

    records = [{"question": f"What is {i} + 1?", "answer": i + 1, "level": i % 3} for i in range(10)]
    src = write_jsonl(tmp_path / "mine.jsonl", records)
    out = tmp_path / "out"
    assert _data("--input", src, "--prompt-key", "question", "--answer-key", "answer", "--data-source", "my_task",
                 "--out", out, "--test-fraction", "0.2", "--seed", "1") == 0
    printed = capsys.readouterr().out
    assert f"wrote 8 rows to {out / 'train.parquet'}" in printed and "reward.rules.my_task=" in printed
    train, test = (RLHFDataset([out / f"{s}.parquet"], tokenizer, max_prompt_length=64) for s in ("train", "test"))
    assert (len(train), len(test)) == (8, 2)
    rows = train.rows + test.rows
    assert sorted(r["extra_info"]["index"] for r in rows) == list(range(10))
    for r in rows:
        i = r["extra_info"]["index"]
        assert r["data_source"] == "my_task" and r["reward_model"]["ground_truth"] == str(i + 1)
        assert r["raw_prompt"] == [{"role": "user", "content": f"What is {i} + 1?"}]
        assert r["extra_info"]["level"] == i % 3
    assert {r["extra_info"]["split"] for r in test.rows} == {"test"}
    assert test.get_batch([0, 1]).non_tensor_batch["extra_info"][0]["split"] == "test"  # reaches the reward rule
    # the same rows as .json and .parquet: the same split for the same seed
    (tmp_path / "mine.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "mine.parquet")
    for suffix in ("json", "parquet"):
        assert _data("--input", tmp_path / f"mine.{suffix}", "--prompt-key", "question", "--answer-key", "answer",
                     "--data-source", "my_task", "--out", tmp_path / suffix, "--test-fraction", "0.2",
                     "--seed", "1") == 0
        assert pq.read_table(tmp_path / suffix / "test.parquet").equals(pq.read_table(out / "test.parquet"))


@pytest.mark.parametrize("name, content, flags, expected", [
    ("rows.jsonl", '{"question": "a", "answer": 1}\n\n{"question": "b", answer: 2}\n', [],
     "rows.jsonl line 3 is not valid JSON (Expecting property name enclosed in double quotes, column 19); fix or "
     "remove that line"),
    ("rows.jsonl", "", [], "rows.jsonl has no rows; give a file with at least one row"),
    ("rows.jsonl", '{"q": "a", "answer": 1}\n', [],
     "rows.jsonl row 1 has no field 'question' (its fields: q, answer); pass --prompt-key with the right field"),
    ("rows.jsonl", '{"question": "a", "answer": 1}\n{"question": "b", "answer": null}\n', [],
     "rows.jsonl row 2 is empty in 'answer' (its fields: question, answer); pass --answer-key"),
    ("rows.json", '{"question": "a"}', [], "must hold a JSON list of objects"),
    ("rows.csv", "question,answer\n", [], "unknown file type .csv; give a .jsonl, .json, .parquet file"),
    ("rows.jsonl", '{"question": "a", "answer": 1}\n', ["--test-fraction", "0.5"],
     "1 row(s) leave none for train after a 0.5 test split; give more rows or --test-fraction 0"),
    ("rows.jsonl", '{"question": "a", "answer": 1, "x": 1}\n{"question": "b", "answer": 2, "x": "two"}\n',
     ["--test-fraction", "0"],
     "field 'x' holds values of different types across rows"),
])
def test_data_command_bad_inputs_are_one_line(tmp_path, capsys, name, content, flags, expected):
    (tmp_path / name).write_text(content)
    rc = _data("--input", tmp_path / name, "--prompt-key", "question", "--answer-key", "answer",
               "--data-source", "my_task", "--out", tmp_path / "out", *flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("megappo data: ") and expected in err[0], err
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_data_command_on_a_latin1_file_or_an_out_that_is_a_file_is_one_line(tmp_path, capsys, suffix):
    """Both were tracebacks (UnicodeDecodeError; FileExistsError from mkdir)."""
    row = {"question": "Was kostet ein Brötchen?", "answer": 1}
    text = json.dumps(row, ensure_ascii=False) + "\n" if suffix == "jsonl" else json.dumps([row], ensure_ascii=False)
    (tmp_path / f"rows.{suffix}").write_bytes(text.encode("latin-1"))
    args = ["--input", tmp_path / f"rows.{suffix}", "--prompt-key", "question", "--answer-key", "answer",
            "--data-source", "my_task"]
    assert _data(*args, "--out", tmp_path / "out") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"megappo data: {tmp_path / f'rows.{suffix}'} is not UTF-8 text") \
        and "re-save it as UTF-8" in err[0], err
    (tmp_path / f"rows.{suffix}").write_bytes(text.encode("utf-8"))
    (tmp_path / "taken").write_text("a file")
    assert _data(*args, "--out", tmp_path / "taken" / "out") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megappo data: --out {tmp_path / 'taken' / 'out'}: {tmp_path / 'taken'} is a file; choose a "
                   "directory"], err


# ---- the trainer's and megappo eval's reward paths -------------------------------------------------------

@pytest.fixture
def my_task(tmp_path, rules_pkg):
    """`megappo data` rows of data_source my_task, and judge.py's 3-argument rule for them."""
    records = [{"question": f"Say {w}.", "answer": w, "level": i} for i, w in enumerate(["red", "blue", "green"])]
    assert _data("--input", write_jsonl(tmp_path / "mine.jsonl", records), "--prompt-key", "question",
                 "--answer-key", "answer", "--data-source", "my_task", "--out", tmp_path / "data",
                 "--test-fraction", "0") == 0
    return tmp_path / "data" / "train.parquet", f"{rules_pkg / 'judge.py'}:score"


def answering(tokenizer, prompts: DataProto) -> DataProto:
    """The prompts' batch answered with each row's ground truth (the stand-in for vLLM)."""
    texts = [f"It is {info['ground_truth']}" for info in prompts.non_tensor_batch["reward_model"]]
    data = batch(tokenizer, texts, list(prompts.non_tensor_batch["data_source"]), [""] * len(texts))
    data.batch["stopped"] = torch.ones(len(texts), dtype=torch.bool)
    return DataProto.from_dict(dict(data.batch.items()), dict(prompts.non_tensor_batch))


def test_trainer_reward_path_uses_the_configs_rule(tiny_assets, tmp_path, my_task):
    from megappo.ppo.ray_trainer import RayPPOTrainer
    from trainer_utils import overrides

    data, rule = my_task
    base = overrides(tiny_assets, data.parent, tmp_path / "run", f"data.train_files=[{data}]",
                     f"data.val_files=[{data}]", "data.train_batch_size=2", "actor.ppo_mini_batch_size=4",
                     "critic.ppo_mini_batch_size=4", "critic.micro_batch_size=2")
    with pytest.raises(ValueError, match="no reward rule for data_source 'my_task' .*reward.rules.my_task="):
        RayPPOTrainer(load_config(BASE, base), show_progress=False)  # refused before any worker starts
    trainer = RayPPOTrainer(load_config(BASE, base + [f"reward.rules.my_task={rule}"]), show_progress=False)
    trainer.preemption.uninstall()
    prompts = trainer.train_dataset.get_batch(range(3))
    for fn in (trainer.reward_fn, trainer.val_reward_fn):
        scores, metrics = fn(answering(trainer.tokenizer, prompts))
        assert scores.sum(-1).tolist() == [1.0, 1.0, 1.0]
        assert metrics["reward/my_task/correct_rate"] == 1.0 and metrics["reward/my_task/level"] == 1.0


def test_megappo_eval_scores_with_the_configs_rule(tiny_assets, tmp_path, my_task, monkeypatch, capsys):
    """`megappo eval --config` (the run's YAML) in this process, vLLM replaced by a stand-in that answers
    each prompt with its ground truth: the config's rule scores, its extras are in the report."""
    import types

    from transformers import AutoTokenizer

    from megappo.cli import main

    class Answering:
        def __init__(self, model_dir, *args, **kwargs):
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

        def generate_sequences(self, prompts):
            return answering(self.tokenizer, prompts)

    monkeypatch.setitem(sys.modules, "megappo.workers.rollout.vllm_rollout", types.SimpleNamespace(VLLMRollout=Answering))
    data, rule = my_task
    (tmp_path / "run.yaml").write_text(f"reward:\n  rules:\n    my_task: {rule}\nrollout:\n  max_new_tokens: 24\n")
    rc = main(["eval", "--model", str(tiny_assets["tiny-llama"]), "--config", str(tmp_path / "run.yaml"),
               "--data", str(data), "--out", str(tmp_path / "report.json")])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())["by_source"]["my_task"]
    assert report["accuracy"] == 1.0 and report["num_scorer_errors"] == 0
    assert report["rule_metrics"] == {"chars": pytest.approx((9 + 10 + 11) / 3), "level": 1.0}
    assert "my_task: accuracy 1.000  chars 10.000  level 1.000" in capsys.readouterr().out


@pytest.mark.long
def test_megappo_eval_with_a_file_rule_in_vllm(tiny_assets, tmp_path, my_task):
    """The real command (vLLM generating) with a relative file rule in the run's YAML (~60 s; CI runs the
    stand-in above)."""
    data, _ = my_task
    (tmp_path / "run.yaml").write_text("reward:\n  rules:\n    my_task: judge.py:score\nrollout:\n  max_new_tokens: 8\n")
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", "eval", "--model", str(tiny_assets["tiny-llama"]),
                           "--config", "run.yaml", "--data", str(data), "--out", "report.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())["by_source"]["my_task"]
    assert report["num_responses"] == 3 and report["rule_metrics"]["level"] == 1.0
