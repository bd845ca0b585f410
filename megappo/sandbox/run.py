"""Run code a model wrote, confined. One sandbox per call:

    result = run_python("print(2 ** 10)", Limits(wall_s=5))   # SandboxResult(output='1024\\n', error=None, ...)

What the code sees and may do (docs/SANDBOX.md is the threat model; tests/test_sandbox.py tries each escape,
after showing that its payload works unconfined):
- **a minimal world**: a fresh root holding the interpreter and its standard library, the allowed packages
  (ALLOWED_PACKAGES), the system's shared libraries, a /dev of null/zero/random/urandom, its own /proc, and
  a size-capped noexec tmpfs at /tmp as the working directory and HOME. Nothing of the host's /work, /home,
  /root, /tmp, /dev/shm, /run or /var: no checkout, data, checkpoints, sockets or credentials. Every mount
  but /tmp is read-only and locked (pivot_root, then a nested user namespace: see child.py);
- **its own namespaces**: user (root of it maps to an unprivileged host uid of its own per call where the
  worker is root), mount, network (a downed loopback only), PID (the code is the namespace's init: when
  the call ends the launcher kills it through a pidfd, and the kernel kills everything else in it,
  whatever it did with setsid, death signals or signal handlers), IPC (no System V object outlives the
  call), UTS and cgroup;
- **an allow-list of system calls** (megappo/sandbox/syscalls.py): no processes, no exec, no sockets but a
  socketpair, no mount calls of either API, no namespaces, keyrings, io_uring, userfaultfd, bpf, ptrace;
- **limits for the whole call**: CPU seconds over all its threads (RLIMIT_CPU counts the process, every
  thread), memory = the address space (RLIMIT_AS; shared memory cannot be made: SysV and memfd are
  refused, there is no /dev/shm) + the tmpfs's size cap, a thread count (RLIMIT_NPROC on the call's own
  uid: enforced where the worker is root, which gives each call its own uid; otherwise not enforced), open
  files, a wall-clock timeout and an output cap. cgroup v2 is not used: this machine's is not delegated
  (a v1/v2 hybrid with no v2 controllers), and rlimits enforce the same bounds per call;
- an environment of PATH / LANG / HOME only; Python in isolated mode (-I -S).

A machine that cannot build this gets an error result, never an unconfined run (`isolation_problem()`,
which `megappo config check` calls before any worker starts).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

ALLOWED_PACKAGES = ("numpy", "sympy", "mpmath")  # importable inside, read-only; the standard library always is
_CHILD_SOURCE = (Path(__file__).with_name("child.py")).read_text()
_UID_BASE = 0x4D500000  # per-call host uids (and gids) when the worker is root: 2^20 of them above this
_UIDS = 1 << 20
# one lock file per uid a live call holds (flock: released when the call ends or its process dies), machine-wide
_LEASE_DIR = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / "megappo-sandbox-uids"


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0
    cpu_s: int = 5  # CPU seconds, all threads together
    memory_mb: int = 512  # address space
    max_file_mb: int = 8  # the working tmpfs: all files together (and any one file)
    max_output_bytes: int = 16384
    max_threads: int = 16  # enforced where the worker is root (each call its own uid)


@dataclass
class SandboxResult:
    output: str  # stdout + stderr, cut at max_output_bytes
    error: Optional[str]  # None: ran to completion with exit code 0; else a short reason
    timed_out: bool = False
    seconds: float = 0.0
    cpu_s: float = 0.0  # user + system time of the whole call
    max_rss_mb: float = 0.0


class _SetupError(Exception):
    pass


@dataclass(frozen=True)
class _World:
    binds: tuple  # (host path, path inside, is a directory)
    empty: tuple  # paths inside that get an empty read-only mount
    symlinks: tuple  # (path inside, target)


@lru_cache(maxsize=None)
def _world() -> _World:
    """What the child's root is made of, from this interpreter's own installation."""
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = sysconfig.get_paths()["stdlib"]
    binds = [(os.path.realpath(sys.executable), "/opt/python/bin/python3", False), (stdlib, f"/opt/python/lib/{ver}", True)]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        lib = os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME"))
        binds.append((os.path.realpath(lib), "/opt/python/lib/" + os.path.basename(lib), False))
    dynload = os.path.dirname(importlib.util.find_spec("_json").origin)
    if not dynload.startswith(stdlib + os.sep):
        raise _SetupError(f"the standard library's extension modules ({dynload}) are outside {stdlib}")
    for name in ALLOWED_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        path = spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin
        binds.append((path, f"/opt/packages/{os.path.basename(path)}", os.path.isdir(path)))
        if os.path.isdir(path + ".libs"):  # the shared libraries a wheel vendors (numpy's OpenBLAS)
            binds.append((path + ".libs", f"/opt/packages/{name}.libs", True))
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    symlinks = [(top, os.readlink(top)) for top in ("/lib", "/lib64", "/lib32") if os.path.islink(top)]
    for d in ("/lib/" + multiarch, "/usr/lib/" + multiarch, "/lib64", "/usr/lib64"):
        if os.path.isdir(d) and os.path.realpath(d) == d:  # a real directory, not one seen through a link
            binds.append((d, d, True))
    empty = [f"/opt/python/lib/{ver}/site-packages"] if os.path.isdir(os.path.join(stdlib, "site-packages")) else []
    return _World(tuple(binds), tuple(empty), tuple(symlinks))


@contextlib.contextmanager
def uid_lease(lease_dir: Path = _LEASE_DIR):
    """A host uid that no other live call on this machine holds, for as long as the block runs: RLIMIT_NPROC
    counts a uid's processes machine-wide, so two calls sharing one would share its thread budget. The lowest
    free one (the lock files stay as few as the calls that ever ran at once); a process that dies frees its own."""
    lease_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for n in range(_UIDS):
        fd = os.open(lease_dir / str(n), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live call holds it
            os.close(fd)
            continue
        try:
            yield _UID_BASE + n
        finally:
            os.close(fd)
        return
    raise _SetupError(f"all {_UIDS} sandbox uids are held by live calls")


@contextlib.contextmanager
def _identity(limits: Limits):
    """(host uid, gid the sandbox's root maps to, its RLIMIT_NPROC; 0: not enforceable) for one call."""
    if os.geteuid() != 0:
        yield os.geteuid(), os.getegid(), 0
        return
    with uid_lease() as uid:  # an unprivileged uid of the call's own: an escape is nobody, and threads count
        yield uid, uid, limits.max_threads + 2  # + the outer stage and the main thread


_built = False  # a probe succeeded in this process


def isolation_problem() -> Optional[str]:
    """None when this machine can build the sandbox (one real call), else why not. A success is remembered for
    the process; a failure is tried once more at once and again at the next call, never remembered (a probe
    that failed once on a loaded machine disabled the python tool for the rest of the process)."""
    global _built
    if not _built:
        problem = _probe() and _probe()
        if problem:
            return problem
        _built = True
    return None


def _probe() -> Optional[str]:
    try:
        r = _run("print('ok')", Limits(wall_s=20, cpu_s=10))
    except _SetupError as e:
        return str(e)
    if r.error is None and r.output == "ok\n":
        return None
    said = r.output.strip().splitlines()
    return f"{r.error}: {said[-1][:300]}" if said else str(r.error)  # one line


def run_python(code: str, limits: Limits = Limits()) -> SandboxResult:
    """Run `code` in the sandbox (see the module docstring); never unconfined."""
    problem = isolation_problem()
    if problem:
        return SandboxResult("", f"sandbox unavailable: {problem}")
    try:
        return _run(code, limits)
    except _SetupError as e:
        return SandboxResult("", f"sandbox setup failed: {e}")


def _run(code: str, limits: Limits) -> SandboxResult:
    with _identity(limits) as (uid, gid, nproc):  # held until the call's processes are gone (_end)
        return _run_as(code, limits, uid, gid, nproc)


def _run_as(code: str, limits: Limits, uid: int, gid: int, nproc: int) -> SandboxResult:
    from megappo.sandbox.syscalls import build_filter

    t0 = time.perf_counter()
    deadline = t0 + limits.wall_s
    world, program = _world(), build_filter()
    ctl_r, ctl_w = os.pipe()
    st_r, st_w = os.pipe()
    cfg = {"ctl": ctl_r, "status": st_w, "root": "/tmp" if os.path.isdir("/tmp") else "/mnt",
           "binds": [list(b) for b in world.binds],
           "empty": list(world.empty), "symlinks": [list(s) for s in world.symlinks], "source": _CHILD_SOURCE,
           "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_mb << 20, "tmpfs_bytes": limits.max_file_mb << 20,
           "nproc": nproc}
    try:
        proc = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", "-S", "-c", _CHILD_SOURCE, "outer", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(ctl_r, st_w),
            cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True,
            extra_groups=[] if os.geteuid() == 0 else None)
    finally:
        os.close(ctl_r)
        os.close(st_w)
    pidfd = None
    try:
        pidfd = _handshake(proc, ctl_w, st_r, uid, gid, deadline)
        if pidfd is None:
            out = proc.stdout.read(limits.max_output_bytes).decode(errors="replace")
            proc.wait()
            raise _SetupError(out.strip().splitlines()[-1] if out.strip() else f"exit code {proc.returncode}")
        try:
            proc.stdin.write(b"%d\n" % len(program) + program + code.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        return _collect(proc, pidfd, st_r, limits, t0)
    finally:
        _end(proc, pidfd, st_r)
        os.close(ctl_w)
        os.close(st_r)


def _handshake(proc, ctl_w: int, st_r: int, uid: int, gid: int, deadline: float) -> Optional[int]:
    """Map the child's user namespace, then take a pidfd of its PID namespace's init. None: the child died."""
    if _read_status(st_r, deadline, b"U") != b"U":
        return None
    for name, text in (("uid_map", f"0 {uid} 1"), ("setgroups", "deny"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/{proc.pid}/{name}", "w") as f:
            f.write(text)
    os.write(ctl_w, b"G")
    line = _read_status(st_r, deadline, b"\n")
    if not line.startswith(b"C"):
        return None
    pidfd = os.pidfd_open(int(line[1:]))  # not yet reapable: the outer stage waits for the next byte
    os.write(ctl_w, b"A")
    return pidfd


def _read_status(fd: int, deadline: float, until: bytes) -> bytes:
    out = b""
    while not out.endswith(until):
        left = deadline - time.perf_counter()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise _SetupError("the sandbox did not start in time")
        chunk = os.read(fd, 1)
        if not chunk:
            return out
        out += chunk
    return out


def _collect(proc: subprocess.Popen, pidfd: int, st_r: int, limits: Limits, t0: float) -> SandboxResult:
    """Read at most max_output_bytes before the deadline; then end the call (_end) and say how it ended."""
    out, error, timed_out = bytearray(), None, False
    deadline = t0 + limits.wall_s
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            timed_out, error = True, f"timed out after {limits.wall_s:g} s"
            break
        if not select.select([fd], [], [], min(left, 0.1))[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
        if len(out) > limits.max_output_bytes:
            error = f"output longer than {limits.max_output_bytes} bytes: stopped"
            break
    rc, (cpu_s, max_rss_mb) = _end(proc, pidfd, st_r)
    if error is None and rc:
        error = _exit_reason(rc, limits)
    text = bytes(out[:limits.max_output_bytes]).decode(errors="replace")
    return SandboxResult(text, error, timed_out, time.perf_counter() - t0, cpu_s, max_rss_mb)


def _end(proc: subprocess.Popen, pidfd: Optional[int], st_r: int):
    """Kill the PID namespace's init (the kernel then kills everything in the namespace), reap the outer
    stage (which reaps the init and reports its usage), and return the exit code and (CPU s, peak MB)."""
    if proc.returncode is not None:
        return proc.returncode, (0.0, 0.0)
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(pidfd)
    end = time.perf_counter() + 2.0
    while True:
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > end:  # the outer stage is trusted code; this is only a backstop
            proc.kill()
            _, status = os.waitpid(proc.pid, 0)
            break
        time.sleep(0.002)
    proc.returncode = os.waitstatus_to_exitcode(status)
    report = os.read(st_r, 256) if select.select([st_r], [], [], 0)[0] else b""
    usage = tuple(float(x) for x in report.split()[1:3]) if report.startswith(b"R ") else (0.0, 0.0)
    for f in (proc.stdin, proc.stdout):
        if f and not f.closed:
            try:
                f.close()
            except BrokenPipeError:
                pass
    return proc.returncode, usage


def _exit_reason(rc: int, limits: Limits) -> str:
    if rc < 0:
        if -rc == signal.SIGXCPU:
            return f"CPU time limit ({limits.cpu_s} s) exceeded"
        return f"killed by {signal.Signals(-rc).name}"
    if rc == 152:  # the tool stage's SIGXCPU handler
        return f"CPU time limit ({limits.cpu_s} s) exceeded"
    return f"exited with code {rc}"


__all__ = ["ALLOWED_PACKAGES", "Limits", "SandboxResult", "run_python", "isolation_problem"]
