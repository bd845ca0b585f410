"""PPO step-time breakdown, sync (colocated hybrid engine) vs async (own rollout pool, one step
off-policy). Runs the real trainer (Ray workers, megatron-core, vLLM) for a few steps per mode and
prints one JSON object per mode: the median over steps 2.. (step 1 warms vLLM up) of

  step_s            wall time of one step on the driver
  rollout_s         generation on the rollout engines (sync: inside the hybrid engine; async: on the
                    rollout pool, overlapping the previous step's training)
  rollout_wait_s    what the driver waited for the rollout (sync: == gen_s, the whole rollout call)
  overlap_s         rollout time hidden behind training (async: rollout_s - rollout_wait_s; sync: 0)
  weight_sync_s     trainer -> vLLM weights (sync: reshard into the colocated engines; async: the
                    broadcast to the rollout pool, both ends)
  old_log_prob_s, ref_log_prob_s, values_s, update_critic_s, update_actor_s, reward_adv_s

    python bench/ppo_step.py                                # configs/ppo_tiny.yaml, 6 steps per mode
    python bench/ppo_step.py --steps 8 --modes sync data.train_batch_size=16 rollout.n=8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KEYS = {"step_s": "timing/step_s", "old_log_prob_s": "timing/old_log_prob_s", "ref_log_prob_s": "timing/ref_s",
        "values_s": "timing/values_s", "update_critic_s": "timing/update_critic_s",
        "update_actor_s": "timing/update_actor_s", "reward_adv_s": "timing/reward_adv_s",
        "rollout_s": "timing/rollout_s", "weight_sync_s": "timing/weight_sync_s"}


def train(cfg, setup=None) -> tuple[list, float, float]:
    """One training run in this process on Ray (started here unless one runs): (history, seconds to bring the
    workers up, seconds of fit). `setup(trainer)` runs before the workers start (a bench's hooks). Also
    bench/async_modes.py's."""
    import time

    import ray

    from megappo.ppo.ray_trainer import RayPPOTrainer
    from megappo.train import start_ray

    started = start_ray(cfg)
    trainer = RayPPOTrainer(cfg, show_progress=False)
    if setup is not None:
        setup(trainer)
    t0 = time.perf_counter()
    try:
        trainer.init_workers()
        t_fit = time.perf_counter()
        history = trainer.fit()
        fit_s = time.perf_counter() - t_fit
    finally:
        trainer.shutdown()
        if started:
            ray.shutdown()
    return history, t_fit - t0, fit_s


def run_mode(mode: str, config: str, steps: int, overrides: list[str]) -> dict:
    from megappo.config.loader import load_config

    out = tempfile.mkdtemp(prefix=f"megappo-bench-{mode}-")
    extra = [f"trainer.mode={mode}", f"trainer.total_steps={steps}", f"trainer.output_dir={out}",
             "trainer.save_every=0", "trainer.val_every=0", "trainer.loggers=[jsonl]", "reward.num_examine=0",
             "trainer.resume=never"]
    if mode == "async":
        extra.append("resources.rollout_workers=1")
    history, _, _ = train(load_config(config, extra + overrides, check_paths=True))
    rows = history[1:] or history

    def med(key):
        vals = [r[key] for r in rows if key in r]
        return round(statistics.median(vals), 4) if vals else None

    res = {"mode": mode, "steps": steps, "measured_steps": len(rows),
           "sequences_per_step": cfg.data.train_batch_size * cfg.rollout.n}
    res.update({name: med(key) for name, key in KEYS.items()})
    if mode == "async":
        res["rollout_wait_s"] = med("timing/rollout_wait_s")
        res["overlap_s"] = med("timing/rollout_overlap_s")
        res["overlap_frac"] = med("timing/rollout_overlap_frac")
    else:
        res["rollout_wait_s"] = med("timing/gen_s")
        res["overlap_s"] = 0.0
        res["overlap_frac"] = 0.0
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs/ppo_tiny.yaml"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args()
    for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "RAY_AUTH_MODE": "disabled",
                 "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    for mode in args.modes:
        print(json.dumps(run_mode(mode, args.config, args.steps, args.overrides)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
