"""Bad inputs: each one a non-zero exit with ONE line that names the fix, and nothing half-written.

Every case runs the real command line and checks the exit code, the exact one-line message, and that no
output was created: `python -m megappo.cli ...` in a subprocess where the error comes before the heavy
imports, the same entry point (megappo.cli.main, its stderr captured) in this process where it comes after
them (a new interpreter would spend 5-8 s importing torch, transformers and Ray to print that line)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=REPO, env=None, timeout=600):
    import os

    proc = subprocess.run([sys.executable, "-m", "megappo.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    return proc.returncode, _error_lines(proc.stderr)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and "Warning" not in line
            and not line.startswith(("  warnings.warn", "WARNING"))]


@pytest.fixture
def cli_here(ray_session, monkeypatch):
    """`_cli` in this process: megappo.cli.main(args) from the repo dir, stderr captured (argparse's exit too).
    On the session's Ray, so `megappo train` connects to it and never starts or stops one of its own."""
    import contextlib
    import io

    from megappo.cli import main

    monkeypatch.chdir(REPO)

    def run(*args):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in args])
            except SystemExit as e:  # as the interpreter exits: a message goes to stderr with code 1
                rc = e.code if not isinstance(e.code, str) else (print(e.code, file=sys.stderr), 1)[1]
        return rc, _error_lines(err.getvalue())

    return run


def _one_line(rc, lines, expected: str):
    assert rc != 0, lines
    assert len(lines) == 1, lines
    assert expected in lines[0], lines[0]


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    from megappo.data.preprocess_arithmetic import main

    out = tmp_path_factory.mktemp("data")
    main(["--out", str(out), "--train-size", "32", "--val-size", "4"])
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(out / "arith_val.parquet").to_pylist()
    for r in rows:
        r["reward_model"] = {"style": "rule"}
    pq.write_table(pa.Table.from_pylist(rows), out / "no_ground_truth.parquet")
    return out


# ---- megappo eval / export -------------------------------------------------------------------------

def test_eval_missing_model_dir(tmp_path, parquet_dir):
    rc, lines = _cli("eval", "--model", tmp_path / "nope", "--data", parquet_dir / "arith_val.parquet",
                     "--out", tmp_path / "r.json")
    _one_line(rc, lines, f"megappo eval: --model {tmp_path / 'nope'} does not exist")
    assert not (tmp_path / "r.json").exists()


def test_export_and_eval_refuse_a_torn_checkpoint(tmp_path, parquet_dir, cli_here):
    torn = tmp_path / "checkpoints" / "step_00000004"
    (torn / "actor").mkdir(parents=True)
    (torn / "actor" / "metadata.json").write_text("{}")
    rc, lines = _cli("export", "--ckpt", torn, "--out", tmp_path / "hf")
    _one_line(rc, lines, "is a torn checkpoint (no valid MANIFEST.json: the save was cut short); export an earlier step")
    assert not (tmp_path / "hf").exists()
    rc, lines = cli_here("eval", "--model", torn, "--data", parquet_dir / "arith_val.parquet")
    _one_line(rc, lines, "is a torn checkpoint")


def test_eval_baseline_that_is_not_a_report(tiny_assets, tmp_path, parquet_dir):
    (tmp_path / "base.json").write_text("[1, 2]")
    rc, lines = _cli("eval", "--model", tiny_assets["tiny-llama"], "--data", parquet_dir / "arith_val.parquet",
                     "--baseline", tmp_path / "base.json", "--out", tmp_path / "r.json")
    _one_line(rc, lines, "is not a `megappo eval --out` report (TypeError); run megappo eval on the base model")
    assert not (tmp_path / "r.json").exists()


def test_eval_compare_lines_show_the_change_in_points():
    from megappo.evaluate import compare_lines

    lines = compare_lines({"arithmetic": {"accuracy": 0.25}, "other": {"accuracy": 0.5}},
                          {"by_source": {"arithmetic": {"accuracy": 0.4}, "all": {"accuracy": 0.4}}})
    assert len(lines) == 2 and lines[1].split() == ["arithmetic", "0.250", "0.400", "+15.0pt"]


def test_export_of_a_run_dir_names_its_newest_checkpoint_as_a_path(tmp_path):
    run = tmp_path / "run"
    for step in ("step_00000002", "step_00000004"):
        (run / "checkpoints" / step).mkdir(parents=True)
    rc, lines = _cli("export", "--ckpt", run, "--out", tmp_path / "hf")
    _one_line(rc, lines, f"is a run's output dir; pass one of its checkpoints, e.g. {run / 'checkpoints' / 'step_00000004'}")
    assert "PosixPath" not in lines[0] and "[" not in lines[0]


def test_eval_lengths_that_do_not_fit_the_model(tiny_assets, tmp_path, parquet_dir, cli_here):
    """Defaults shrink to the model's 512 positions (tests/test_trainer runs the README's form); lengths
    given explicitly are refused in one line naming the flags."""
    rc, lines = cli_here("eval", "--model", tiny_assets["tiny-llama"], "--data", parquet_dir / "arith_val.parquet",
                     "--max-prompt-length", "400", "--max-new-tokens", "200")
    _one_line(rc, lines, "max prompt length 400 + max new tokens 200 = 600 exceeds the 512 positions of")
    assert "lower --max-prompt-length or --max-new-tokens" in lines[0]


def test_export_missing_checkpoint(tmp_path):
    rc, lines = _cli("export", "--ckpt", tmp_path / "nope", "--out", tmp_path / "hf")
    _one_line(rc, lines, "does not exist; pass <output_dir>/checkpoints/step_N")
    assert not (tmp_path / "hf").exists()


def test_eval_parquet_without_ground_truth(tiny_assets, tmp_path, parquet_dir, cli_here):
    rc, lines = cli_here("eval", "--model", tiny_assets["tiny-llama"], "--data", parquet_dir / "no_ground_truth.parquet",
                     "--out", tmp_path / "r.json")
    _one_line(rc, lines, "row 0 has no reward_model.ground_truth")
    assert not (tmp_path / "r.json").exists()


def test_eval_model_tokenizer_mismatch(tiny_assets, tmp_path, parquet_dir, cli_here):
    model = tmp_path / "model"
    shutil.copytree(tiny_assets["tiny-llama"], model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["vocab_size"] = 500  # the tokenizer has 1000 tokens
    (model / "config.json").write_text(json.dumps(cfg))
    rc, lines = cli_here("eval", "--model", model, "--data", parquet_dir / "arith_val.parquet")
    _one_line(rc, lines, "has 1000 tokens but the model's vocab_size is 500: they do not belong together")


def test_eval_model_without_tokenizer(tiny_assets, tmp_path, parquet_dir, cli_here):
    model = tmp_path / "model"
    model.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_assets["tiny-llama"] / f, model / f)
    rc, lines = cli_here("eval", "--model", model, "--data", parquet_dir / "arith_val.parquet")
    _one_line(rc, lines, "has no usable tokenizer")


def test_serve_tool_prompt_without_its_placeholder_and_a_dir_without_a_tokenizer(tiny_assets, tmp_path, cli_here):
    """`megappo serve --tool-prompt` without {tools} would show the model no tools (the config check refuses it
    for rollout.multi_turn.tool_prompt under the built-in loop and your own agent alike); a model dir without a
    tokenizer is one line, with or without --tool-parser (it was a traceback). A subprocess with a deadline:
    before the fix the first started serving."""
    rc, lines = _cli("serve", "--model", tiny_assets["tiny-llama"], "--tool-prompt", "You can use tools.",
                     timeout=60)
    _one_line(rc, lines, "serve: --tool-prompt must contain {tools} (where the tools' schemas go)")
    model = tmp_path / "model"
    model.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_assets["tiny-llama"] / f, model / f)
    rc, lines = cli_here("serve", "--model", model, "--tool-parser", "hermes")
    _one_line(rc, lines, f"serve: {model.resolve()} has no usable tokenizer")


def test_logprobs_on_an_unsupported_model_or_layout_is_one_line(tiny_assets, tmp_path):
    """It was a ValueError inside a worker's traceback: checked before any worker starts."""
    model = tmp_path / "moe"
    model.mkdir()
    cfg = json.loads((tiny_assets["tiny-llama"] / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt_oss")))
    (tmp_path / "rows.jsonl").write_text('{"input_ids": [1, 2, 3], "response_start": 1}\n')
    io = ["--input", tmp_path / "rows.jsonl", "--out", tmp_path / "out.safetensors"]
    rc, lines = _cli("logprobs", "--model", model, *io)
    _one_line(rc, lines, "megappo logprobs: model_type 'gpt_oss' not supported; choose one of llama,")
    rc, lines = _cli("logprobs", "--model", tiny_assets["tiny-llama"], "--tp", "3", "--dp", "1", *io)
    _one_line(rc, lines, "megappo logprobs: ")
    assert "tp=3" in lines[0] and not (tmp_path / "out.safetensors").exists()


def test_serve_lengths_default_to_the_models_positions():
    """`megappo serve --model outputs/ppo_tiny/hf_final` (512 positions) died in a pydantic traceback under the
    old default --max-model-len 2048: the default is now the model's positions, more is one line."""
    from megappo.serve import lengths

    assert lengths(512, None, 512) == (512, 511)  # a request keeps at least one prompt token
    assert lengths(512, 256, 64) == (256, 64)
    with pytest.raises(SystemExit, match=r"^serve: --max-model-len 2048 exceeds the model's 512 positions "
                                         r"\(config.json max_position_embeddings\); lower it or leave it out$"):
        lengths(512, 2048, 64)


def test_a_tool_prompt_without_its_placeholder_is_refused_for_your_own_agent_too(tiny_assets, data_dir, tmp_path):
    from megappo.config.loader import ConfigError, load_config

    from trainer_utils import overrides

    agent = REPO / "examples" / "agents" / "calculator.py"
    with pytest.raises(ConfigError, match=r"^rollout.multi_turn.tool_prompt must contain \{tools\}"):
        load_config(REPO / "configs/ppo_tiny.yaml", overrides(tiny_assets, data_dir, tmp_path) + [
            f"rollout.agent={agent}:run", "rollout.multi_turn.tool_prompt='Tools are available.'"])


# ---- megappo train: caught before Ray or any worker starts ------------------------------------------

@pytest.fixture(scope="module")
def run_args(tiny_assets, parquet_dir):
    def args(tmp_path, *extra):
        return ["train", "--config", "configs/ppo_tiny.yaml", "--no-progress", f"model.path={tiny_assets['tiny-llama']}",
                f"data.train_files=[{parquet_dir / 'arith_train.parquet'}]",
                f"data.val_files=[{parquet_dir / 'arith_val.parquet'}]", f"trainer.output_dir={tmp_path / 'out'}",
                "trainer.total_steps=1", *extra]
    return args


def _nothing_written(tmp_path):
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


TRAIN_CASES = [
    # (overrides, exit code, the one line must contain)
    (["trainer.totl_steps=2"], 2, "unknown config key 'trainer.totl_steps': did you mean trainer.total_steps?"),
    (["trainer.total_steps=abc"], 2, "config key 'trainer.total_steps': Value 'abc' of type 'str' could not be "
                                     "converted to Integer"),
    (["resources.workers_per_node=3", "actor.parallel.tp=3", "actor.parallel.dp=1", "critic.parallel.dp=3",
      "ref.parallel.dp=3"], 2, "actor.parallel.tp=3 does not divide the model's 4 attention heads"),
    (["data.max_prompt_length=5"], 2, "no prompts left from"),
    (["model.transformer_engine=true"], 2, "model.transformer_engine=true needs resources.device=cuda"),
    (["data.max_prompt_length=5"], 2, "longer than max_prompt_length=5"),
]


@pytest.mark.parametrize("extra,rc,expected", TRAIN_CASES, ids=[c[2][:40] for c in TRAIN_CASES])
def test_train_config_and_data_errors(run_args, tmp_path, extra, rc, expected, cli_here):
    # caught by the config check (a fresh interpreter, no torch) or by the data check (in this process)
    got, lines = (cli_here if "prompt" in expected else _cli)(*run_args(tmp_path, *extra))
    _one_line(got, lines, expected)
    assert got == rc
    _nothing_written(tmp_path)


def _model_copy(tiny_assets, tmp_path, drop=(), vocab=None, truncate=False) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_assets["tiny-llama"], model)
    for f in drop:
        (model / f).unlink()
    if vocab is not None:
        cfg = json.loads((model / "config.json").read_text())
        cfg["vocab_size"] = vocab
        (model / "config.json").write_text(json.dumps(cfg))
    if truncate:
        data = (model / "model.safetensors").read_bytes()
        (model / "model.safetensors").write_bytes(data[:200])
    return model


@pytest.mark.parametrize("kind,expected", [
    ("no_weights", "has no weights (*.safetensors, or a megatron dist checkpoint's metadata.json)"),
    ("corrupt", "is not a readable safetensors file"),
    ("no_tokenizer", "has no tokenizer (tokenizer.json / tokenizer.model / vocab.json)"),
    ("vocab", "has 1000 tokens but the model (")])
def test_train_model_dir_errors(run_args, tiny_assets, tmp_path, kind, expected, cli_here):
    model = _model_copy(tiny_assets, tmp_path, drop={"no_weights": ["model.safetensors"],
                                                     "no_tokenizer": ["tokenizer.json", "tokenizer_config.json"]}
                        .get(kind, ()), vocab=900 if kind == "vocab" else None, truncate=kind == "corrupt")
    rc, lines = (cli_here if kind == "vocab" else _cli)(*run_args(tmp_path, f"model.path={model}"))
    _one_line(rc, lines, expected)
    _nothing_written(tmp_path)


def test_train_data_errors(run_args, tmp_path, parquet_dir, cli_here):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(parquet_dir / "arith_train.parquet").to_pylist()
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "reward_model"} for r in rows]),
                   tmp_path / "no_column.parquet")
    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), tmp_path / "empty.parquet")
    pq.write_table(pa.Table.from_pylist([dict(r, data_source="my_task") for r in rows]), tmp_path / "unknown.parquet")
    for name, expected in (("no_column", "has no column 'reward_model'"), ("empty", "no prompts left from"),
                           ("unknown", "no reward rule for data_source 'my_task'")):
        rc, lines = cli_here(*run_args(tmp_path, f"data.train_files=[{tmp_path / name}.parquet]"))
        _one_line(rc, lines, expected)
        _nothing_written(tmp_path)


def test_train_output_and_resume_errors(run_args, tiny_assets, tmp_path):
    (tmp_path / "a_file").write_text("x")
    rc, lines = _cli(*run_args(tmp_path, f"trainer.output_dir={tmp_path / 'a_file' / 'run'}"))
    _one_line(rc, lines, f"cannot be created: {tmp_path / 'a_file'} is a file; choose another dir")
    torn = tmp_path / "ckpt" / "step_00000002"
    (torn / "actor").mkdir(parents=True)
    rc, lines = _cli(*run_args(tmp_path, f"trainer.resume={torn}"))
    _one_line(rc, lines, "is a torn checkpoint (no valid MANIFEST.json: its save was cut short)")
    _nothing_written(tmp_path)
    # a whole checkpoint of another model (hidden 64 instead of 128)
    from megappo.utils.checkpoint import atomic_checkpoint

    with atomic_checkpoint(tmp_path / "other", 2) as d:
        (d / "actor").mkdir()
        cfg = json.loads((tiny_assets["tiny-llama"] / "config.json").read_text())
        (d / "actor" / "config.json").write_text(json.dumps(dict(cfg, hidden_size=64)))
    rc, lines = _cli(*run_args(tmp_path, f"trainer.resume={tmp_path / 'other' / 'step_00000002'}"))
    _one_line(rc, lines, "is of another model (hidden_size 64 vs 128 in model.path)")
    _nothing_written(tmp_path)


# ---- during a run: the step skipped or the run stopped, the row scored 0, the disk full ----------------

def test_reward_rule_raising_on_a_row_scores_it_zero_and_counts_it(tiny_assets):
    import torch
    from transformers import AutoTokenizer

    from megappo.protocol import DataProto
    from megappo.rewards.manager import RewardManager

    tok = AutoTokenizer.from_pretrained(str(tiny_assets["tokenizer"]))

    def picky(response, ground_truth, extra_info):
        if ground_truth == "boom":
            raise RuntimeError("cannot parse")
        return 1.0

    rm = RewardManager(tok, 0, scorers={"t": picky})
    data = DataProto.from_dict({"responses": torch.tensor([[5, 6], [7, 8]]), "response_mask": torch.ones(2, 2),
                                "stopped": torch.tensor([True, True])},
                               {"data_source": ["t", "t"], "reward_model": [{"ground_truth": "1"},
                                                                            {"ground_truth": "boom"}]})
    scores, metrics = rm(data)
    assert scores.sum(-1).tolist() == [1.0, 0.0]
    assert metrics["reward/num_scorer_errors"] == 1.0 and metrics["objective/verifiable_correct_rate"] == 0.5


def test_nan_loss_skips_the_step_or_stops_the_run(tiny_assets):
    from megappo.parallel.launch import spawn_local

    (r,) = spawn_local(_nan_job, 1, str(tiny_assets["tiny-llama"]))
    assert r["skip"]["nan_skipped"] == 1.0 and r["skip"]["update_successful"] is False
    assert r["params_unchanged"] and r["next_ok"]
    assert "non-finite loss in this lm-head update (optimizer step 2)" in r["stop"]
    assert "trainer.on_nan=skip" in r["stop"]


def _nan_job(rank, world, port, path):
    import torch

    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, master_port=port)
    init_megatron(ParallelLayout())
    batch = {"input_ids": torch.randint(3, 900, (2, 10)), "attention_mask": torch.ones(2, 10, dtype=torch.long)}

    def loss(value):
        return lambda outs, mb: ((outs["logprobs"].sum() * value), {})

    out = {}
    for mode in ("skip", "stop"):
        eng = MegatronEngine(path, ParallelLayout(), EngineConfig(optim=OptimConfig(lr=1e-2), on_nan=mode))
        eng.train_step(batch, loss(1.0), 1.0, response_length=4, micro_batch_size=2)
        before = {k: v.clone() for k, v in eng.named_parameters_global()}
        try:
            m = eng.train_step(batch, loss(float("nan")), 1.0, response_length=4, micro_batch_size=2)
        except FloatingPointError as e:
            out[mode] = str(e)
            continue
        out[mode] = m
        out["params_unchanged"] = all(torch.equal(before[k], v) for k, v in eng.named_parameters_global())
        out["next_ok"] = eng.train_step(batch, loss(1.0), 1.0, response_length=4, micro_batch_size=2)[
            "update_successful"]
    return out


def test_disk_full_during_save_leaves_nothing_half_written(tmp_path):
    """A 1 MB tmpfs as the checkpoint disk (tests/small_disk.py: no privileges): the save fails with one line naming
    the fix, no step dir."""
    import errno

    from small_disk import small_disk

    from megappo.ppo.checkpointing import checkpoint_disk_full
    from megappo.utils.checkpoint import atomic_checkpoint

    with small_disk(tmp_path / "disk", "1m") as disk:
        with pytest.raises(OSError) as info:
            with atomic_checkpoint(disk / "checkpoints", 3) as d:
                (d / "actor.bin").write_bytes(b"\0" * (2 << 20))
        assert info.value.errno == errno.ENOSPC
        assert list((disk / "checkpoints").iterdir()) == []  # the temp dir is gone, nothing to resume from
        msg = str(checkpoint_disk_full(3, disk / "checkpoints", info.value))
        assert "checkpoint of step 3 not written: No space left on device" in msg
        assert "point trainer.output_dir at a larger disk (the previous checkpoints are intact)" in msg


def test_dev_shm_too_small_falls_back_to_collectives_with_a_line_naming_the_fix(caplog):
    from megappo.parallel.reshard_transport import choose_transport

    with caplog.at_level("WARNING"):
        assert choose_transport("auto", [("h", 1), ("h", 2)], on_cpu=True, slot_bytes=1 << 60) == "collective"
    assert any("shm" in r.message and "--shm-size" in r.message for r in caplog.records), caplog.text
