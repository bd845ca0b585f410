"""ppo/metrics.py on hand-built batches (pure torch, fast): open-instruct names and their definitions,
the vLLM-vs-trainer log-prob gap, and the reward-curve PNG (a resumed run's re-logged steps: last wins)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megappo.ppo.metrics import OPEN_INSTRUCT_KEYS, data_metrics, eval_metrics, rollout_parity_metrics, step_metrics
from megappo.protocol import DataProto


def _batch():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    old = torch.tensor([[-1.0, -0.5, -0.2, 0.0], [-2.0, -0.1, 0.0, 0.0], [-0.3, -0.3, -0.3, -0.3]])
    return DataProto.from_dict({
        "responses": torch.ones(3, 4, dtype=torch.long), "response_mask": mask,
        "attention_mask": torch.cat([torch.ones(3, 5, dtype=torch.long), mask], 1),
        "stopped": torch.tensor([True, True, False]),
        "entropy": torch.tensor([[1.0, 2.0, 3.0, 9.0], [0.5, 0.5, 9.0, 9.0], [1.0, 1.0, 1.0, 1.0]]),
        "old_log_probs": old, "rollout_log_probs": old + 0.01 * mask,
        "advantages": torch.randn(3, 4), "returns": torch.randn(3, 4), "values": torch.randn(3, 4),
    })


def test_step_metrics_names_and_definitions():
    b = _batch()
    reward = {"objective/scores": 0.4, "objective/verifiable_correct_rate": 0.25, "reward/stop_rate": 2 / 3}
    kl = {"objective/kl": 2.0, "objective/kl_coef": 0.1, "objective/non_score_reward": -0.2}
    actor = {"actor/pg_loss": 0.3, "actor/approx_kl": 0.01, "actor/ppo_kl": 0.02, "actor/pg_clipfrac": 0.05,
             "actor/lr": 1e-4}
    critic = {"critic/vf_loss": 0.7}
    m = step_metrics(step=3, batch=b, reward_metrics=reward, kl=kl, actor=actor, critic=critic, prompts_per_step=8,
                     responses_per_step=32, dataset_size=64, step_s=1.5, since_start_s=10.0)
    assert not [k for k in OPEN_INSTRUCT_KEYS if k not in m]
    assert m["episode"] == 96 and m["epoch"] == pytest.approx(24 / 64) and m["lr"] == 1e-4
    assert m["objective/rlhf_reward"] == pytest.approx(0.2)
    assert m["objective/loss"] == pytest.approx(1.0) and m["loss/policy_avg"] == 0.3 and m["loss/value_avg"] == 0.7
    assert m["policy/approxkl_avg"] == 0.01 and m["policy/clipfrac_avg"] == 0.05
    # entropy: per-sequence sum over response tokens, then mean (padding ignored); token mean for policy/
    assert m["objective/entropy"] == pytest.approx((6.0 + 1.0 + 4.0) / 3)
    assert m["policy/entropy_avg"] == pytest.approx(11.0 / 9)
    assert m["val/sequence_lengths"] == pytest.approx(3.0) and m["val/num_stop_token_ids"] == 2
    assert m["time/training"] == 1.5 and m["time/from_scratch"] == 10.0
    # no KL in the reward: the reward is the score
    m2 = step_metrics(step=1, batch=b, reward_metrics=reward, kl={}, actor=actor, critic={}, prompts_per_step=8,
                      responses_per_step=32, dataset_size=64, step_s=1.0, since_start_s=1.0)
    assert m2["objective/rlhf_reward"] == 0.4 and m2["objective/kl"] == 0.0
    assert "loss/value_avg" not in m2 and m2["objective/loss"] == 0.3  # no critic, no value loss


def test_parity_and_data_metrics():
    b = _batch()
    p = rollout_parity_metrics(b)
    assert p["rollout/logprob_diff_max"] == pytest.approx(0.01, abs=1e-6)
    assert p["rollout/logprob_diff_mean"] == pytest.approx(0.01, abs=1e-6)
    assert p["rollout/token_mult_prob_error"] == pytest.approx(math.exp(0.01), abs=1e-6)
    assert p["rollout/tis_weight_mean"] == pytest.approx(math.exp(-0.01), abs=1e-6)
    assert rollout_parity_metrics(b.select(batch_keys=["response_mask", "old_log_probs"])) == {}
    d = data_metrics(b)
    assert d["response_length/max"] == 4 and d["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert d["prompt_length/mean"] == 5
    e = eval_metrics(b, {"objective/scores": 0.5, "objective/verifiable_correct_rate": 0.5})
    assert e["eval/num_prompts"] == 3 and e["eval/sequence_lengths"] == pytest.approx(3.0)


def test_reward_curve_png(tmp_path):
    from megappo.ppo.reward_curve import plot_reward_curve

    assert plot_reward_curve(tmp_path) is None
    rows = [{"step": s, "objective/scores": 0.1 * s, "objective/verifiable_correct_rate": 0.05 * s} for s in (1, 2, 3)]
    rows += [{"step": 3, "objective/scores": 0.9, "objective/verifiable_correct_rate": 0.5,
              "eval/verifiable_correct_rate": 0.4}]  # a resumed run re-logs step 3
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_reward_curve(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    # what is drawn: one point per step, the re-logged step 3 with its last row
    from megappo.ppo.reward_curve import reward_curve_series

    series = reward_curve_series(rows)
    assert series["objective/scores"] == ([1, 2, 3], [0.1, 0.2, 0.9])
    assert series["objective/verifiable_correct_rate"] == ([1, 2, 3], [0.05, 0.1, 0.5])
    assert series["eval/verifiable_correct_rate"] == ([3], [0.4])


def test_compare_runs_png(tmp_path):
    """tools/compare_runs.py: two runs' curves on one PNG; a run without metrics or an unknown metric is one
    line naming the fix."""
    from tools.compare_runs import main

    for name, scale in (("a", 0.1), ("b", 0.2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "objective/scores": scale * s}) + "\n" for s in (1, 2, 3)))
    out = tmp_path / "cmp.png"
    main([f"{tmp_path / 'a'}:first", str(tmp_path / "b"), "--out", str(out), "--keys", "objective/scores"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 2000
    with pytest.raises(SystemExit, match="choose from objective/scores"):
        main([str(tmp_path / "a"), "--out", str(out), "--keys", "eval/x"])
    with pytest.raises(SystemExit, match="give a run's output_dir"):
        main([str(tmp_path / "missing"), "--out", str(out)])
    with pytest.raises(SystemExit, match="none of the runs logged eval/verifiable_correct_rate"):
        main([str(tmp_path / "a"), "--out", str(out), "--keys", "eval/verifiable_correct_rate"])
