"""reward.judge.overlap (ppo/judge_overlap.py): the judge starts on the first group before the rollout's last group
has come, the groups that came meanwhile are judged together in one call, and the reward step's scores are the
ones the rule gave then (it is not called again); overlap off: nothing is judged before the reward step. A real
RewardManager and a batched rule that records when it runs (the served judge's scores: test_judge_reward)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from megappo.ppo.judge_overlap import JudgeOverlap
from megappo.protocol import DataProto
from megappo.rewards.manager import RewardManager
from megappo.rewards.rules import Rule
from test_reward_rules import batch


class Recorder:
    """A batched rule: each call's responses in `events` (between the test's own events); the first call waits for
    `release`, so what comes meanwhile is queued behind it."""

    def __init__(self):
        self.events, self.started, self.release = [], threading.Event(), threading.Event()

    def __call__(self, responses, truths, infos):
        self.events.append(("judged", list(responses)))
        self.started.set()
        assert self.release.wait(60), "the test never released the first judgment"
        return [float(t in r) for r, t in zip(responses, truths)]


def group(tokenizer, uid: str, texts: list, truths: list, source: str = "judged") -> DataProto:
    rows = batch(tokenizer, texts, [source] * len(texts), truths)
    rows.non_tensor_batch["uid"] = np.array([uid] * len(texts), dtype=object)
    return rows


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])


def test_judging_starts_before_the_last_group_comes(tokenizer):
    rule = Recorder()
    manager = RewardManager(tokenizer, 0, scorers={"judged": Rule(rule, batched=True)})
    overlap = JudgeOverlap(manager)
    a, b, c = (group(tokenizer, "a", ["5", "4"], ["5", "5"]), group(tokenizer, "b", ["7", "7"], ["7", "1"]),
               group(tokenizer, "c", ["2", "3"], ["3", "3"]))
    overlap.submit(a)
    assert rule.started.wait(60), "group a was not judged before the reward step"
    rule.events.append(("arrived", "b, c"))
    overlap.submit(b)
    overlap.submit(c)
    rule.release.set()
    samples = DataProto.concat([a, b, c])
    timing = overlap.take(samples)
    # a judged before b and c came; b and c, which came while it ran, in one call after it
    assert rule.events == [("judged", ["5", "4"]), ("arrived", "b, c"), ("judged", ["7", "7", "2", "3"])]
    assert set(timing) == {"timing/judge_s", "timing/judge_wait_s", "timing/judge_overlap_frac"}
    assert 0.0 <= timing["timing/judge_overlap_frac"] <= 1.0
    rows = manager.score_rows(samples)  # the reward step: the results taken, the rule not called again
    assert len(rule.events) == 3
    assert [r.rule_score for r in rows] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_overlap_off_judges_in_the_reward_step_and_a_failure_is_raised_there(tokenizer):
    rule = Recorder()
    rule.release.set()
    manager = RewardManager(tokenizer, 0, scorers={"judged": Rule(rule, batched=True)})
    overlap = JudgeOverlap(manager, early=False)
    a = group(tokenizer, "a", ["5", "4"], ["5", "5"])
    overlap.submit(a)
    rule.events.append(("reward step", ""))
    timing = overlap.take(a)
    assert rule.events == [("reward step", ""), ("judged", ["5", "4"])]
    assert timing["timing/judge_overlap_frac"] == 0.0  # all of the judging waited for
    with pytest.raises(ValueError, match="no reward rule for data_source 'unknown'"):
        JudgeOverlap(manager).take(group(tokenizer, "u", ["1"], ["1"], source="unknown"))
