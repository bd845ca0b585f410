"""Benchmark: the demo end to end, as a user runs it (process start to exit), as JSON.

For each seed, one fresh `megappo train` process on the config (a fresh output dir, no resume):
  wall_s            process start to exit (Ray start, worker start-up, steps, validation, checkpoints,
                    the final HF export)
  startup_s         process start to "workers up" (Ray, placement, worker processes, models, vLLM);
                    startup_parts_s: ray, processes (spawn + imports), models (megatron), vllm
  step_median_s     median timing/step_s; phases_median_s: median of every timing/*_s phase
  save_s            timing/save_s of each save
  tokens            the actor update's real tokens vs computed (rows right-aligned and cut to the
                    longest) vs a padded batch's (what the model would compute without right_align)
  first5_scores / last5_scores   mean objective/scores of the first / last 5 steps
  final_eval_accuracy            eval/verifiable_correct_rate at the last step (greedy validation)
and the mean over seeds. Nothing is asserted: the numbers are for the notes and the README.

    .venv/bin/python bench/ppo_e2e.py [--config configs/ppo_tiny.yaml] [--seeds 1,2] [--steps 60]
    .venv/bin/python bench/ppo_e2e.py --config configs/grpo_tiny.yaml --set model.dtype=bf16
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(config: str, seed: int, steps: int | None, out: Path, overrides: tuple = ()) -> dict:
    args = [sys.executable, "-m", "megappo.cli", "train", "--config", config, "--no-progress",
            f"trainer.seed={seed}", f"trainer.output_dir={out}", "trainer.resume=never", *overrides]
    if steps:
        args.append(f"trainer.total_steps={steps}")
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    m = re.search(r"workers up in (\d+)s(?: \((.*)\))?", proc.stdout)
    parts = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)s", m.group(2) or "")} if m else {}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    phases = sorted({k for r in rows for k in r if k.startswith("timing/") and k.endswith("_s")})
    last = rows[-1]
    tokens = {k.split("timing/actor_tokens_")[1]: last[k] for k in last if k.startswith("timing/actor_tokens_")}
    return {
        "seed": seed,
        "wall_s": round(wall, 1),
        "startup_s": float(m.group(1)) if m else None,
        "startup_parts_s": parts,
        "steps": len(rows),
        "step_median_s": round(statistics.median(r["timing/step_s"] for r in rows), 3),
        "phases_median_s": {k[len("timing/"):]: round(statistics.median(r[k] for r in rows if k in r), 3)
                            for k in phases},
        "save_s": [round(r["timing/save_s"], 2) for r in rows if "timing/save_s" in r],
        "tokens_per_actor_update": tokens,
        "first5_scores": round(statistics.mean(r["objective/scores"] for r in rows[:5]), 3),
        "last5_scores": round(statistics.mean(r["objective/scores"] for r in rows[-5:]), 3),
        "final_eval_accuracy": last.get("eval/verifiable_correct_rate"),
    }


def parse_seeds(text: str) -> list[int]:
    """"1,2" -> [1, 2]; "1-5,9" -> [1, 2, 3, 4, 5, 9]."""
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SystemExit(f"--seeds {text!r}: use comma-separated integers and ranges, e.g. 1,2 or 1-15")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/ppo_tiny.yaml")
    p.add_argument("--seeds", default="1,2", help="trainer.seed values, run one after another: 1,2 or 1-5")
    p.add_argument("--steps", type=int, default=None, help="trainer.total_steps (default: the config's)")
    p.add_argument("--out", default=None, help="where the runs go (default: a temp dir, removed)")
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides, e.g. model.dtype=bf16")
    args = p.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    with tempfile.TemporaryDirectory(prefix="megappo-e2e-") as tmp:
        root = Path(args.out or tmp)
        runs = [run_once(args.config, s, args.steps, root / f"seed{s}", tuple(args.set)) for s in seeds]
    mean = {k: round(statistics.mean(r[k] for r in runs), 3) for k in
            ("wall_s", "startup_s", "step_median_s", "first5_scores", "last5_scores", "final_eval_accuracy")
            if all(r[k] is not None for r in runs)}
    print(json.dumps({"config": args.config, "overrides": args.set, "runs": runs, "mean": mean}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
