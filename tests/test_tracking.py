"""Tracking: jsonl / tensorboard / console backends write what was logged; bad backends fail clearly."""

import json
import math
import sys

import numpy as np
import pytest
import torch
from rich.console import Console

from megappo.utils.tracking import Tracking, read_metrics


def test_jsonl_lines_hold_what_was_logged(tmp_path):
    with Tracking("proj", "exp", tmp_path, backends=("jsonl",), config={"lr": 1e-6, "model": {"tp": 2}}) as t:
        t.log({"loss": 0.5, "kl": torch.tensor(0.25), "n_tokens": np.int64(7), "acc": np.float32(0.75)}, step=1)
        # flushed at once: readable before close
        assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss"] == 0.5
        t.log({"loss": float("nan"), "kl": float("inf")}, step=2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0]) == {"step": 1, "loss": 0.5, "kl": 0.25, "n_tokens": 7, "acc": 0.75}
    assert json.loads(lines[1]) == {"step": 2, "loss": None, "kl": None}  # valid JSON: no NaN literal
    rows = read_metrics(tmp_path)
    assert rows[0]["kl"] == 0.25 and isinstance(rows[0]["kl"], float)
    assert rows[1]["step"] == 2 and math.isnan(rows[1]["loss"])
    assert read_metrics(tmp_path / "metrics.jsonl")[0] == rows[0]  # a file path works too
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1e-6, "model": {"tp": 2}}


def test_jsonl_appends_across_runs(tmp_path):
    for step in (1, 2):
        with Tracking("p", "e", tmp_path, backends="jsonl") as t:
            t.log({"x": step * 1.0}, step=step)
    assert [r["x"] for r in read_metrics(tmp_path)] == [1.0, 2.0]


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracking("p", "e", tmp_path, backends=("tensorboard",)) as t:
        for step in range(3):
            t.log({"actor/loss": 1.0 / (step + 1), "critic/vf": torch.tensor(step * 2.0)}, step=step)
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert files
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"actor/loss", "critic/vf"}
    loss = acc.Scalars("actor/loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [e.value for e in acc.Scalars("critic/vf")] == pytest.approx([0.0, 2.0, 4.0])


def test_console_line_sorted_4_significant_digits(tmp_path):
    console = Console(record=True, width=200, color_system=None)
    with Tracking("p", "e", tmp_path, backends=("console",), console=console) as t:
        t.log({"zeta": 3.14159265, "alpha": 123456.789, "count": 12}, step=5)
    text = console.export_text()
    assert "step 5" in text
    assert "alpha=1.235e+05" in text and "count=12" in text and "zeta=3.142" in text
    assert text.index("alpha") < text.index("count") < text.index("zeta")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_console_default_writes_stdout(tmp_path, capsys):
    with Tracking("p", "e", tmp_path, backends=["console"]) as t:
        t.log({"reward/mean": 0.123456}, step=0)
    assert "reward/mean=0.1235" in capsys.readouterr().out


def test_unknown_backend_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="'mlflow'.*console, jsonl, tensorboard, wandb"):
        Tracking("p", "e", tmp_path, backends=("console", "mlflow"))


def test_wandb_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="pip install wandb.*drop 'wandb' from backends"):
        Tracking("p", "e", tmp_path, backends=("jsonl", "wandb"))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_metric_values_and_log_after_close(tmp_path):
    t = Tracking("p", "e", tmp_path, backends=("jsonl",))
    with pytest.raises(TypeError, match="'name'"):
        t.log({"name": "abc"}, step=0)
    with pytest.raises(ValueError, match="'vec'.*3 elements"):
        t.log({"vec": torch.zeros(3)}, step=0)
    t.close()
    t.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        t.log({"x": 1.0}, step=1)


def test_console_shows_the_chosen_keys_and_counts_the_rest(tmp_path):
    """`make demo` printed every metric (~3,000 characters a step) under the progress bar: with console_keys the
    line holds those (labelled, in order, when logged) and says how many more went to the files; jsonl keeps all."""
    console = Console(record=True, width=300, color_system=None)
    metrics = {"objective/scores": 0.25, "objective/kl": 0.001234567, **{f"x/{i}": float(i) for i in range(40)}}
    with Tracking("p", "e", tmp_path, backends=("console", "jsonl"), console=console,
                  console_keys=[("score", "objective/scores"), ("eval", "eval/score"), ("kl", "objective/kl")]) as t:
        t.log(metrics, step=3)
    line = console.export_text().strip()
    assert line == "step 3 | score=0.25 | kl=0.001235  (+40 more in jsonl)", line
    assert len(read_metrics(tmp_path)[0]) == 1 + len(metrics)

