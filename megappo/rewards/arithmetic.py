"""Scorer for the synthetic arithmetic task (megappo.data.preprocess_arithmetic).

Rule: the answer is the integer right after the LAST "####" in the response; if the response has
no "####", the answer is the last integer anywhere in it (so a tiny random model can hit the
right number before it learns the format).
    1.0            the answer equals the ground truth
    format_score   (0.1) a well-formed "#### <int>" with a wrong number
    0.0            otherwise (no integer, or a wrong bare integer)
"""

from __future__ import annotations

import re

_AFTER_HASHES = re.compile(r"^\s*(-?\d+)")
_INTEGER = re.compile(r"-?\d+")


def extract_answer(response: str) -> tuple[int | None, bool]:
    """(answer, well_formed): well_formed means the answer came from "#### <int>"."""
    if "####" in response:
        match = _AFTER_HASHES.match(response.rsplit("####", 1)[1])
        if match:
            return int(match.group(1)), True
        return None, False
    integers = _INTEGER.findall(response)
    return (int(integers[-1]), False) if integers else (None, False)


def compute_score(response: str, ground_truth: str, format_score: float = 0.1) -> float:
    answer, well_formed = extract_answer(response)
    if answer is None:
        return 0.0
    if answer == int(str(ground_truth).strip()):
        return 1.0
    return format_score if well_formed else 0.0
