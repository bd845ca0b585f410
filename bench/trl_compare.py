"""megappo vs Hugging Face TRL on the same PPO or GRPO task, one run after the other on this machine, as JSON.

The same weights, prompts, scorer (megappo/rewards/arithmetic.py), non-stop penalty and step shape
(prompts x samples per step, new tokens, temperature, lrs, mini-batches x epochs = optimizer updates
per step, KL coefficient, clip), all read from ONE megappo config (default configs/grpo_tiny.yaml).
megappo runs as `bench/ppo_e2e.py` runs it (a fresh `megappo train` process); TRL runs in its own venv
(`make trl-venv`): a GAE config with a critic (configs/ppo_tiny.yaml) runs TRL 0.29's
trl.experimental.ppo PPOTrainer (bench/trl_ppo.py, with .venv-trl/trl-0.29 first on PYTHONPATH:
TRL 1.x has no PPOTrainer), a GRPO config TRL 1.13's GRPOTrainer (bench/trl_grpo.py). Each side: wall
time from process start to exit and the greedy accuracy on the validation prompts after the last step.

    make trl-venv
    .venv/bin/python bench/trl_compare.py [--config configs/grpo_tiny.yaml] [--seeds 1,2 | 1-15] [--steps 60]
    .venv/bin/python bench/trl_compare.py --config configs/ppo_tiny.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_PY = REPO / ".venv-trl" / "bin" / "python"
TRL_PPO_PATH = REPO / ".venv-trl" / "trl-0.29"  # trl 0.29 without deps (`make trl-venv`)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ppo_e2e import parse_seeds, run_once  # noqa: E402


def step_shape(config: str, seed: int, steps: int | None) -> dict:
    """The megappo config's step as the numbers TRL's GRPOConfig / PPOConfig need (one source of truth)."""
    from megappo.config.loader import load_config

    c = load_config(REPO / config, [])
    m, d, a, r, alg = c.model, c.data, c.actor, c.rollout, c.algorithm
    if c.critic.enable and alg.adv_estimator == "gae":
        algo = "ppo"
    elif not c.critic.enable and alg.adv_estimator == "grpo":
        algo = "grpo"
    else:
        raise SystemExit(f"{config}: TRL compares PPO (adv_estimator gae with the critic, e.g. configs/ppo_tiny.yaml) "
                         "or GRPO (adv_estimator grpo, no critic, e.g. configs/grpo_tiny.yaml)")
    path = lambda p: str((REPO / p).resolve())  # noqa: E731
    shape = {"algo": algo, "model": path(m.path), "tokenizer": path(m.tokenizer or m.path),
             "train_file": path(d.train_files[0]), "val_file": path(d.val_files[0]),
             "steps": steps or c.trainer.total_steps, "prompts_per_step": d.train_batch_size, "n": r.n,
             "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "lr": a.optim.lr,
             "mini_batch": a.ppo_mini_batch_size, "epochs": a.ppo_epochs,
             "kl_coef": a.kl_loss_coef if a.use_kl_loss else 0.0, "clip": a.clip_ratio,
             "non_stop_penalty": c.reward.non_stop_penalty_value if c.reward.non_stop_penalty else None,
             # megappo's bf16 is mixed precision (fp32 main params) = TRL's bf16=True (autocast, fp32 params)
             "bf16": m.dtype == "bf16", "seed": seed}
    if algo == "grpo":
        return shape
    # PPO: TRL 0.29's PPOTrainer puts a fixed k1/k3 KL penalty in the reward, whitens the advantages and
    # keeps the lr constant (bench/trl_ppo.py); refuse what it cannot express rather than compare unlike runs
    estimators = {"k1": "k1", "kl": "k1", "k3": "k3", "low_var_kl": "k3"}
    if alg.use_kl_in_reward and (alg.kl_ctrl.type != "fixed" or alg.kl_penalty not in estimators):
        raise SystemExit(f"{config}: TRL's PPOTrainer has a fixed k1 / k3 KL penalty only "
                         f"(kl_ctrl.type {alg.kl_ctrl.type}, kl_penalty {alg.kl_penalty})")
    if not alg.whiten_advantages or a.use_kl_loss:
        raise SystemExit(f"{config}: TRL's PPOTrainer always whitens the advantages and has no KL loss")
    if {a.optim.lr_schedule, c.critic.optim.lr_schedule} != {"constant"}:
        raise SystemExit(f"{config}: the TRL PPO comparison keeps the lr constant (lr_schedule constant)")
    o = a.optim
    return dict(shape, kl_coef=alg.kl_ctrl.kl_coef if alg.use_kl_in_reward else 0.0,
                kl_estimator=estimators.get(alg.kl_penalty, "k1"), gamma=alg.gamma, lam=alg.lam,
                critic_lr=c.critic.optim.lr, cliprange_value=c.critic.cliprange_value,
                adam=[o.adam_beta1, o.adam_beta2, o.adam_eps], weight_decay=o.weight_decay)


def run_trl(shape: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "shape.json").write_text(json.dumps(shape, indent=1))
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1")
    if shape["algo"] == "ppo":  # trl 0.29 (PPOTrainer) ahead of the venv's trl 1.13
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TRL_PPO_PATH), env.get("PYTHONPATH")) if p)
    script = REPO / "bench" / f"trl_{shape['algo']}.py"
    t0 = time.perf_counter()
    proc = subprocess.run([str(TRL_PY), str(script), str(out / "shape.json"), str(out)],
                          cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"TRL seed {shape['seed']}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return {"seed": shape["seed"], "wall_s": round(wall, 1), **json.loads((out / "result.json").read_text())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/grpo_tiny.yaml")
    p.add_argument("--seeds", default="1,2", help="comma-separated seeds and ranges, e.g. 1,2 or 1-15")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default=None, help="keep the runs here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    shape = step_shape(args.config, seeds[0], args.steps)
    if not TRL_PY.exists() or (shape["algo"] == "ppo" and not (TRL_PPO_PATH / "trl").is_dir()):
        raise SystemExit(f"{TRL_PY} or {TRL_PPO_PATH} not found: run `make trl-venv` first (TRL in its own venv)")
    # both sides evaluate the validation prompts once, after the last step (TRL has no periodic eval
    # here); megappo also writes its one checkpoint and the HF export then (TRL saves nothing)
    once_at_end = (f"trainer.val_every={shape['steps']}", f"trainer.save_every={shape['steps']}")
    with tempfile.TemporaryDirectory(prefix="megappo-trl-") as tmp:
        root = Path(args.out or tmp)
        megappo, trl = [], []
        for s in seeds:  # alternate, so drift in the machine's load hits both sides alike
            megappo.append(run_once(args.config, s, args.steps, root / f"megappo{s}", once_at_end))
            trl.append(run_trl(dict(shape, seed=s), root / f"trl{s}"))
    mean = lambda rs, k: round(statistics.mean(r[k] for r in rs), 3)  # noqa: E731
    summary = {side: {k: mean(rs, k) for k in ("wall_s", "final_eval_accuracy")}
               for side, rs in (("megappo", megappo), ("trl", trl))}
    summary["wall_ratio_megappo_over_trl"] = round(summary["megappo"]["wall_s"] / summary["trl"]["wall_s"], 2)
    # seed for seed (the same prompts, weights and seed on both sides): the accuracy gap and its standard
    # error; seed-to-seed swings of +-0.1 on this task make a gap under ~2 standard errors noise
    diff = [m["final_eval_accuracy"] - t["final_eval_accuracy"] for m, t in zip(megappo, trl)]
    summary["accuracy_diff_megappo_minus_trl"] = round(statistics.mean(diff), 3)
    if len(diff) > 1:
        summary["accuracy_diff_stderr"] = round(statistics.stdev(diff) / len(diff) ** 0.5, 3)
    print(json.dumps({"config": args.config, "shape": {k: v for k, v in shape.items() if k != "seed"},
                      "megappo": megappo, "trl": trl, "mean": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
