"""On-policy distillation against GRPO at equal samples (make smollm2-opd): each run's held-out accuracy per
step (the in-run eval, eval/verifiable_correct_rate), the teacher's, and the issue's goal: pure OPD reaches 90% of
the teacher's held-out accuracy in at most a quarter of the samples GRPO needed to get there. Prints one JSON
object.

    python bench/opd_smollm2.py --config configs/grpo_smollm2_135m.yaml --teacher outputs/grpo_smollm2_135m \
        --runs opd=outputs/opd_smollm2_135m grpo_opd=outputs/grpo_opd_smollm2_135m
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run: Path) -> list[tuple[int, float]]:
    from megappo.utils.tracking import read_metrics

    rows = {int(r["step"]): r for r in read_metrics(run / "metrics.jsonl")}
    return [(s, float(rows[s]["eval/verifiable_correct_rate"])) for s in sorted(rows)
            if "eval/verifiable_correct_rate" in rows[s]]


def first_reaching(points: list[tuple[int, float]], level: float):
    return next((s for s, acc in points if acc >= level), None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the GRPO recipe (its batch: the samples per step of every run)")
    p.add_argument("--teacher", required=True, help="the GRPO run the teacher came from (its curve is GRPO alone)")
    p.add_argument("--runs", nargs="+", required=True, help="NAME=OUTPUT_DIR of the distillation runs")
    p.add_argument("--share", type=float, default=0.9, help="the share of the teacher's accuracy to reach")
    args = p.parse_args(argv)
    from megappo.config import load_config

    teacher = Path(args.teacher)
    grpo = curve(teacher)
    teacher_acc = grpo[-1][1]  # the trained policy's in-run eval at its last step: what the teacher scores
    level = args.share * teacher_acc
    cfg = load_config(args.config, [], validate=False)
    per_step = int(cfg.data.train_batch_size * cfg.rollout.n)
    grpo_step = first_reaching(grpo, level)
    out = {"teacher_eval_accuracy": teacher_acc, "level": round(level, 4), "samples_per_step": per_step,
           "runs": {"grpo": {"curve": grpo, "first_step_at_level": grpo_step}}}
    for spec in args.runs:
        name, _, path = spec.partition("=")
        points = curve(Path(path))
        step = first_reaching(points, level)
        out["runs"][name] = {"curve": points, "first_step_at_level": step,
                             "samples_vs_grpo": None if step is None or grpo_step is None else round(step / grpo_step, 3)}
    opd = out["runs"].get("opd", {})
    out["goal_met"] = opd.get("samples_vs_grpo") is not None and opd["samples_vs_grpo"] <= 0.25
    print(json.dumps(out))


if __name__ == "__main__":
    main()
