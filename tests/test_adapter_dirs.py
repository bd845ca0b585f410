"""rollout.lora_sync=adapter writes each sync's adapter as a peft dir under /dev/shm (tmpfs: it holds
memory). The worker group's shutdown removes it (Worker.release, before Ray's kill, which skips atexit);
an exit runs atexit. Neither runs after SIGKILL or an OOM kill: the next run's first sync sweeps the dirs
whose process is gone and that no sync touched for an hour; a live run's dir and a fresh one stay."""

import os
import subprocess
import sys
import time

from megappo.workers.rollout.adapter_dirs import ADAPTER_DIR_PREFIX, sweep_adapter_dirs


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


def test_worker_release_runs_each_callback_once_past_a_failing_one(monkeypatch):
    """Worker.release (what a worker group calls before Ray's kill, which skips atexit): every callback runs
    once, in reverse order of registration; one that raises does not stop the rest."""
    from megappo.controller.worker import Worker

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ""}.items():
        monkeypatch.setenv(k, v)  # restored after the test (Worker picks and exports a port)
    w = Worker()
    ran = []
    w.on_release += [lambda: ran.append("first"), lambda: 1 / 0, lambda: ran.append("last")]
    assert w.release() == 2 and ran == ["last", "first"]
    assert w.release() == 0 and ran == ["last", "first"]
