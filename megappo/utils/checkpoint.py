"""Atomic checkpoint directories: `<root>/step_<N>/`, written under a temp name, manifest last, then
renamed into place. A directory without a valid manifest (a crash mid-save, a copy cut short) is
"torn": `latest_checkpoint` skips it with a warning and resumes from the newest complete one.

    with atomic_checkpoint(root, step) as tmp:   # tmp: the directory to write into
        actor.save(tmp / "actor"); critic.save(tmp / "critic"); write_json(tmp / "trainer_state.json", state)
    # here: every file listed in tmp/MANIFEST.json, then tmp renamed to root/step_<N>

`PendingCheckpoint` is the same in two halves, for a save whose files are still being written in the
background when the call that started it returns (trainer.async_save).

The trainer's own state is JSON (never pickle); model/optimizer shards are megatron dist checkpoints.
`rng_state()` / `set_rng_state()` are every process's RNG states as JSON-able lists (the driver's and
each worker's go into a checkpoint; the hybrid engine keeps the trainer's around a rollout).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
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


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def software_stack() -> dict:
    """What wrote a checkpoint (recorded in its manifest; read back when a later install resumes it)."""
    return {"python": sys.version.split()[0], "torch": _version("torch"), "megatron-core": _version("megatron-core")}


def write_manifest(directory: Path, step: int) -> None:
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    sizes = {f: (directory / f).stat().st_size for f in files}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "time": time.time(), "stack": software_stack(), "files": sizes}, indent=1))
    os.replace(tmp, directory / MANIFEST)


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def megatron_format_problem(directory: str | os.PathLike, installed: str | None) -> str | None:
    """Why megatron-core `installed` cannot read the megatron dist checkpoints under `directory`, in one
    line, or None. megatron-core 0.17+ writes the common (non-sharded) state inside the DCP files and no
    `common.pt`; 0.16 and older require `common.pt` (docs/ENVIRONMENT.md, "Moving to Python 3.12"). The
    other direction works: 0.19 still reads 0.16's checkpoints."""
    directory = Path(directory)
    if installed is None or _minor(installed) >= (0, 17):
        return None
    newer = sorted(str(m.parent) for m in directory.rglob("metadata.json")
                   if (m.parent / ".metadata").is_file() and not (m.parent / "common.pt").exists())
    if not newer:
        return None
    try:
        wrote = json.loads((directory / MANIFEST).read_text()).get("stack", {}).get("megatron-core") or ">= 0.17"
    except (OSError, ValueError):
        wrote = ">= 0.17"
    return (f"{newer[0]} was written by megatron-core {wrote} (no common.pt), which megatron-core {installed} "
            f"cannot read: run `make install` (Python 3.12 + megatron-core 0.19.2) to resume it, or resume from "
            f"a checkpoint written before the upgrade")


def is_dist_checkpoint(path) -> bool:
    """A megatron dist_checkpointing dir (metadata.json) without HF safetensors."""
    p = Path(path)
    return (p / "metadata.json").exists() and not any(p.glob("*.safetensors"))


# ---- LoRA adapter checkpoints (actor.lora: the actor's checkpoint holds the adapters only) ----------------

LORA_META = "lora.json"  # in an adapter checkpoint: rank, alpha, targets, experts, the base it belongs to, format
LORA_FORMAT = 2  # lora.json's "format": linear_fc1's B saved as gate and up halves, the same files at every TP
# (format 1 held the TP-rank layout [gate; up] per rank and needed the TP it was saved at)
_NOT_THE_MODEL = ("transformers_version", "_name_or_path")  # config.json keys a re-save may change


def base_identity(model_path, legacy: bool = False) -> str:
    """A short hash of a HF model dir: its config (the keys that describe the model), its weight files'
    names and sizes, and the first and last 64 KiB of each file's tensor data (two models of one shape,
    e.g. a base and its instruct tune, differ there): an adapter checkpoint belongs to this base (cheap).
    `legacy`: config.json's bytes and the files' names and sizes only, as adapter checkpoints saved before
    2026-11-27 recorded it."""
    import hashlib

    p = Path(model_path)
    raw = (p / "config.json").read_bytes() if (p / "config.json").exists() else b""
    if not legacy and raw:
        config = {k: v for k, v in json.loads(raw).items() if k not in _NOT_THE_MODEL}
        raw = json.dumps(config, sort_keys=True).encode()
    h = hashlib.sha256(raw)
    for f in sorted(p.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        if not legacy:
            with open(f, "rb") as fh:  # safetensors: u64 header size, header, data (not one: its size is hashed)
                start = min(size, 8 + int.from_bytes(fh.read(8), "little"))
                fh.seek(start)
                h.update(fh.read(1 << 16))
                fh.seek(max(start, size - (1 << 16)))
                h.update(fh.read())
    return h.hexdigest()[:16]


def is_base_of(identity: str, model_path) -> bool:
    """An adapter checkpoint's recorded base `identity` is the HF dir `model_path` (either form of base_identity)."""
    return identity in (base_identity(model_path), base_identity(model_path, legacy=True))


def lora_checkpoint_meta(lora, model_path) -> dict:
    """What an adapter checkpoint is only valid with (its lora.json): the adapter's shape (`lora`: actor.lora
    or a models.lora.LoraConfig) and the base it was trained on."""
    return {"rank": int(lora.rank), "alpha": float(lora.alpha), "target_modules": list(lora.target_modules),
            "experts": bool(lora.experts), "base": base_identity(model_path), "format": LORA_FORMAT}


def lora_checkpoint_problem(path, lora, model_path) -> str | None:
    """Why the engine checkpoint dir `path` (a run's checkpoints/step_N/actor) cannot be loaded by an actor
    with `lora` (None or rank 0: full fine-tuning) on the base `model_path`; None when it can. Targets compare
    as a set; the base by identity (base_identity, either form)."""
    meta_file = Path(path) / LORA_META
    if lora is None or not lora.rank:
        if meta_file.exists():
            return f"{path} holds LoRA adapters only ({LORA_META}); load it with the actor.lora it was saved with"
        return None
    if not meta_file.exists():
        return (f"{path} is not a LoRA adapter checkpoint (no {LORA_META}): it was saved with actor.lora.rank=0; "
                "resume with that, or start the LoRA run afresh")
    saved, want = json.loads(meta_file.read_text()), lora_checkpoint_meta(lora, model_path)
    saved.setdefault("experts", False)  # saved before routed experts could be adapted
    same = {"target_modules": lambda a, b: sorted(a or []) == sorted(b),
            "base": lambda a, b: is_base_of(a, model_path)}
    diff = [k for k in want if not same.get(k, lambda a, b: a == b)(saved.get(k), want[k])]
    if not diff:
        return None
    theirs = [f"{k}={saved.get(k)!r}" for k in diff if k != "base"] + (["another base"] if "base" in diff else [])
    mine = [f"{k}={want[k]!r}" for k in diff if k != "base"] + ([f"model.path {model_path}"] if "base" in diff else [])
    return (f"{path}: the adapter checkpoint's {', '.join(theirs)} != this run's {', '.join(mine)}; use the "
            "model.path and actor.lora it was saved with")


def is_complete(directory: Path) -> bool:
    """The manifest exists, parses, and every file it lists exists with its recorded size."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        return all((directory / f).is_file() and (directory / f).stat().st_size == size
                   for f, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


class PendingCheckpoint:
    """`<root>/step_<N>/` being written: files go into `tmp`; `commit()` writes the manifest and renames
    it into place; `abort()` removes it. Between the two it may outlive a training step (the workers
    write their shards in a background thread); a crash before `commit()` leaves no step dir."""

    def __init__(self, root: str | os.PathLike, step: int):
        self.root, self.step = Path(root), step
        self.root.mkdir(parents=True, exist_ok=True)
        self.final = step_dir(self.root, step)
        self.tmp = self.root / f".tmp-{self.final.name}-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()

    def commit(self) -> Path:
        write_manifest(self.tmp, self.step)
        _fsync_dir(self.tmp)
        if self.final.exists():  # re-saving a step (e.g. after a resume): replace it whole
            shutil.rmtree(self.final)
        os.rename(self.tmp, self.final)
        _fsync_dir(self.root)
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_checkpoint(root: str | os.PathLike, step: int):
    ckpt = PendingCheckpoint(root, step)
    try:
        yield ckpt.tmp
        ckpt.commit()
    except BaseException:
        ckpt.abort()
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


@contextlib.contextmanager
def preserved_rng():
    """Run a block (e.g. vLLM, which reseeds the global RNGs) without changing this process's RNGs."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def rng_state() -> dict:
    """This process's RNG states as JSON-able lists: python, numpy, torch (CPU), every CUDA device
    when there is one, and megatron's model-parallel RNG tracker when this process has one."""
    import random

    import numpy as np
    import torch

    py, np_state = random.getstate(), np.random.get_state()
    state = {"torch": torch.get_rng_state().tolist(), "python": list(py[1]), "python_pos": py[2],
             "numpy": np_state[1].tolist(), "numpy_pos": int(np_state[2])}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    # a process that never imported megatron has no tracker (the driver: importing it costs ~2 s)
    tensor_parallel = sys.modules.get("megatron.core.tensor_parallel")
    try:
        tracker = tensor_parallel.get_cuda_rng_tracker().get_states() if tensor_parallel else None
        if tracker:
            state["tracker"] = {k: v.tolist() for k, v in tracker.items()}
    except Exception:  # noqa: BLE001 - no megatron (or no tracker) in this process
        pass
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state()` returned (keys it did not record are left alone)."""
    import random

    import numpy as np
    import torch

    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8, device="cpu"))  # RNG states are CPU bytes
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8, device="cpu") for s in state["cuda"]])
    if state.get("tracker"):
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(
            {k: torch.tensor(v, dtype=torch.uint8, device="cpu") for k, v in state["tracker"].items()})
