"""The trainer's checkpoint half: save (at once, or in the background while the next step trains), make
whole, resume, export; and what the driver itself needs to resume (trainer_state.json).

`<output_dir>/checkpoints/step_N/` is atomic (utils/checkpoint.PendingCheckpoint: a temp dir, MANIFEST.json
last, a rename): actor/ and critic/ (megatron dist checkpoints: model + optimizer + LR schedule, with the
HF config and tokenizer next to them, so a checkpoint exports on its own), rng/ (every worker's RNG),
trainer_state.json (step, sampler position, KL controller, the driver's RNG; JSON, never pickle). A
failed save removes its temp dir once every worker's writer has ended; a full disk is one line naming
the fix.

`CheckpointingMixin` is mixed into RayPPOTrainer; it reads the trainer's groups, sampler, KL controller
and counters, and is the only code that writes or reads checkpoints on the driver.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Optional

from megappo.utils.checkpoint import (PendingCheckpoint, is_complete, latest_checkpoint, megatron_format_problem,
                                     rng_state, set_rng_state, software_stack, step_dir)


class CheckpointingMixin:
    def _trained_groups(self) -> list:
        """The groups holding the actor and the critic, each once (they may be one colocated group)."""
        return list({id(g): g for g in (self.actor_wg, self.critic_wg) if g is not None}.values())

    def _saves_at(self, step: int) -> bool:
        t = self.config.trainer
        last = step == t.total_steps
        return bool(t.save_every and (step % t.save_every == 0 or last)) or (last and t.export_hf)

    def save_checkpoint(self, step: int, wait: bool = True) -> None:
        """Checkpoint `step` into a temp dir; `wait=False` returns once every worker has copied its
        tensors (their threads write the files) and `finish_checkpoint()` makes it whole later."""
        self.finish_checkpoint()
        m = self.config.model
        ckpt = self._unfinished = PendingCheckpoint(self.ckpt_root, step)
        with self._checkpoint_errors(step):
            _wait_all([g.submit("save_checkpoint", str(ckpt.tmp), not wait) for g in self._trained_groups()])
            # each role's HF config + tokenizer next to its tensors: the checkpoint exports on its own
            from megappo.conversion.core import copy_hf_files

            copy_hf_files(Path(m.path), ckpt.tmp / "actor", Path(m.tokenizer or m.path))
            if self.critic_wg is not None:
                copy_hf_files(Path(m.critic_path or m.path), ckpt.tmp / "critic", Path(m.tokenizer or m.path))
            (ckpt.tmp / "trainer_state.json").write_text(json.dumps(self._driver_state(step)))
        self._sampler_before = {k: v for k, v in self._sampler_before.items() if k > step}
        if wait:
            self.finish_checkpoint()

    def finish_checkpoint(self) -> None:
        """The pending checkpoint's files whole on every worker, then its manifest: a complete step dir."""
        ckpt = self._unfinished
        if ckpt is None:
            return
        with self._checkpoint_errors(ckpt.step):
            _wait_all([g.submit("finish_checkpoint") for g in self._trained_groups()])
            ckpt.commit()
        self._unfinished = None
        self._saved_steps.append(ckpt.step)

    def _abandon_checkpoint(self) -> None:
        if self._unfinished is not None:
            self._unfinished.abort()
            self._unfinished = None

    @contextlib.contextmanager
    def _checkpoint_errors(self, step: int):
        """A failed save removes its temp dir; a full disk is said in one line naming the fix."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - say what it means for the run
            cause = _os_error_behind(e)
            if (cause is None or cause.errno is None) and _disk_nearly_full(self.ckpt_root):
                # torch's C++ writer reports a full disk as "basic_ios::clear: iostream error" (no errno;
                # megatron-core 0.19's writer passes it on as an OSError without one): read the disk
                # before the temp dir is removed (which frees it again)
                cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._abandon_checkpoint()
            if cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT):
                raise checkpoint_disk_full(step, self.ckpt_root, cause) from e
            raise

    def _driver_state(self, step: int) -> dict:
        """What the driver itself needs to resume after `step`: the sampler's position before the
        next step's prompts, the KL controller, its RNG (trainer_state.json; JSON, never pickle)."""
        state = {"step": step, "sampler": self._sampler_before.get(step + 1, self.sampler.state_dict()),
                 "kl_ctrl": self.kl_ctrl.state_dict(), "rng": rng_state()}
        if self.stream is not None:  # fully_async: where the groups not yet trained start (regenerated on resume)
            state["sampler"], state["fully_async"] = self.stream.state_dict()
        return state

    def _load_driver_state(self, state: dict) -> None:
        self.global_step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        set_rng_state(state["rng"])
        self._sampler_before = {}
        self._stream_resume = state.get("fully_async")  # read by the next GroupStream

    def export_final(self, step: int) -> Path:
        """The step's policy as a plain HF dir: <output_dir>/hf_final (megappo export)."""
        from megappo.export import export_checkpoint

        out = self.output_dir / "hf_final"
        info = export_checkpoint(step_dir(self.ckpt_root, step), out, overwrite=True, progress=False)
        print(f"exported the final policy (step {step}) to {out}", flush=True)
        if isinstance(info, dict) and info.get("adapter_skipped"):
            print(f"no peft adapter beside it: {info['adapter_skipped']}", flush=True)
        return out

    def _resume(self) -> Optional[Path]:
        """Load the checkpoint to continue from: trainer.resume (auto: the newest complete one; never;
        a path); after a restart the newest this process wrote first. With none, a restarted run goes
        back to the start (its fresh workers hold the initial weights)."""
        mode = self.config.trainer.resume
        path = None
        if self.restarts:
            done = [step_dir(self.ckpt_root, s) for s in sorted(self._saved_steps, reverse=True)]
            path = next((d for d in done if is_complete(d)), None)
        if path is None and mode != "never":
            path = latest_checkpoint(self.ckpt_root) if mode == "auto" else Path(mode)
            if path is not None and not is_complete(path):
                raise ValueError(f"trainer.resume={mode}: {path} is not a complete checkpoint (no valid MANIFEST.json)")
        if path is None:
            if self.restarts:
                self._load_driver_state(self._initial_state)
            return None
        problem = megatron_format_problem(path, software_stack()["megatron-core"])
        if problem:
            raise ValueError(f"trainer.resume={mode}: {problem}")
        for c in [g.submit("load_checkpoint", str(path)) for g in self._trained_groups()]:
            c.result()
        self._load_driver_state(json.loads((path / "trainer_state.json").read_text()))
        print(f"resumed from {path} at step {self.global_step}", flush=True)
        return path


def _os_error_behind(err: BaseException) -> Optional[OSError]:
    """The OSError a (Ray- / megatron-wrapped) exception was caused by, if any: the first in the chain
    with an errno (Ray's RayTaskError(OSError) is an OSError without one; its `cause` has it)."""
    seen, found = set(), None
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            if err.errno is not None:
                return err
            found = found or err
        seen.add(id(err))
        err = getattr(err, "cause", None) or err.__cause__ or err.__context__
    return found


def _disk_nearly_full(path, min_free: int = 1 << 20) -> bool:
    """Less than `min_free` bytes left for this user on the filesystem holding `path` (or its nearest
    existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize < min_free


def checkpoint_disk_full(step: int, root, cause: OSError) -> OSError:
    """The one line a full disk during a save deserves (the temp dir is gone; older checkpoints are whole)."""
    return OSError(cause.errno, f"checkpoint of step {step} not written: {cause.strerror} under {root}; free space "
                   "there or point trainer.output_dir at a larger disk (the previous checkpoints are intact)")


def _wait_all(calls: list, settle_s: float = 60.0) -> None:
    """Every group call's result. After an error raised by a live worker (a full disk, say) every rank of
    every call first runs to its end (at most settle_s): a checkpoint writer still running would put
    files into the temp dir the failure is about to remove, and leave a stray `.tmp-step_*` behind. A
    dead or hung worker (WorkerError) raises at once: the restart must not wait for its peers."""
    from megappo.controller.resource_pool import WorkerError

    error = None
    for c in calls:
        try:
            c.result()
        except Exception as e:  # noqa: BLE001 - re-raised below
            error = error or e
    if error is not None:
        if not isinstance(error, WorkerError):
            for c in calls:
                c.settle(settle_s)
        raise error
