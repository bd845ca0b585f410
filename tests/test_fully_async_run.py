"""trainer.mode=fully_async (#39, ppo/fully_async.py): the rollout pool generates continuously, weights reach
it while groups are in flight, admission keeps every trained sample within trainer.max_staleness. Real Ray,
real vLLM (one rollout worker), real megatron on the trainer tests' tiny config."""

from __future__ import annotations

import math

import pytest

from megappo.config.loader import ConfigError
from trainer_utils import config as _config, run as _run

FULLY_ASYNC = ["trainer.mode=fully_async", "resources.rollout_workers=1", "trainer.save_every=0",
               "trainer.export_hf=false"]


@pytest.mark.parametrize("overrides, expected", [
    (["trainer.max_staleness=-1"], "trainer.max_staleness=-1 must be >= 0"),
    (["trainer.save_every=2"], "set trainer.save_every=0"),
    (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups"),
    (["resources.rollout_workers=2", "rollout.tp=2"], "set rollout.tp=1"),
])
def test_what_fully_async_does_not_do_yet_is_one_line(tiny_assets, data_dir, tmp_path, overrides, expected):
    with pytest.raises(ConfigError, match=expected) as e:
        _config(tiny_assets, data_dir, tmp_path, *FULLY_ASYNC, *overrides)
    assert "\n" not in str(e.value)


def test_max_staleness_0_trains_the_sync_runs_batches(sync_baseline, tiny_assets, data_dir, tmp_path):
    """One batch admitted at a time, each group seeded as the sync run seeds it, trained on-policy: the
    sync baseline's first two steps (same prompts, same samples, same losses) within fp32 rounding; the
    weights reach the rollout worker over the sync group (fingerprint-checked), not the hybrid engine."""
    history = _run(_config(tiny_assets, data_dir, tmp_path / "fa0", *FULLY_ASYNC, "trainer.max_staleness=0",
                           "trainer.total_steps=2"))
    base = sync_baseline[0]
    for got, want in zip(history, base[:2]):
        assert got["async/sample_staleness_max"] == 0 and got["async/over_bound"] == 0
        assert got["rollout/weights_fingerprint_ok"] == 1.0
        assert got["objective/scores"] == pytest.approx(want["objective/scores"], abs=1e-6)  # the same samples
        for key in ("response_length/mean", "loss/policy_avg", "loss/value_avg", "objective/kl",
                    "policy/clipfrac_avg", "rollout/logprob_diff_max"):
            assert math.isclose(got[key], want[key], rel_tol=1e-3, abs_tol=1e-4), (key, got[key], want[key])
    assert history[1]["eval/verifiable_correct_rate"] == pytest.approx(base[1]["eval/verifiable_correct_rate"])


def test_stale_groups_stay_within_the_bound(ray_session, tiny_assets, data_dir, tmp_path):
    """max_staleness=1: two batches' groups start at version 0, so step 2 trains groups one version behind
    (the decoupled loss corrects them per token); no trained sample is ever more than 1 behind."""
    history = _run(_config(tiny_assets, data_dir, tmp_path / "fa1", *FULLY_ASYNC, "trainer.max_staleness=1",
                           "trainer.total_steps=3", "trainer.val_every=0", "actor.policy_loss=decoupled"))
    for h in history:
        print({k: round(v, 4) for k, v in h.items() if k.startswith("async/") or k in (
            "timing/rollout_wait_s", "timing/weight_sync_s", "timing/step_s")})
    assert [h["async/policy_version"] for h in history] == [0.0, 1.0, 2.0]
    assert history[0]["async/sample_staleness_max"] == 0
    assert history[1]["async/sample_staleness_max"] == 1  # admitted with step 1's groups, before any update
    for h in history:
        assert h["async/over_bound"] == 0 and h["async/sample_staleness_max"] <= 1
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and h["rollout/weight_sync_bytes_received"] > 1e6
        assert math.isfinite(h["loss/policy_avg"])
    # the stale step's pi_old (proximal: the updated actor) differs from the sampler's log-probs
    assert history[1]["rollout/logprob_diff_max"] > 1e-3
