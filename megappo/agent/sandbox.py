"""Run code a model wrote, with limits. One child process per call:

    result = run_python("print(2 ** 10)", Limits(wall_s=5))   # SandboxResult(output='1024\\n', error=None, ...)

What confines the child (each line is something a test in tests/test_agent_tools.py tries to break):
- namespaces (util-linux `unshare`; unprivileged user namespaces, so it works as root and as a user):
  a new network namespace (only a loopback that is down: no socket reaches the host or beyond), a new
  PID namespace whose init is the child (when it ends, the kernel kills every process it forked),
  killed with the launcher (`--kill-child`), a new mount namespace in which every mount is remounted
  read-only (the run's files, /dev/shm where Ray and vLLM keep theirs) and a size-capped tmpfs is the
  working directory; the child checks that no other mount stayed writable and refuses to run the code
  otherwise. A machine that refuses namespaces gets an error result, never an unconfined run
  (`isolation_problem()`, which the config check calls before any worker starts);
- a seccomp filter (libseccomp via pyseccomp) loaded before the code runs: no new processes (fork,
  vfork, clone without CLONE_THREAD; clone3 answers ENOSYS so libc uses clone; threads still work) -
  a fork bomb gets EPERM at its first fork (RLIMIT_NPROC would not do: the kernel does not enforce it
  for uid 0, and a user namespace of root maps to uid 0) - and none of the calls that could undo the
  confinement from inside (mount, umount2, unshare, setns, chroot, pivot_root, ptrace, bpf, ...);
- rlimits: CPU seconds, address space (allocations past it raise MemoryError), file size, open files;
- a wall-clock timeout (the whole process group is killed), output read up to `max_output_bytes`
  (the child is killed past it: printing megabytes costs nothing), a fresh temporary working
  directory removed afterwards, an environment of PATH / LANG only (no secrets inherited), Python in
  isolated mode (-I: no user site, no PYTHON* variables, no cwd on sys.path).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512  # address space
    max_file_mb: int = 8
    max_output_bytes: int = 16384


@dataclass
class SandboxResult:
    output: str  # stdout + stderr, cut at max_output_bytes
    error: Optional[str]  # None: ran to completion with exit code 0; else a short reason
    timed_out: bool = False
    seconds: float = 0.0


# runs inside the namespaces, before the model's code: every mount read-only, a size-capped tmpfs as the
# working directory, the check that nothing else stayed writable (fail closed), the limits, then the
# code (read from stdin, so nothing of it is on a command line)
_BOOTSTRAP = r"""
import os, resource, subprocess, sys
workdir = sys.argv[1]
cpu, mem, fsize = (int(a) for a in sys.argv[2:5])
def mounts():
    top = {}
    for line in open("/proc/self/mountinfo"):
        f = line.split()
        top[f[4].encode().decode("unicode_escape")] = f[5].split(",")  # the last entry is the visible one
    return top
for point in mounts():
    subprocess.run(["mount", "-o", "remount,bind,ro", point], stderr=subprocess.DEVNULL)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%d,mode=700" % fsize, "tmpfs", workdir], check=True)
writable = [p for p, opts in mounts().items() if "ro" not in opts and p != workdir]
if writable:
    sys.exit("sandbox: could not make %s read-only" % writable)
os.chdir(workdir)
import signal
def _cpu_limit(*_, _write=os.write, _exit=os._exit):  # the soft limit: say so (unshare does not pass a
    _write(2, b"CPU time limit exceeded\n")                # signal death on cleanly); the hard one: SIGKILL
    _exit(152)
signal.signal(signal.SIGXCPU, _cpu_limit)
import errno, pyseccomp as sc
f = sc.SyscallFilter(defaction=sc.ALLOW)
for call in ("fork", "vfork", "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "ptrace",
             "process_vm_writev", "bpf", "perf_event_open", "keyctl", "add_key", "request_key"):
    f.add_rule(sc.ERRNO(errno.EPERM), call)
f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, 0x00010000, 0))  # no CLONE_THREAD: a process
f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags are behind a pointer: libc falls back to clone
f.load()
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, 64),
                    (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(what, (value, value))
code = sys.stdin.read()
sys.stdin = open(os.devnull)
sys.argv = ["<tool>"]
del os, resource, subprocess, sys, signal, errno, sc, f, call, mounts, workdir, cpu, mem, fsize, writable
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""

_UNSHARE = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]


@lru_cache(maxsize=None)
def isolation_problem() -> Optional[str]:
    """None when this machine can make the namespaces (checked once per process), else why not."""
    if shutil.which("unshare") is None:
        return "the `unshare` command (util-linux) is not installed"
    try:
        r = subprocess.run(_UNSHARE + ["true"], capture_output=True, timeout=10, start_new_session=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if r.returncode:
        return f"unshare refused: {r.stderr.decode(errors='replace').strip()[:200]}"
    return None


def run_python(code: str, limits: Limits = Limits()) -> SandboxResult:
    """Run `code` with `python -I` in a confined child (see the module docstring)."""
    problem = isolation_problem()
    if problem:  # never unconfined
        return SandboxResult("", f"sandbox unavailable: {problem}")
    workdir = tempfile.mkdtemp(prefix="megappo-tool-")  # the mount point of the child's tmpfs
    cmd = _UNSHARE + [sys.executable, "-I", "-c", _BOOTSTRAP, workdir, str(limits.cpu_s), str(limits.memory_mb << 20),
            str(limits.max_file_mb << 20)]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=workdir, env=env, start_new_session=True)
        return _collect(proc, code, limits, t0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc: subprocess.Popen, code: str, limits: Limits, t0: float) -> SandboxResult:
    """Feed the code, read at most max_output_bytes before the deadline, then kill the group."""
    import selectors

    try:
        proc.stdin.write(code.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out, error, timed_out = bytearray(), None, False
    deadline = t0 + limits.wall_s
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            timed_out, error = True, f"timed out after {limits.wall_s:g} s"
            break
        if not sel.select(timeout=min(left, 0.1)):
            continue
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        out += chunk
        if len(out) > limits.max_output_bytes:
            error = f"output longer than {limits.max_output_bytes} bytes: stopped"
            break
    _kill_group(proc)
    sel.close()
    proc.stdout.close()
    rc = proc.wait()
    if error is None and rc:
        error = _exit_reason(rc, limits)
    text = bytes(out[:limits.max_output_bytes]).decode(errors="replace")
    return SandboxResult(text, error, timed_out, time.perf_counter() - t0)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_reason(rc: int, limits: Limits) -> str:
    if rc < 0:
        sig = signal.Signals(-rc).name
        if -rc == signal.SIGXCPU:
            return f"CPU time limit ({limits.cpu_s} s) exceeded"
        return f"killed by {sig}"
    if rc == 152:  # the bootstrap's SIGXCPU handler
        return f"CPU time limit ({limits.cpu_s} s) exceeded"
    return f"exited with code {rc}"


__all__ = ["Limits", "SandboxResult", "run_python", "isolation_problem"]
