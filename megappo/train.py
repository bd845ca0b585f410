"""`megappo train --config configs/ppo_tiny.yaml [key=value ...]`: run PPO (RayPPOTrainer) end to end.

Starts a local Ray (or joins RAY_ADDRESS), builds the worker groups, runs `trainer.total_steps` steps
(resuming from the newest complete checkpoint under <output_dir>/checkpoints with trainer.resume=auto),
and writes <output_dir>/metrics.jsonl, tensorboard/ and reward_curve.png. Worker processes log to
Ray's session dir (/tmp/ray/session_latest/logs), not to this terminal. Exit code 75 after SIGTERM /
SIGUSR1: the step in flight finished and was checkpointed; running the command again resumes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from megappo.utils.ray_env import one_line, setup_env


# SIGTERM / SIGUSR1 stopped the run after a checkpoint: slurm/ray_on_slurm.sh requeues the job on it
# (EX_TEMPFAIL: "try again later")
EXIT_PREEMPTED = 75


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/ppo_tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.total_steps=5")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in CI logs)")



def start_ray(cfg) -> bool:
    """Join the cluster in RAY_ADDRESS (e.g. slurm/ray_on_slurm.sh), else start a fresh local Ray sized
    for the config's pools (logical CPUs; address="local": a stale /tmp/ray/ray_current_cluster left by
    an earlier `ray start` is ignored). False when Ray was already running in this process."""
    import ray

    if ray.is_initialized():
        return False
    res = cfg.resources
    workers = res.nodes * res.workers_per_node + (res.rollout_workers if cfg.trainer.mode != "sync" else 0)
    kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=False, namespace="megappo")
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, **kwargs)
    else:
        ray.init(address="local", num_cpus=max(workers * res.cpus_per_worker, 1), **kwargs)
    return True


def _import_driver_modules() -> None:
    """The driver's heavy imports (torch, the trainer, the tokenizer classes), ahead of their first use."""
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    import megappo.ppo.ray_trainer  # noqa: F401



def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except Exception as e:  # noqa: BLE001 - the run failed: say why in one line (MEGAPPO_TRACEBACK=1 for more)
        if os.environ.get("MEGAPPO_TRACEBACK"):
            raise
        print(f"megappo train: {one_line(e)} (MEGAPPO_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    setup_env()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from megappo.config.loader import ConfigError, load_config

    try:
        cfg = load_config(args.config, list(args.overrides or []), check_paths=True)
    except ConfigError as e:
        print(f"megappo train: {e}", file=sys.stderr)
        return 2
    from pathlib import Path

    from megappo.utils.checkpoint import latest_checkpoint, read_step

    out = cfg.trainer.output_dir
    done = latest_checkpoint(Path(out) / "checkpoints") if cfg.trainer.resume == "auto" else None
    if done is not None and read_step(done) >= cfg.trainer.total_steps:
        print(f"nothing to do: {done} is step {read_step(done)} of trainer.total_steps={cfg.trainer.total_steps} "
              f"(rm -rf {out} to start over, or raise trainer.total_steps to continue)", flush=True)
        final = Path(out) / "hf_final"
        if cfg.trainer.export_hf and not (final / "config.json").is_file():  # a run preempted in its last step
            from megappo.export import export_checkpoint

            export_checkpoint(done, final, overwrite=True, progress=False)
            print(f"exported the final policy (step {read_step(done)}) to {final}: the run that trained it was "
                  "stopped before its export", flush=True)
        return 0
    import ray

    t0 = time.perf_counter()
    # Ray's processes start while a thread imports what the trainer needs (~4 s of imports: a second
    # core's worth of start-up). The trainer is built after ray.init: its SIGTERM handler (preemption)
    # must replace the one ray.init installs (which exits).
    imports = threading.Thread(target=_import_driver_modules, name="driver-imports", daemon=True)
    imports.start()
    t_ray = time.perf_counter()
    started = start_ray(cfg)
    t_ray = time.perf_counter() - t_ray
    imports.join()
    from megappo.ppo.core_algos import algorithm_name
    from megappo.ppo.ray_trainer import RayPPOTrainer

    try:  # tokenizer, data, reward rules: checked before any worker starts
        trainer = RayPPOTrainer(cfg, show_progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as e:
        if started:
            ray.shutdown()
        print(f"megappo train: {one_line(e)}", file=sys.stderr)
        return 2
    try:
        print(f"megappo train: {cfg.trainer.mode} {algorithm_name(cfg.algorithm.adv_estimator)}, "
              f"{cfg.trainer.total_steps} steps, model {cfg.model.path}, "
              f"output {cfg.trainer.output_dir} (worker logs: /tmp/ray/session_latest/logs)", flush=True)
        trainer.init_workers()
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in {"ray": t_ray, **trainer.startup_s}.items())
        print(f"workers up in {time.perf_counter() - t0:.0f}s ({parts})", flush=True)
        history = trainer.fit()
        preempted = trainer.preempted
    finally:
        trainer.shutdown(stop_ray=started)
    if history:
        first = [h["objective/scores"] for h in history[:5]]
        last = [h["objective/scores"] for h in history[-5:]]
        print(f"done in {time.perf_counter() - t0:.0f}s: objective/scores first-5 mean {sum(first) / len(first):.3f}"
              f" -> last-5 mean {sum(last) / len(last):.3f}", flush=True)
    print(f"metrics: {out}/metrics.jsonl, tensorboard: {out}/tensorboard, curve: {out}/reward_curve.png", flush=True)
    return EXIT_PREEMPTED if preempted else 0
