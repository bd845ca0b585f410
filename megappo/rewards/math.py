"""MATH scorer with math-verify: 1.0 if the response's answer is equivalent to the ground truth.

The gold answer is wrapped in \\boxed{} (unless it already has one) so math-verify parses it as a
final answer; equivalent forms match ("\\frac{1}{2}" == "0.5"). Timeouts are off
(parsing_timeout=None, timeout_seconds=None): math-verify's timeouts use signal.alarm, which only
works in the main thread, and the reward manager may run in a worker / Ray thread."""

from __future__ import annotations

from math_verify import parse, verify


def compute_score(response: str, ground_truth: str) -> float:
    gt = str(ground_truth)
    gold = parse(gt if "\\boxed" in gt else "\\boxed{" + gt + "}", parsing_timeout=None)
    answer = parse(response, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0
