"""ppo/segments.py: a rewritten history's later segments as rows of their own. Pure (no Ray, no vLLM): how
their scores, advantages and update layout follow their samples. The PPO run that trains them through the
gateway is tests/test_agent.py's test_ppo_run_trains_a_rewritten_history_as_rows_of_its_own."""

import numpy as np
import pytest
import torch

from megappo.ppo import core_algos as algos
from megappo.ppo.segments import Segments
from megappo.protocol import DataProto


def batch_with_later_rows():
    """2 prompts x 2 samples (rows 0-3), then later segments of samples 1, 1 and 2 (rows 4-6)."""
    sessions = ["a:0", "a:1", "b:0", "b:1", "a:1", "a:1", "b:0"]
    segment = torch.tensor([0, 0, 0, 0, 1, 2, 1], dtype=torch.float32)
    mask = torch.zeros(7, 5, dtype=torch.long)
    for i, n in enumerate([3, 5, 2, 4, 1, 2, 5]):
        mask[i, :n] = 1
    return DataProto({"agent_segment": segment, "response_mask": mask,
                      "attention_mask": torch.cat([torch.ones(7, 2, dtype=torch.long), mask], 1)},
                     {"agent_session": np.array(sessions, dtype=object),
                      "uid": np.array([s.split(":")[0] for s in sessions], dtype=object)}, {})


def test_later_rows_find_their_samples():
    seg = Segments.of(batch_with_later_rows())
    assert seg.primary == [0, 1, 2, 3] and seg.owner == [0, 1, 2, 3, 1, 1, 2] and seg.later == 3
    plain = batch_with_later_rows()[[0, 1, 2, 3]]
    assert Segments.of(plain) is None  # no later row: every step runs as before
    with pytest.raises(ValueError, match="keep a sample's rows together"):
        Segments.of(batch_with_later_rows()[[0, 2, 3, 4]])


def test_a_later_row_ends_in_its_samples_score_and_gets_its_advantage():
    b = batch_with_later_rows()
    seg = Segments.of(b)
    mask = b.batch["response_mask"]
    primary_scores = torch.zeros(4, 5)
    for i, (n, s) in enumerate(zip([3, 5, 2, 4], [1.0, 0.0, 0.5, 1.5])):
        primary_scores[i, n - 1] = s
    scores = seg.scores(primary_scores, mask)
    assert torch.equal(scores[:4], primary_scores)
    assert scores[4, 0] == 0.0 and scores[5, 1] == 0.0 and scores[6, 4] == 0.5  # at each later row's last token
    assert scores.sum(-1).tolist() == [1.0, 0.0, 0.5, 1.5, 0.0, 0.0, 0.5]

    class A:
        adv_estimator, norm_adv_by_std_in_grpo = "grpo", True

    adv_p, _ = algos.compute_advantages(scores[:4], mask[:4], A, index=b.non_tensor_batch["uid"][:4])
    adv = seg.spread(adv_p, mask[:4], mask)
    assert torch.allclose(adv[:4], adv_p)  # the groups' statistics count samples only
    for i, j in enumerate(seg.owner):
        value = adv_p[j][mask[j].bool()][0]
        assert torch.allclose(adv[i][mask[i].bool()], value.expand(int(mask[i].sum())))
        assert (adv[i][~mask[i].bool()] == 0).all()
    assert "grpo" not in algos.TOKEN_LEVEL_ESTIMATORS and "gae" in algos.TOKEN_LEVEL_ESTIMATORS


def test_without_later_rows_the_update_order_is_the_batch_order():
    seg = Segments(list(range(8)), list(range(8)))
    assert seg.update_order(4, 2) == (list(range(8)), 4)
    assert seg.update_order(8, 1) == (list(range(8)), 8)


def test_later_rows_join_their_samples_mini_batch_and_rank():
    """8 samples, mini-batches of 4 over dp=2: rank 0 holds samples 0-3 (mini-batch 0: 0, 1; 1: 2, 3), rank 1
    samples 4-7. Later rows 8, 9 (sample 1) and 10 (sample 6) join their samples; every rank's share of every
    mini-batch is filled to 4 rows (-1: a masked copy)."""
    seg = Segments(list(range(8)), list(range(8)) + [1, 1, 6])
    order, rows = seg.update_order(4, 2)
    assert rows == 8
    assert order == [0, 1, 8, 9, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7, 10, -1]
    # as the workers read it: dp contiguous shards, each cut into local mini-batches of rows / dp
    shards = [order[d * len(order) // 2:(d + 1) * len(order) // 2] for d in range(2)]
    minis = [sum((s[k * 4:(k + 1) * 4] for s in shards), []) for k in range(2)]
    where = {r: k for k, m in enumerate(minis) for r in m if r >= 0}
    assert all(where[i] == where[j] for i, j in enumerate(seg.owner))
    assert seg.update_order(4, 2, multiple=3)[1] == 12  # each share a multiple of the micro-batch size
    with pytest.raises(ValueError, match="do not split"):
        seg.update_order(3, 1)


def test_update_batch_fills_with_masked_copies():
    b = batch_with_later_rows()
    seg = Segments.of(b)
    out = seg.update_batch(b.select(batch_keys=["response_mask", "attention_mask"]), 2, 2, 1)
    order, rows = seg.update_order(2, 2)
    assert out.meta_info["mini_batch_rows"] == rows and len(out) == len(order)
    for r, i in enumerate(order):
        if i >= 0:
            assert torch.equal(out.batch["response_mask"][r], b.batch["response_mask"][i])
        else:  # a copy of the shortest row, nothing trained on it
            assert out.batch["response_mask"][r].sum() == 0
            assert torch.equal(out.batch["attention_mask"][r, :2], b.batch["attention_mask"][4, :2])
    assert out.batch["response_mask"].sum() == b.batch["response_mask"].sum()  # every real token once


def test_a_later_rows_kl_penalty_reaches_its_samples_outcome():
    """use_kl_in_reward: a later row's penalty (rewards - its copy of the score) is added to its sample's row at
    the sample's last model token, so an outcome estimator counts every segment's penalty once."""
    b = batch_with_later_rows()
    seg = Segments.of(b)
    mask = b.batch["response_mask"]
    scores = torch.zeros(7, 5)
    scores[:, 0] = 1.0
    rewards = scores - 0.1 * mask  # a KL penalty of 0.1 per model token
    out = seg.sample_rewards(rewards, scores, mask)
    lengths = mask.sum(-1)
    # sample 1 has later rows 4 and 5 (1 and 2 model tokens), sample 2 has row 6 (5 tokens)
    assert torch.allclose(out.sum(-1), rewards[:4].sum(-1) - 0.1 * torch.tensor([0.0, 3.0, 5.0, 0.0]))
    assert float(out[1, lengths[1] - 1]) == pytest.approx(float(rewards[1, lengths[1] - 1]) - 0.3)


def test_dapo_judges_a_group_by_its_samples_not_its_later_rows():
    """algorithm.filter_groups: sample a:1's later rows (4, 5) were cut short (a non-stop penalty in their
    final score); judged as rows, group a looks varied, judged by its samples it is flat. Only the samples'
    rows are scored (a rule runs once per sample), and their kept rule results land on those rows."""
    from megappo.ppo.dynamic_sampling import judge_groups
    from megappo.rewards.manager import RULE_SCORES, RowScore

    final = [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0]
    calls = []

    def score_rows(part):  # what RewardManager.score_rows(keep=True) does, by the rows' lengths
        rows = [int(n) for n in part.batch["response_mask"].sum(-1)]
        calls.append(rows)
        by_len = {3: 0, 5: 1, 2: 2, 4: 3}  # batch_with_later_rows' sample rows have these lengths
        out = [RowScore("s", final[by_len[n]], final[by_len[n]], final[by_len[n]] == 1.0, True, n, None) for n in rows]
        part.non_tensor_batch[RULE_SCORES] = np.array([f"rule{n}" for n in rows], dtype=object)
        return out

    part = batch_with_later_rows()
    uids = list(part.non_tensor_batch["uid"])
    assert algos.groups_to_keep(uids, [f == 1.0 for f in final], final, "score")[0] == ["a", "b"]  # rows: wrong
    for metric in ("score", "acc"):
        part = batch_with_later_rows()
        assert judge_groups(part, score_rows, metric) == (["b"], ["a"]), metric
        assert calls[-1] == [3, 5, 2, 4]  # the samples' rows only
        assert list(part.non_tensor_batch[RULE_SCORES]) == ["rule3", "rule5", "rule2", "rule4", None, None, None]
    plain = batch_with_later_rows()[[0, 1, 2, 3]]  # without later rows: every row is a sample
    assert judge_groups(plain, score_rows, "score") == (["b"], ["a"])
