"""The tiny trainer config the trainer tests share, and how they run it (in this process, on the
session's Ray)."""

from __future__ import annotations

import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _warm_workers():
    from megappo.ppo.workers import WarmWorkers

    return WarmWorkers()


# the session's warm trainer workers (megappo.ppo.workers.WarmWorkers): `run` hands a run the last run's
# workers when both build the same ones; conftest's ray_session closes them before Ray stops
WARM = _warm_workers()


def nondeterministic(key: str) -> bool:
    """Metrics that legitimately differ between two runs of the same steps: times (timing/* holds seconds,
    *_s, and the overlap ratio of two of them), the restart counter and memory peaks (perf/*). Every count is
    compared."""
    return key.startswith(("time/", "trainer/restarts", "perf/")) or \
        (key.startswith("timing/") and key.endswith(("_s", "_frac")))


def config(tiny_assets, data_dir, out, *extra):
    from megappo.config.loader import load_config

    return load_config(REPO / "configs/ppo_tiny.yaml", overrides(tiny_assets, data_dir, out, *extra))


def overrides(tiny_assets, data_dir, out, *extra) -> list[str]:
    """configs/ppo_tiny.yaml + these: 4 steps of 4 prompts x 2 responses, checkpoints and validation
    every 2 steps, pi_old recomputed by the actor."""
    return [
        f"model.path={tiny_assets['tiny-llama']}",
        f"data.train_files=[{data_dir / 'arith_train.parquet'}]", f"data.val_files=[{data_dir / 'arith_val.parquet'}]",
        "data.train_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=8", "rollout.kv_cache_memory_mb=16",
        "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=2", "actor.ppo_epochs=1",
        "critic.ppo_mini_batch_size=8", "critic.micro_batch_size=4",
        "trainer.total_steps=4", "trainer.save_every=2", "trainer.val_every=2", f"trainer.output_dir={out}",
        "trainer.loggers=[jsonl,tensorboard]", "reward.num_examine=0", "trainer.worker_timeout_s=300",
        # the general path (base.yaml's default): pi_old from a Megatron forward, so the trainer/sampler
        # log-prob agreement is measured; test_rollout_log_probs_as_pi_old covers the demo's shortcut
        "actor.use_rollout_log_probs=false",
        *extra,
    ]


def run(cfg, fault_hook=None, setup=None, warm: bool = True):
    """RayPPOTrainer end to end; `setup(trainer)` runs before the workers start (a test installs its hooks
    there, with the trainer at hand). Returns (history, the trainer after shutdown) when fault_hook or
    setup is given. warm: take the session's warm workers when the last run built the same ones (WARM), and
    leave this run's for the next; False: workers of its own, ended with the run."""
    from megappo.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer(cfg, show_progress=False, warm=WARM if warm else None)
    trainer.fault_hook = fault_hook
    if setup is not None:
        setup(trainer)
    try:
        trainer.init_workers()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    return (history, trainer) if fault_hook is not None or setup is not None else history


def recording_rewarded(batches: list):
    """A run's setup hook: every batch the trainer scores (the reward function's input) -> batches."""
    def setup(trainer):
        score = trainer.reward_fn

        class Recorded:
            def __getattr__(self, name):
                return getattr(score, name)

            def __call__(self, batch):
                batches.append(batch)
                return score(batch)

        trainer.reward_fn = Recorded()
    return setup


def recording_updates(batches: list):
    """A run's setup hook: every batch the trainer updates on (after rewards and advantages) -> batches."""
    def setup(trainer):
        update = trainer._update

        def recorded(batch, timing):
            batches.append(batch)
            return update(batch, timing)

        trainer._update = recorded
    return setup


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not nondeterministic(k)}


def assert_same_steps(expected: list[dict], got: list[dict], rel: float = 1e-5, abs_: float = 1e-6) -> None:
    """Step for step the same metrics (all but times and the restart counter)."""
    assert [int(r["episode"]) for r in expected] == [int(r["episode"]) for r in got]
    for a, b in zip(expected, got):
        a, b = comparable(a), comparable(b)
        assert set(a) == set(b), set(a) ^ set(b)
        diff = {k: (a[k], b[k]) for k in a if not math.isclose(a[k], b[k], rel_tol=rel, abs_tol=abs_)}
        assert not diff, diff
