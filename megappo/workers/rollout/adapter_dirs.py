"""rollout.lora_sync=adapter: the versioned peft dirs a vLLM engine loads the policy's adapters from.

    dirs = AdapterDirs()
    path = dirs.write(adapter, lora_cfg, base_path)     # {HF module: (A, B)} -> <root>/v{version}
    rollout.load_adapter(path, dirs.version)
    dirs.close()                                        # at shutdown (Worker.release)

One dir per process on tmpfs (/dev/shm, else the temp dir), a version dir per sync; the one before the
previous is removed (vLLM reads a dir at the first request that uses its version). Used by the hybrid
engine (the actor's own vLLM) and by a rollout pool's WeightReceiver (async mode).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

ADAPTER_DIR_PREFIX = "megappo-lora-"  # + "{pid}-{random}" under /dev/shm: one per process, per run


def sweep_adapter_dirs(root: Path, older_than_s: float = 3600.0) -> list[Path]:
    """Remove the adapter dirs a killed process left in `root` (atexit does not run on SIGKILL or an OOM kill):
    those whose process is gone and that no sync touched for `older_than_s` (another container sharing
    /dev/shm has its own pids; a live run writes a new version dir every sync). Returns what was removed."""
    removed = []
    for d in root.glob(ADAPTER_DIR_PREFIX + "*-*"):
        try:
            pid = int(d.name[len(ADAPTER_DIR_PREFIX):].split("-")[0])
            if time.time() - d.stat().st_mtime < older_than_s:
                continue
            os.kill(pid, 0)
        except ProcessLookupError:  # no such process: left behind
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        except (ValueError, OSError):  # another naming, alive under another user, or already gone
            continue
    return removed


class AdapterDirs:
    def __init__(self):
        self.root: Optional[Path] = None
        self.version = 0

    def write(self, adapter: dict, lora_cfg, base_path) -> Path:
        """The next version's peft dir with `adapter` ({HF module: (A, B)}, peft's layout)."""
        from megappo.models.lora_peft import save_peft_adapter

        if self.root is None:
            shm = Path("/dev/shm")
            parent = shm if shm.is_dir() else Path(tempfile.gettempdir())
            sweep_adapter_dirs(parent)
            self.root = Path(tempfile.mkdtemp(prefix=f"{ADAPTER_DIR_PREFIX}{os.getpid()}-", dir=parent))
            atexit.register(shutil.rmtree, self.root, True)  # the group's shutdown calls close
        self.version += 1
        path = self.root / f"v{self.version}"
        save_peft_adapter(adapter, lora_cfg, base_path, path)
        shutil.rmtree(self.root / f"v{self.version - 2}", ignore_errors=True)  # vLLM read it
        return path

    def close(self) -> None:
        """Remove this process's dir: /dev/shm is memory."""
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
