"""The sampler/trainer gap of the shipped recipes, per dtype: the measurements behind ppo/rollout_guard.BOUNDS.

    python bench/rollout_gap.py [--steps 3] [--recipes tiny moe smollm2] [--dtypes fp32 bf16]

Each recipe runs `--steps` sync steps as shipped (smaller batches: 4 prompts x 4 samples), with pi_old recomputed
by Megatron (actor.use_rollout_log_probs=false: the gap on every sampled token) and the guard off, at each dtype;
the assets come from `megappo assets --demo --demo-moe` and tools/smollm2_to_hf.py (built when missing). Prints one
JSON object: per recipe and dtype the steps' rollout/logprob_diff_mean and _max, and per dtype the largest mean
seen, the bound in force (BOUNDS) and its margin over that largest mean.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECIPES = {  # name -> (config, model dir, data dir)
    "tiny": ("configs/ppo_tiny.yaml", "assets/tiny-llama-arith", "outputs/data"),
    "moe": ("configs/ppo_tiny_moe.yaml", "assets/tiny-qwen3_moe-arith", "outputs/data"),
    "smollm2": ("configs/grpo_smollm2_135m.yaml", "assets/smollm2-135m-instruct", "outputs/data/smollm2_arith"),
}


def ensure_assets(recipes: list[str]) -> None:
    """The recipes' models and data (their progress to stderr: stdout is the JSON)."""
    py = sys.executable
    subprocess.run([py, "-m", "megappo.cli", "assets", "--demo", "--demo-moe"], cwd=REPO, check=True, stdout=sys.stderr)
    subprocess.run([py, "-m", "megappo.data.preprocess_arithmetic", "--out", "outputs/data", "--max-operand", "3"],
                   cwd=REPO, check=True, stdout=sys.stderr)
    if "smollm2" in recipes:
        if not (REPO / "assets/smollm2-135m-instruct/config.json").is_file():
            subprocess.run([py, "tools/smollm2_to_hf.py", "--out", "assets/smollm2-135m-instruct"], cwd=REPO, check=True, stdout=sys.stderr)
        subprocess.run([py, "-m", "megappo.data.preprocess_arithmetic", "--out", "outputs/data/smollm2_arith",
                        "--held-out", "--min-operand", "0", "--max-operand", "30", "--val-size", "150",
                        "--instruction", "Give only the number."], cwd=REPO, check=True, stdout=sys.stderr)


def run(recipe: str, dtype: str, steps: int, out: Path) -> list[dict]:
    config, model, data = RECIPES[recipe]
    overrides = [f"model.path={model}", f"model.dtype={dtype}", f"trainer.output_dir={out}",
                 f"data.train_files=[{data}/arith_train.parquet]", "data.val_files=[]", "data.train_batch_size=4",
                 "rollout.n=4", "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=4",
                 "actor.log_prob_micro_batch_size=8", "critic.ppo_mini_batch_size=16", "critic.micro_batch_size=4",
                 "actor.use_rollout_log_probs=false", "trainer.rollout_check=never", f"trainer.total_steps={steps}",
                 "trainer.save_every=0", "trainer.val_every=0", "trainer.export_hf=false",
                 "trainer.loggers=[jsonl]"]
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", "train", "--config", config, "--no-progress",
                           *overrides], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{recipe} {dtype}: {proc.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "mean": r["rollout/logprob_diff_mean"], "max": r["rollout/logprob_diff_max"]}
            for r in rows]


def main() -> None:
    from megappo.ppo.rollout_guard import BOUNDS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--dtypes", nargs="+", default=list(BOUNDS), choices=list(BOUNDS))
    args = p.parse_args()
    ensure_assets(args.recipes)
    result = {"runs": {}, "bounds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes:
            for dtype in args.dtypes:
                steps = run(recipe, dtype, args.steps, Path(tmp) / f"{recipe}_{dtype}")
                result["runs"][f"{recipe}/{dtype}"] = steps
                print(f"{recipe} {dtype}: " + ", ".join(f"{s['mean']:.3g}" for s in steps), file=sys.stderr,
                      flush=True)
    for dtype in args.dtypes:
        worst = max(s["mean"] for k, steps in result["runs"].items() if k.endswith("/" + dtype) for s in steps)
        result["bounds"][dtype] = {"largest_mean": worst, "bound": BOUNDS[dtype], "margin": BOUNDS[dtype] / worst}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
