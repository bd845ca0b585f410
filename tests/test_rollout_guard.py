"""The rollout guard's measure (ppo/rollout_guard.py), on batches whose every number is known: which tokens count,
the bound per dtype, and the one line it stops with. The guard in a real run: test_trainer."""

from __future__ import annotations

import pytest
import torch

from megappo.ppo.rollout_guard import BOUNDS, RolloutGapError, RolloutGuard, on_policy_gap, run_dtype
from megappo.protocol import DataProto


def _batch(old, rollout, mask, versions=None):
    b = {"old_log_probs": torch.tensor(old), "rollout_log_probs": torch.tensor(rollout),
         "response_mask": torch.tensor(mask)}
    if versions is not None:
        b["token_versions"] = torch.tensor(versions)
    return DataProto.from_dict(b)


def test_only_samples_the_current_weights_sampled_whole_count():
    """fully_async: a sample begun at version 2 and finished at 3 (keep: its later tokens attend to the old weights'
    cache) counts for nothing at version 3, even its version-3 tokens; a sample all of version 3 counts; padding never."""
    old = [[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]]
    rollout = [[-1.5, -1.0, -4.0], [-2.25, -1.75, 9.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    versions = [[2, 3, 3], [3, 3, -1]]
    assert on_policy_gap(_batch(old, rollout, mask, versions), 3) == pytest.approx(0.25)  # (0.25 + 0.25) / 2
    assert on_policy_gap(_batch(old, rollout, mask, [[2, 2, 2], [2, 2, -1]]), 3) is None  # nothing of version 3
    assert on_policy_gap(_batch(old, rollout, mask), 0) == pytest.approx((0.5 + 0 + 3 + 0.25 + 0.25) / 5)  # sync


def test_the_bound_is_the_dtypes_and_a_gap_past_it_is_one_line():
    class Cfg:
        class model:
            dtype = "auto"

        class trainer:
            rollout_check, rollout_check_steps, rollout_check_every, rollout_logprob_bound = "stop", 2, 0, None

    assert run_dtype("auto", on_gpu=True) == "bf16" and run_dtype("auto", on_gpu=False) == "fp32"
    guard = RolloutGuard.from_config(Cfg, on_gpu=True)
    assert guard.bound == BOUNDS["bf16"]
    assert guard.check(1, 0.5 * BOUNDS["bf16"]) == {}
    with pytest.raises(RolloutGapError) as e:
        guard.check(2, 2 * BOUNDS["bf16"])
    assert "\n" not in str(e.value) and str(e.value).startswith("step 2: rollout/logprob_diff_mean=0.5 ")
    assert guard.check(3, 10.0) == {} and guard.steps_checked == [1, 2]  # past its first steps, every=0: no check


def test_the_updates_gap_counts_only_when_the_current_weights_sampled_the_whole_batch():
    """Without a pi_old forward the update measures the gap on its first mini-batch, whichever samples it holds:
    it is the guard's only when every sample of the batch is the current version's."""
    from megappo.ppo.rollout_guard import update_gap

    lp, mask = [[-1.0, -1.0]], [[1, 1]]
    metrics = {"rollout/logprob_diff_mean": torch.tensor(0.125)}
    assert update_gap(_batch(lp, lp, mask, [[3, 3]]), 3, metrics) == 0.125
    assert update_gap(_batch(lp, lp, mask, [[2, 3]]), 3, metrics) is None
    assert update_gap(_batch(lp, lp, mask), 0, {}) is None
