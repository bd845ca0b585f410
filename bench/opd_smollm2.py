"""On-policy distillation against GRPO at equal samples (make smollm2-opd): each run's held-out accuracy per
step (the in-run eval, eval/verifiable_correct_rate), the teacher's, and the issue's goal: pure OPD reaches 90% of
the teacher's held-out accuracy in at most a quarter of the samples GRPO needed to get there. GRPO is the teacher's
own run (the recipe) and any other GRPO run given (e.g. at OPD's learning rate): the goal is judged against each, for
every pure-OPD run and in the headline for the recipe's run ("opd") and its reseeds ("opd_seed2", ...).
Every run's learning rate, seed and estimator come from its config.json. Prints one JSON object.

    python bench/opd_smollm2.py --config configs/grpo_smollm2_135m.yaml --teacher outputs/grpo_smollm2_135m \
        --grpo grpo_lr1e5=outputs/grpo_lr1e5_smollm2_135m \
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


def described(run: Path, level: float) -> dict:
    """A run's curve, the first evaluated step at `level`, and its learning rate / seed / estimator."""
    points = curve(run)
    cfg = json.loads((run / "config.json").read_text()) if (run / "config.json").is_file() else {}
    return {"curve": points, "first_step_at_level": first_reaching(points, level),
            "lr": cfg.get("actor", {}).get("optim", {}).get("lr"), "seed": cfg.get("trainer", {}).get("seed"),
            "adv_estimator": cfg.get("algorithm", {}).get("adv_estimator"), "dir": str(run)}


def pairs(specs: list[str]) -> list[tuple[str, Path]]:
    return [(name, Path(path)) for name, _, path in (s.partition("=") for s in specs)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the GRPO recipe (its batch: the samples per step of every run)")
    p.add_argument("--teacher", required=True, help="the GRPO run the teacher came from (GRPO's recipe run)")
    p.add_argument("--grpo", nargs="*", default=[], help="NAME=OUTPUT_DIR of more GRPO runs to judge the goal against")
    p.add_argument("--runs", nargs="+", required=True, help="NAME=OUTPUT_DIR of the distillation runs")
    p.add_argument("--share", type=float, default=0.9, help="the share of the teacher's accuracy to reach")
    args = p.parse_args(argv)
    from megappo.config import load_config

    teacher = Path(args.teacher)
    teacher_acc = curve(teacher)[-1][1]  # the trained policy's in-run eval at its last step: what the teacher scores
    level = args.share * teacher_acc
    cfg = load_config(args.config, [], validate=False)
    per_step = int(cfg.data.train_batch_size * cfg.rollout.n)
    grpo = {"grpo": described(teacher, level)} | {n: described(d, level) for n, d in pairs(args.grpo)}
    runs = {n: described(d, level) for n, d in pairs(args.runs)}
    verdicts = {}
    for name, r in runs.items():
        r["samples_at_level"] = None if r["first_step_at_level"] is None else r["first_step_at_level"] * per_step
        r["samples_vs_grpo"] = {g: None if r["first_step_at_level"] is None or b["first_step_at_level"] is None
                                else round(r["first_step_at_level"] / b["first_step_at_level"], 3)
                                for g, b in grpo.items()}
        if r["adv_estimator"] == "opd":  # the goal is pure OPD's
            verdicts[name] = {g: v is not None and v <= 0.25 for g, v in r["samples_vs_grpo"].items()}
    for b in grpo.values():
        b["samples_at_level"] = None if b["first_step_at_level"] is None else b["first_step_at_level"] * per_step
    # the headline: the recipe's OPD run ("opd") and its reseeds ("opd_seed2", ...); other runs are reported per run
    recipe = {n: v for n, v in verdicts.items() if n == "opd" or n.startswith("opd_seed")}
    print(json.dumps({"teacher_eval_accuracy": teacher_acc, "level": round(level, 4), "samples_per_step": per_step,
                      "grpo": grpo, "runs": runs, "goal_met_vs": verdicts,
                      "goal_met_vs_recipe": bool(recipe) and all(v["grpo"] for v in recipe.values()),
                      "goal_met_vs_every_grpo": bool(recipe) and all(all(v.values()) for v in recipe.values())}))


if __name__ == "__main__":
    main()
