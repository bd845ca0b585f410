"""Rule scorers and the RewardManager (real tiny tokenizer, real math-verify)."""

import threading

import numpy as np
import pytest
import torch

from megappo.protocol import DataProto
from megappo.rewards import RewardManager, arithmetic, gsm8k
from megappo.rewards import math as math_scorer


# ----------------------------------------------------------------------------- scorers
@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("She pays 3 * 4 = 12 dollars. #### 12", "12", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("first #### 5 then corrected #### 7.", "7", 1.0),  # the last #### counts, trailing dot ignored
        ("first #### 7 then #### 5", "7", 0.0),
        ("The answer is 12", "12", 0.0),  # strict: no ####
        ("#### -3", "-3", 1.0),
        ("#### 12", "13", 0.0),
    ],
)
def test_gsm8k_strict(response, truth, expected):
    assert gsm8k.compute_score(response, truth) == expected


def test_gsm8k_format_score():
    assert gsm8k.compute_score("#### 12", "13", format_score=0.1) == 0.1
    assert gsm8k.compute_score("12", "13", format_score=0.1) == 0.0
    assert gsm8k.extract_solution("a #### 1,234 b") == "1234"


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("The answer is $\\frac{1}{2}$.", "0.5", 1.0),
        ("so the result is 0.5", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("\\boxed{3}", "\\frac{1}{2}", 0.0),
        ("I do not know", "2", 0.0),
    ],
)
def test_math_verify_equivalent_forms(response, truth, expected):
    assert math_scorer.compute_score(response, truth) == expected


def test_math_scorer_works_outside_main_thread():
    results, errors = [], []

    def work():
        try:
            results.append(math_scorer.compute_score("$\\frac{3}{4}$", "0.75"))
            results.append(math_scorer.compute_score("$\\frac{3}{5}$", "0.75"))
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=60)
    assert not errors and results == [1.0, 0.0]


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("The answer is 7. #### 7", "7", 1.0),
        ("#### 7", "7", 1.0),
        ("#### 8", "7", 0.1),  # well-formed but wrong: format score
        ("#### 7 no wait #### 9", "7", 0.1),  # the last #### counts
        ("#### seven", "7", 0.0),
        ("3 + 4 is 7", "7", 1.0),  # no ####: the last integer counts
        ("7 or maybe 8", "7", 0.0),
        ("no number", "7", 0.0),
        ("#### -2", "-2", 1.0),
    ],
)
def test_arithmetic_scorer(response, truth, expected):
    assert arithmetic.compute_score(response, truth) == pytest.approx(expected)


# ----------------------------------------------------------------------------- manager
@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])


def make_batch(tokenizer, texts, sources, truths, resp_len=24, stop=None, extra=None):
    """Right-padded responses; eos appended when `stop[i]` (default True)."""
    stop = stop if stop is not None else [True] * len(texts)
    rows, masks = [], []
    for text, s in zip(texts, stop):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if s else [])
        assert len(ids) <= resp_len
        pad = resp_len - len(ids)
        rows.append(ids + [tokenizer.pad_token_id] * pad)
        masks.append([1] * len(ids) + [0] * pad)
    tensors = {"responses": torch.tensor(rows), "response_mask": torch.tensor(masks)}
    tensors.update(extra or {})
    return DataProto.from_dict(
        tensors,
        {"data_source": np.array(sources, dtype=object),
         "reward_model": [{"ground_truth": t, "style": "rule"} for t in truths]},
    )


def test_manager_places_scores_on_last_valid_token(tokenizer, capsys):
    data = make_batch(tokenizer, ["#### 7", "The answer is 12. #### 12", "#### 3"],
                      ["arithmetic", "openai/gsm8k", "arithmetic"], ["7", "12", "4"])
    mgr = RewardManager(tokenizer, num_examine=1)
    scores, metrics = mgr(data)
    lengths = data.batch["response_mask"].sum(-1)
    expected = torch.zeros_like(scores)
    for i, value in enumerate([1.0, 1.0, 0.1]):
        expected[i, lengths[i] - 1] = value
    assert torch.allclose(scores, expected)
    assert metrics["objective/verifiable_correct_rate"] == pytest.approx(2 / 3)  # format-only is not correct
    assert metrics["objective/scores"] == pytest.approx(2.1 / 3)
    assert metrics["reward/num_non_stop_penalised"] == 0
    assert metrics["reward/arithmetic/correct_rate"] == pytest.approx(0.5)
    out = capsys.readouterr().out
    assert out.count("[reward:arithmetic]") == 1 and out.count("[reward:openai/gsm8k]") == 1  # num_examine per source


def test_manager_non_stop_penalty_detected_from_eos_or_flag(tokenizer):
    data = make_batch(tokenizer, ["#### 7", "#### 7"], ["arithmetic"] * 2, ["7", "7"], stop=[True, False])
    scores, metrics = RewardManager(tokenizer, num_examine=0, non_stop_penalty_value=-10.0)(data)
    assert scores.sum(-1).tolist() == [1.0, -10.0]
    assert metrics["reward/num_non_stop_penalised"] == 1 and metrics["reward/stop_rate"] == 0.5
    assert metrics["objective/verifiable_correct_rate"] == 1.0  # still verifiably correct
    # an explicit `stopped` flag wins over eos detection
    flagged = make_batch(tokenizer, ["#### 7", "#### 7"], ["arithmetic"] * 2, ["7", "7"],
                         stop=[True, False], extra={"stopped": torch.tensor([False, True])})
    scores, _ = RewardManager(tokenizer, num_examine=0)(flagged)
    assert scores.sum(-1).tolist() == [-10.0, 1.0]
    off, _ = RewardManager(tokenizer, num_examine=0, non_stop_penalty=False)(data)
    assert off.sum(-1).tolist() == [1.0, 1.0]


def test_manager_adds_rm_scores_and_uses_attention_mask_fallback(tokenizer):
    data = make_batch(tokenizer, ["#### 7", "#### 2"], ["arithmetic"] * 2, ["7", "7"],
                      extra={"rm_scores": torch.tensor([0.5, -0.25])})
    mask = data.batch.pop("response_mask")
    data.batch["attention_mask"] = torch.cat([torch.ones(2, 5, dtype=mask.dtype), mask], dim=1)
    scores, _ = RewardManager(tokenizer, num_examine=0)(data)
    assert scores.sum(-1).tolist() == pytest.approx([1.5, -0.15])
    assert scores[0, mask[0].sum() - 1] == pytest.approx(1.5)


def test_manager_unknown_source_and_custom_scorer(tokenizer):
    data = make_batch(tokenizer, ["hello"], ["my_task"], ["x"])
    with pytest.raises(ValueError, match=r"my_task.*known: .*arithmetic.*scorers="):
        RewardManager(tokenizer, num_examine=0)(data)
    mgr = RewardManager(tokenizer, num_examine=0, scorers={"my_task": lambda r, gt, extra_info: 0.25 * len(r)})
    scores, _ = mgr(data)
    assert scores.sum().item() == pytest.approx(0.25 * len("hello"))


def test_manager_math_source_in_thread(tokenizer):
    data = make_batch(tokenizer, ["so x = 0.5"], ["lighteval/MATH"], ["\\frac{1}{2}"])
    out = []
    t = threading.Thread(target=lambda: out.append(RewardManager(tokenizer, num_examine=0)(data)))
    t.start()
    t.join(timeout=60)
    assert out and out[0][1]["objective/verifiable_correct_rate"] == 1.0


def test_rule_results_kept_by_a_first_scoring_are_reused_not_recomputed(tokenizer):
    """DAPO's filter scores the rows, keeps a selection, and the reward phase scores that selection: the rule
    (which may be a costly judge) runs once per response, and the kept rows score as a fresh scoring would."""
    calls = []

    def judge(response, truth, extra_info):
        calls.append(response)
        return float(response.strip() == str(truth))

    texts, truths = ["4", "5", "7", "9"], ["4", "4", "7", "8"]
    data = make_batch(tokenizer, texts, ["my_task"] * 4, truths)
    mgr = RewardManager(tokenizer, num_examine=0, scorers={"my_task": judge})
    first = mgr.score_rows(data, keep=True)
    assert len(calls) == 4
    chosen = data[[2, 0]]
    scores, _ = mgr(chosen)
    assert len(calls) == 4  # not called again
    fresh, _ = RewardManager(tokenizer, num_examine=0, scorers={"my_task": judge})(make_batch(
        tokenizer, ["7", "4"], ["my_task"] * 2, ["7", "4"]))
    assert torch.equal(scores, fresh) and [first[2].final, first[0].final] == [1.0, 1.0]
    assert "rule_scores" not in chosen.non_tensor_batch  # used once: a later scoring computes afresh
    before = len(calls)
    mgr(chosen)
    assert len(calls) == before + 2


def test_manager_places_a_multi_turn_score_on_the_last_model_token(tokenizer):
    """A multi-turn response (model tokens, a tool result masked out, model tokens) is scored at its last model
    token, not at (model tokens - 1), which would fall in the tool result, where GAE's rewards * mask drops it."""
    data = make_batch(tokenizer, ["#### 7"], ["arithmetic"], ["7"], extra={"rm_scores": torch.tensor([2.0])})
    n = int(data.batch["response_mask"][0].sum())
    mask = torch.zeros_like(data.batch["response_mask"])
    mask[0, :2] = 1  # the model's call ...
    mask[0, 6:6 + n - 2] = 1  # ... a tool result in 2..5, then the model's answer
    data.batch["response_mask"] = mask
    scores, _ = RewardManager(tokenizer, num_examine=0, non_stop_penalty=False)(data)
    last = int(torch.nonzero(mask[0]).max())
    assert last > n - 1 and scores[0, last] == scores.sum() != 0
