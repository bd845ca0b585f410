"""megappo vs Hugging Face TRL on the same GRPO task, one run after the other on this machine, as JSON.

The same weights, prompts, scorer (megappo/rewards/arithmetic.py), non-stop penalty and step shape
(prompts x samples per step, new tokens, temperature, lr, mini-batches x epochs = optimizer updates per
step, k3 KL coefficient, clip), all read from ONE megappo config (default configs/grpo_tiny.yaml).
megappo runs as `bench/ppo_e2e.py` runs it (a fresh `megappo train` process); TRL runs its
GRPOTrainer in its own venv (`make trl-venv`, bench/trl_grpo.py). Each side: wall time from process
start to exit and the greedy accuracy on the validation prompts after the last step. TRL 1.13 (the
newest wheel the registry here has) ships no PPOTrainer, so only GRPO is compared.

    make trl-venv
    .venv/bin/python bench/trl_compare.py [--config configs/grpo_tiny.yaml] [--seeds 1,2] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_PY = REPO / ".venv-trl" / "bin" / "python"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ppo_e2e import run_once  # noqa: E402


def step_shape(config: str, seed: int, steps: int | None) -> dict:
    """The megappo config's GRPO step as the numbers TRL's GRPOConfig needs (one source of truth)."""
    from megappo.config.loader import load_config

    c = load_config(REPO / config, [])
    if c.critic.enable or c.algorithm.adv_estimator != "grpo":
        raise SystemExit(f"{config}: the TRL comparison is GRPO only (TRL 1.13 has no PPOTrainer); "
                         "pass a GRPO config such as configs/grpo_tiny.yaml")
    m, d, a, r = c.model, c.data, c.actor, c.rollout
    path = lambda p: str((REPO / p).resolve())  # noqa: E731
    return {"model": path(m.path), "tokenizer": path(m.tokenizer or m.path),
            "train_file": path(d.train_files[0]), "val_file": path(d.val_files[0]),
            "steps": steps or c.trainer.total_steps, "prompts_per_step": d.train_batch_size, "n": r.n,
            "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "lr": a.optim.lr,
            "mini_batch": a.ppo_mini_batch_size, "epochs": a.ppo_epochs,
            "kl_coef": a.kl_loss_coef if a.use_kl_loss else 0.0, "clip": a.clip_ratio,
            "non_stop_penalty": c.reward.non_stop_penalty_value if c.reward.non_stop_penalty else None,
            "seed": seed}


def run_trl(shape: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "shape.json").write_text(json.dumps(shape, indent=1))
    t0 = time.perf_counter()
    proc = subprocess.run([str(TRL_PY), str(REPO / "bench" / "trl_grpo.py"), str(out / "shape.json"), str(out)],
                          cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"TRL seed {shape['seed']}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return {"seed": shape["seed"], "wall_s": round(wall, 1), **json.loads((out / "result.json").read_text())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/grpo_tiny.yaml")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default=None, help="keep the runs here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    if not TRL_PY.exists():
        raise SystemExit(f"{TRL_PY} not found: run `make trl-venv` first (TRL in its own venv)")
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="megappo-trl-") as tmp:
        root = Path(args.out or tmp)
        shape = step_shape(args.config, seeds[0], args.steps)
        megappo, trl = [], []
        for s in seeds:  # alternate, so drift in the machine's load hits both sides alike
            megappo.append(run_once(args.config, s, args.steps, root / f"megappo{s}"))
            trl.append(run_trl(dict(shape, seed=s), root / f"trl{s}"))
    mean = lambda rs, k: round(statistics.mean(r[k] for r in rs), 3)  # noqa: E731
    summary = {side: {k: mean(rs, k) for k in ("wall_s", "final_eval_accuracy")}
               for side, rs in (("megappo", megappo), ("trl", trl))}
    summary["wall_ratio_megappo_over_trl"] = round(summary["megappo"]["wall_s"] / summary["trl"]["wall_s"], 2)
    print(json.dumps({"config": args.config, "shape": {k: v for k, v in shape.items() if k != "seed"},
                      "megappo": megappo, "trl": trl, "mean": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
