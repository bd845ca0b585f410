"""`<output_dir>/reward_curve.png`, redrawn after every step from metrics.jsonl: what a person would rather
see than read (scores, accuracy, eval, tool-call rates, and the base model's eval accuracy as a line)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

CURVE_KEYS = (("objective/scores", "-"), ("objective/verifiable_correct_rate", "--"),
              ("eval/verifiable_correct_rate", "o-"), ("rollout/tool_call_rate", ":"), ("eval/tool_call_rate", "s-"))


def reward_curve_series(rows: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{key: (steps, values)} of the curve's lines; a step logged twice (a resumed or restarted run redoes
    steps) is drawn with its last row."""
    by_step = {int(r["step"]): r for r in rows}
    steps = sorted(s for s in by_step if "objective/scores" in by_step[s])
    out = {}
    for key, _ in CURVE_KEYS:
        xs = [s for s in steps if key in by_step[s]]
        if xs:
            out[key] = (xs, [by_step[s][key] for s in xs])
    return out


def plot_reward_curve(output_dir) -> Optional[Path]:
    """`<output_dir>/reward_curve.png`: objective/scores and verifiable_correct_rate per step, eval accuracy,
    the tool-call rates of a multi-turn run (rollouts, greedy eval), and the base model's eval accuracy as a line when `<output_dir>/base_eval.json` holds it."""
    from megappo.utils.tracking import read_metrics

    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = reward_curve_series(read_metrics(path))
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in CURVE_KEYS:
        if key in series:
            ax.plot(*series[key], style, label=key)
    base = Path(output_dir) / "base_eval.json"  # `megappo eval` of the starting model (make smollm2 writes it)
    if base.is_file() and "eval/verifiable_correct_rate" in json.loads(base.read_text()):
        ax.axhline(json.loads(base.read_text())["eval/verifiable_correct_rate"], color="gray", linestyle=":",
                   label="base model eval accuracy")
    ax.set_xlabel("step")
    ax.set_title("reward curve")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(output_dir) / "reward_curve.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
