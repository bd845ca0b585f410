"""Atomic checkpoint directories: `<root>/step_<N>/`, written under a temp name, manifest last, then
renamed into place. A directory without a valid manifest (a crash mid-save, a copy cut short) is
"torn": `latest_checkpoint` skips it with a warning and resumes from the newest complete one.

    with atomic_checkpoint(root, step) as tmp:   # tmp: the directory to write into
        actor.save(tmp / "actor"); critic.save(tmp / "critic"); write_json(tmp / "trainer_state.json", state)
    # here: every file listed in tmp/MANIFEST.json, then tmp renamed to root/step_<N>

The trainer's own state is JSON (never pickle); model/optimizer shards are megatron dist checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

MANIFEST = "MANIFEST.json"
log = logging.getLogger(__name__)


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, step: int) -> None:
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    sizes = {f: (directory / f).stat().st_size for f in files}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "time": time.time(), "files": sizes}, indent=1))
    os.replace(tmp, directory / MANIFEST)


def is_complete(directory: Path) -> bool:
    """The manifest exists, parses, and every file it lists exists with its recorded size."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        return all((directory / f).is_file() and (directory / f).stat().st_size == size
                   for f, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def atomic_checkpoint(root: str | os.PathLike, step: int):
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        write_manifest(tmp, step)
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete `step_*` dir under root; torn ones are skipped with a warning."""
    root = Path(root)
    if not root.is_dir():
        return None
    for d in sorted(root.glob("step_*"), reverse=True):
        if is_complete(d):
            return d
        log.warning("skipping torn checkpoint %s (no valid %s); resuming from an older one", d, MANIFEST)
    return None


def read_step(directory: Path) -> int:
    return int(json.loads((Path(directory) / MANIFEST).read_text())["step"])
