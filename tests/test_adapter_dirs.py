"""rollout.lora_sync=adapter writes each sync's adapter as a peft dir under /dev/shm (tmpfs: it holds
memory); atexit removes it, but not after SIGKILL or an OOM kill. The next run's first sync sweeps the dirs
whose process is gone and that no sync touched for an hour; a live run's dir and a fresh one stay."""

import os
import subprocess
import sys
import time

from megappo.workers.rollout.hybrid_engine import ADAPTER_DIR_PREFIX, sweep_adapter_dirs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_old_dirs_of_gone_processes(tmp_path):
    dead = _dead_pid()
    old = time.time() - 2 * 3600

    def make(name, mtime=None):
        d = tmp_path / name
        (d / "v1").mkdir(parents=True)
        (d / "v1" / "adapter_model.safetensors").write_bytes(b"x" * 1024)
        if mtime is not None:
            os.utime(d, (mtime, mtime))
        return d

    left = make(f"{ADAPTER_DIR_PREFIX}{dead}-abc123", old)
    live = make(f"{ADAPTER_DIR_PREFIX}{os.getpid()}-def456", old)
    fresh = make(f"{ADAPTER_DIR_PREFIX}{dead}-ghi789")  # a sync just wrote it (another pid namespace?)
    other = make(f"{ADAPTER_DIR_PREFIX}notapid", old)
    assert sweep_adapter_dirs(tmp_path) == [left]
    assert not left.exists() and live.exists() and fresh.exists() and other.exists()
