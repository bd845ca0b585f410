"""GSM8K scorer: the answer is the number after the LAST "#### " in the response (strict format).

Commas are removed ("1,000" == "1000"); numbers compare by value ("7.0" == "7").
score = 1.0 if it equals the ground truth, `format_score` if a "#### <number>" exists but is
wrong, else 0.0."""

from __future__ import annotations

import re

_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def extract_solution(response: str) -> str | None:
    """The number after the last "####" (commas removed), or None."""
    matches = _ANSWER.findall(response)
    return matches[-1].replace(",", "") if matches else None


def _same_number(a: str, b: str) -> bool:
    a, b = a.replace(",", "").strip(), b.replace(",", "").strip()
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def compute_score(response: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    answer = extract_solution(response)
    if answer is None:
        return 0.0
    return score if _same_number(answer, str(ground_truth)) else format_score
