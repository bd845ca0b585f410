"""Killed workers and preemption, for real: worker processes are SIGKILLed at chosen phases and the
driver gets a SIGTERM; the run brings every worker group up again, resumes from the newest complete
checkpoint and finishes with the metrics of an uninterrupted run (sync mode: step for step).

- sync: three kill -9 of a worker (actor/critic process, rank 0 or 1) at three phases, one of them
  mid-save (a torn checkpoint dir must never be loaded), then SIGTERM: the step in flight finishes and
  is checkpointed, fit returns preempted; a new trainer (a requeued job) resumes and finishes.
  metrics.jsonl holds each step once; trainer/restarts counts the restarts.
- async: one kill of the rollout pool's worker; the run finishes and syncs its weights after it.
- a failure that keeps coming back ends the run after trainer.max_restarts restarts, with the first
  cause in the error.
The kills come from RayPPOTrainer.fault_hook(phase, step), called when a phase starts (bench/chaos.py
does the same at random, for longer runs).
"""

from __future__ import annotations

import math
import os
import signal
import threading

import pytest

from trainer_utils import assert_same_steps, config, run


def _killer(trainer, plan: dict, log: list):
    """fault_hook: at (phase, step) in `plan`, SIGKILL (group, rank)'s process (after `delay` seconds, in
    a thread, so the phase is under way), or SIGTERM this process (the driver) for "preempt".

    Faults happen one at a time, whatever the machine's speed: a delayed kill lands before the next
    phase starts (tiny models save in milliseconds, so a 0.3 s timer could otherwise fire phases later,
    on a process the next planned kill also targets: two kills, one restart), and a planned fault
    waits, for the step to be redone, until the trainer has restarted after every kill so far."""
    pending: list[threading.Timer] = []

    def hook(phase: str, step: int):
        while pending:  # a timer fires after its delay (<= 1 s): 30 s is a hang
            timer = pending.pop()
            timer.join(timeout=30)
            assert not timer.is_alive(), "a delayed kill's timer did not fire within 30 s"
        if (phase, step) not in plan:
            return
        kills = sum(1 for e in log if e[0] == "SIGKILL")
        if trainer.restarts < kills:  # the last kill not noticed yet: this fault comes in the redone step
            return
        target = plan.pop((phase, step))
        if target == "preempt":
            log.append(("SIGTERM", phase, step))
            os.kill(os.getpid(), signal.SIGTERM)
            return
        group, rank, delay = target
        pid = getattr(trainer, f"{group}_wg").infos[rank]["pid"]
        log.append(("SIGKILL", group, rank, pid, phase, step))

        def kill():
            os.kill(pid, signal.SIGKILL)

        if delay:
            pending.append(threading.Timer(delay, kill))
            pending[-1].start()
        else:
            kill()

    return hook


def _run_with_faults(cfg, plan: dict):
    """A run with `plan`'s faults, on the session's warm workers when they fit (the kills end them; the restart
    brings up new ones, kept warm if the run ends cleanly)."""
    from megappo.ppo.ray_trainer import RayPPOTrainer
    from trainer_utils import WARM

    trainer = RayPPOTrainer(cfg, show_progress=False, warm=WARM)
    log: list = []
    trainer.fault_hook = _killer(trainer, plan, log)
    try:
        trainer.init_workers()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    return history, trainer, log


@pytest.mark.long  # 75 s; CI keeps a kill mid-save with a preemption (below), the hung worker and the failure that
# keeps coming back
def test_sync_run_survives_three_kills_and_a_preemption(sync_baseline, tiny_assets, data_dir, tmp_path):
    from megappo.utils.checkpoint import is_complete, latest_checkpoint
    from megappo.utils.tracking import read_metrics

    baseline, _ = sync_baseline
    out = tmp_path / "chaos"
    cfg = config(tiny_assets, data_dir, out, "trainer.save_every=1")
    plan = {("update_actor", 1): ("actor", 1, 0.0),          # before step 1's checkpoint: back to the start
            ("save", 2): ("actor", 0, 0.3),                  # mid-save: the step-2 dir must not be used
            ("values", 3): ("critic", 0, 0.0),
            ("update_critic", 3): "preempt"}
    first, trainer, log = _run_with_faults(cfg, dict(plan))
    assert trainer.preempted and trainer.restarts == 3, log
    assert len([e for e in log if e[0] == "SIGKILL"]) == 3
    assert trainer.global_step == 3 and is_complete(latest_checkpoint(out / "checkpoints"))
    # the requeued job: a new driver and new workers resume from the step-3 checkpoint
    rest = run(cfg)
    got = {int(r["episode"]) // 8: r for r in first + rest}  # each step's last logged metrics
    assert_same_steps(baseline, [got[s] for s in (1, 2, 3, 4)])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one clean series: redone steps replaced their rows
    assert rows[2]["trainer/restarts"] == 3 and rows[3]["trainer/restarts"] == 0
    for d in (out / "checkpoints").iterdir():  # no temp dir left behind by the killed save
        assert d.name.startswith("step_") and is_complete(d), d


def test_a_kill_mid_save_and_a_preemption_then_the_requeued_job_match_the_uninterrupted_run(
        sync_baseline, tiny_assets, data_dir, tmp_path):
    """A worker SIGKILLed while step 2's checkpoint is written (that dir must not be used: back to step 1's), then
    SIGTERM (Slurm's preemption warning) during step 3: the run checkpoints step 3 and stops; the requeued job
    resumes there, and the four steps equal the uninterrupted run's, one clean series in metrics.jsonl."""
    from megappo.utils.checkpoint import is_complete, latest_checkpoint
    from megappo.utils.tracking import read_metrics

    baseline, _ = sync_baseline
    out = tmp_path / "preempted"
    cfg = config(tiny_assets, data_dir, out, "trainer.save_every=1")
    first, trainer, log = _run_with_faults(cfg, {("save", 2): ("actor", 0, 0.3), ("update_critic", 3): "preempt"})
    assert trainer.preempted and trainer.restarts == 1 and [e[0] for e in log] == ["SIGKILL", "SIGTERM"], log
    assert trainer.global_step == 3 and is_complete(latest_checkpoint(out / "checkpoints"))
    rest = run(cfg)  # the requeued job
    got = {int(r["episode"]) // 8: r for r in first + rest}
    assert_same_steps(baseline, [got[s] for s in (1, 2, 3, 4)])
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    for d in (out / "checkpoints").iterdir():  # no temp dir left behind by the killed save
        assert d.name.startswith("step_") and is_complete(d), d


@pytest.mark.long  # 85 s; CI keeps the sync run's kills, the hung worker and async mode itself (test_trainer)
def test_async_run_survives_a_rollout_worker_kill(ray_session, tiny_assets, data_dir, tmp_path):
    cfg = config(tiny_assets, data_dir, tmp_path / "async", "trainer.mode=async", "resources.rollout_workers=1",
                 "trainer.total_steps=3", "trainer.save_every=1", "trainer.val_every=0")
    history, trainer, log = _run_with_faults(cfg, {("rollout_wait", 2): ("rollout", 0, 0.0)})
    assert trainer.restarts == 1 and len(log) == 1
    assert [int(h["episode"]) for h in history] == [8, 16, 24]
    assert all(h["rollout/weights_fingerprint_ok"] == 1.0 for h in history)


def test_a_failure_that_keeps_coming_back_ends_the_run_with_its_first_cause(ray_session, tiny_assets, data_dir,
                                                                           tmp_path):
    from megappo.controller.resource_pool import WorkerError

    cfg = config(tiny_assets, data_dir, tmp_path / "dead", "trainer.max_restarts=1", "trainer.total_steps=2",
                 "trainer.save_every=0", "trainer.val_every=0", "trainer.export_hf=false")
    plan = {("ref", 1): ("actor", 0, 0.0)}
    from megappo.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer(cfg, show_progress=False)
    hook = _killer(trainer, plan, [])

    def always(phase, step):  # the same fault after every restart
        plan[("ref", 1)] = ("actor", 0, 0.0)
        hook(phase, step)

    trainer.fault_hook = always
    try:
        trainer.init_workers()
        with pytest.raises(WorkerError, match=r"giving up after 1 restarts in a row .* first cause: group 'actor' "
                                              r"rank 0 .* died during compute_ref_log_prob"):
            trainer.fit()
    finally:
        trainer.shutdown()
    assert trainer.restarts == 1


def test_a_hung_worker_is_restarted_and_the_run_matches_the_uninterrupted_one(sync_baseline, tiny_assets, data_dir,
                                                                                 tmp_path):
    """A worker busy past its phase's bound (here: a 600 s sleep queued on the critic's process just before step 4's
    values phase, so that call never starts) is a hung worker: the driver says which phase, tears every group down,
    resumes from the step-2 checkpoint and redoes steps 3 and 4 with the uninterrupted run's metrics. Each step is
    kept once in metrics.jsonl and in TensorBoard (the redone step 3 purges the first one). The bound of every call
    is trainer.phase_timeout_s (300 s here: no phase of a busy machine reaches it; 12 s did, a restart more); the
    hung phase's own call gets 3 s, set on its group when the sleep is queued."""
    import ray
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megappo.utils.tracking import read_metrics

    baseline, _ = sync_baseline
    out = tmp_path / "hung"
    hung = []

    def hang_once(trainer) -> None:
        def hook(phase: str, step: int) -> None:
            if (phase, step) == ("values", 4) and not hung:
                group = trainer.critic_wg
                assert group.timeout_s == 300  # trainer.phase_timeout_s: every call's bound
                group.timeout_s = 3  # this call cannot start: found hung in 3 s
                hung.append(group.workers[0].__ray_call__.remote(lambda self: __import__("time").sleep(600)))

        trainer.fault_hook = hook

    history, trainer = run(config(tiny_assets, data_dir, out, "trainer.phase_timeout_s=300"), setup=hang_once)
    assert hung and trainer.restarts == 1 and trainer.steps_redone == 1  # step 3 (done, then redone)
    assert trainer.critic_wg.timeout_s == 300  # the restarted groups: the config's bound again
    with pytest.raises(ray.exceptions.RayActorError):  # the sleeping process was killed by the restart
        ray.get(hung[0], timeout=30)
    assert_same_steps(baseline, history)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    tb = EventAccumulator(str(out / "tensorboard"))
    tb.Reload()
    scores = tb.Scalars("objective/scores")
    assert [e.step for e in scores] == [1, 2, 3, 4], [e.step for e in scores]
    assert [e.value for e in scores] == pytest.approx([h["objective/scores"] for h in baseline])


def test_a_nan_step_is_skipped_and_a_full_disk_ends_the_run_cleanly(ray_session, tiny_assets, data_dir, tmp_path):
    """Through the trainer, not only at function level: step 1's rewards are NaN (a scorer gone wrong), so
    its losses are non-finite and trainer.on_nan=skip drops both optimizer steps (actor and critic
    nan_skipped = 1) and the run goes on with a finite step 2; the output dir is a 4 MB disk (a real tmpfs,
    tests/small_disk.py: no privileges), so step 3's background checkpoint fills it (torch's writer says only
    "iostream error"): the run ends with one line naming the fix, and no step dir or temp dir is left to be
    mistaken for a checkpoint."""
    import errno

    from small_disk import small_disk

    from megappo.utils.tracking import read_metrics

    with small_disk(tmp_path / "disk", "4m") as disk:
        out = disk / "out"
        cfg = config(tiny_assets, data_dir, out, "trainer.save_every=3", "trainer.val_every=0",
                     "trainer.on_nan=skip", "trainer.export_hf=false", "trainer.max_restarts=0")

        def nan_at_step_1(trainer) -> None:
            score = trainer.reward_fn

            def reward_fn(batch):
                scores, metrics = score(batch)
                return (scores * float("nan"), metrics) if trainer._step == 1 else (scores, metrics)

            trainer.reward_fn = reward_fn

        with pytest.raises(OSError) as info:
            run(cfg, setup=nan_at_step_1)
        assert info.value.errno == errno.ENOSPC
        assert str(info.value).startswith("[Errno 28] checkpoint of step 3 not written: No space left on device")
        assert "point trainer.output_dir at a larger disk" in str(info.value) and "\n" not in str(info.value)
        rows = read_metrics(out)
        assert [r["step"] for r in rows] == [1, 2]  # step 3 ended in its save: not logged, redone on a rerun
        assert (rows[0]["actor/nan_skipped"], rows[0]["critic/nan_skipped"]) == (1.0, 1.0)
        assert rows[1]["actor/nan_skipped"] == 0.0 and math.isfinite(rows[1]["objective/loss"])
        left = sorted(str(p) for p in (out / "checkpoints").rglob("*"))
        assert left == [], left  # no step dir, no temp dir
