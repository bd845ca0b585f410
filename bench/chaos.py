"""Benchmark: a longer run under chaos. kill -9 a worker process of a random group and rank at a
random phase of a random step, N times, and SIGTERM the driver once (a preemption); then a second
driver resumes it to the end. Compares with an uninterrupted run of the same config (sync mode: the
metrics must be equal step for step) and prints JSON:

  kills, restarts, steps_redone      what happened (steps done before a kill and done again after)
  wall_s, wall_uninterrupted_s       the chaos run (both drivers) vs the uninterrupted one
  overhead                           wall_s / wall_uninterrupted_s - 1
  metrics_equal, max_rel_diff        step-for-step equality of every non-timing metric

    .venv/bin/python bench/chaos.py [--steps 20] [--kills 5] [--save-every 2] [--seed 0] [--mode sync]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "save")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default="sync", choices=["sync", "async"])
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from megappo.assets import ensure_assets
    from megappo.data.preprocess_arithmetic import main as make_data
    from megappo.ppo.ray_trainer import RayPPOTrainer
    from trainer_utils import comparable, config

    rng = random.Random(args.seed)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    tmp = Path(tempfile.mkdtemp(prefix="megappo-chaos-"))
    assets = ensure_assets(REPO / "assets")
    make_data(["--out", str(tmp / "data"), "--train-size", "64", "--val-size", "8"])
    extra = [f"trainer.total_steps={args.steps}", f"trainer.save_every={args.save_every}", "trainer.val_every=0",
             "trainer.export_hf=false", "trainer.max_restarts=10"]
    if args.mode == "async":
        extra += ["trainer.mode=async", "resources.rollout_workers=1"]

    def run(out, hook_plan=None):
        trainer = RayPPOTrainer(config(assets, tmp / "data", out, *extra), show_progress=False)
        if hook_plan is not None:
            trainer.fault_hook = hook_plan(trainer)
        try:
            trainer.init_workers()
            return trainer.fit(), trainer
        finally:
            trainer.shutdown()

    t0 = time.perf_counter()
    clean, _ = run(tmp / "clean")
    wall_clean = time.perf_counter() - t0

    phases = PHASES + (("rollout_wait",) if args.mode == "async" else ())
    plan = {}
    while len(plan) < args.kills:
        plan[(rng.choice(phases), rng.randint(1, args.steps - 1))] = None
    keys = list(plan)
    preempt_at = (rng.choice(phases[:-1]), rng.randint(args.steps // 2, args.steps - 1))
    killed = []

    def hook_plan(trainer):
        def hook(phase, step):
            if (phase, step) in plan:
                del plan[(phase, step)]
                # the groups alive now (a restart builds new ones); colocated roles share one group
                live = {}
                for g in ("actor", "critic", "rollout"):
                    wg = getattr(trainer, f"{g}_wg", None)
                    if wg is not None and id(wg) not in live:
                        live[id(wg)] = (g, wg)
                group, wg = rng.choice(sorted(live.values(), key=lambda x: x[0]))
                rank = rng.randrange(wg.world_size)
                pid = wg.infos[rank]["pid"]
                killed.append({"group": group, "rank": rank, "phase": phase, "step": step})
                threading.Timer(rng.uniform(0, 0.3), os.kill, (pid, signal.SIGKILL)).start()
            if (phase, step) == preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)
        return hook

    t0 = time.perf_counter()
    first, trainer = run(tmp / "chaos", hook_plan)
    restarts, redone, preempted = trainer.restarts, trainer.steps_redone, trainer.preempted
    rest, _ = run(tmp / "chaos") if preempted else ([], None)
    wall = time.perf_counter() - t0
    got = {int(r["episode"]): r for r in first + rest}
    chaos = [got[int(r["episode"])] for r in clean if int(r["episode"]) in got]
    worst = 0.0
    for a, b in zip(clean, chaos):
        a, b = comparable(a), comparable(b)
        for k in a:
            if k in b:
                worst = max(worst, abs(a[k] - b[k]) / max(abs(a[k]), 1e-6))
    ray.shutdown()
    print(json.dumps({"mode": args.mode, "steps": args.steps, "save_every": args.save_every, "kills": killed,
                      "kill_plan_not_reached": [list(k) for k in keys if k in plan], "preempted_at": list(preempt_at),
                      "preempted": preempted, "restarts": restarts, "steps_redone": redone,
                      "steps_logged": len(chaos), "wall_s": round(wall, 1), "wall_uninterrupted_s": round(wall_clean, 1),
                      "overhead": round(wall / wall_clean - 1, 3),
                      "metrics_equal": len(chaos) == len(clean) and worst <= 1e-5,
                      "max_rel_diff": worst if math.isfinite(worst) else None}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
