"""The python tool's sandbox (megappo/sandbox/run.py), attacked the way code written by a policy could.

Each escape is a payload that is first run unconfined (a plain interpreter in a throwaway directory, or
inside the confinement the sandbox had before issue #37: a user + mount namespace with read-only
remounts, killed by process group) to show that it does what it claims, and then through `run_python`,
the tool's own call path, where it must be stopped. A payload that stopped working therefore fails its
test instead of passing as a held line. Nothing here is skipped: a machine that cannot build the
sandbox fails this module (CI must not go green with the sandbox untested).
"""

import ctypes
import os
import re
import secrets
import signal
import socket
import subprocess
import sys

import pytest

from megappo.sandbox.run import Limits, isolation_problem, run_python
from megappo.sandbox.syscalls import REFUSED
from waiting import wait_for

# the wall clock bounds the sandbox's start too (namespaces, mounts, the interpreter): a call that must finish gets
# a bound no busy machine reaches (a trivial call took 4.6 s with other suites on the 2 cores); a test of the wall
# limit itself sets its own, from a control call (test_a_sleeping_call_is_stopped_at_the_wall_clock_limit)
LIMITS = Limits(wall_s=120, cpu_s=2, memory_mb=512, max_output_bytes=8192)


def unconfined(code: str, cwd, timeout: float = 120, old_namespaces: bool = False) -> str:
    """Run `code` with a plain interpreter in `cwd`; old_namespaces: inside `unshare --user --map-root-user
    --mount` with `cwd` bind-mounted read-only first (the pre-#37 confinement of the run's files)."""
    cmd = [sys.executable, "-I", "-c", code]
    if old_namespaces:
        d = str(cwd)
        cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
               f'mount --bind "{d}" "{d}" && mount -o remount,bind,ro "{d}" && exec "$0" "$@"'] + cmd
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return r.stdout + r.stderr


def test_the_sandbox_builds_on_this_machine():
    assert isolation_problem() is None  # CI fails here, not skips, when the sandbox cannot be built


def test_a_failed_probe_is_tried_again_not_remembered(monkeypatch):
    """A probe that timed out once on a loaded machine (CI, 2026-11-27: "timed out after 20 s" while another
    test suite shared the cores) disabled the python tool for the rest of the process; a failure is now tried
    once more at once, and again at the next call; only a success is remembered."""
    from megappo.sandbox import run as sandbox

    outcomes = iter(["timed out after 20 s", "timed out after 20 s", "timed out after 20 s", None])
    calls = []
    monkeypatch.setattr(sandbox, "_built", False)
    monkeypatch.setattr(sandbox, "_probe", lambda: calls.append(1) or next(outcomes))
    assert isolation_problem() == "timed out after 20 s" and len(calls) == 2  # tried twice at once
    assert isolation_problem() is None and len(calls) == 4  # the next call probes again: built
    assert isolation_problem() is None and len(calls) == 4  # remembered


# ---- it runs code --------------------------------------------------------------------------------------

def test_sandbox_runs_code_with_the_standard_library_numpy_threads_and_asyncio():
    code = ("import numpy, json, asyncio, threading, fractions\n"
            "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
            "async def f(): await asyncio.sleep(0); return 7\n"
            "print(sum(i * i for i in range(10)), numpy.arange(4).sum(), asyncio.run(f()), fractions.Fraction(1, 3) * 3)\n"
            "open('scratch.txt', 'w').write('hi'); print(open('/tmp/scratch.txt').read())")
    r = run_python(code, LIMITS)
    assert r.error is None and r.output == "285 6 7 1\nhi\n", r


def test_a_call_reports_its_own_cpu_time_and_peak_memory():
    """cpu_s and max_rss_mb are the call's: at least the CPU seconds its code measured of itself and the 200 MB
    it touched; a trivial call after it reports its own (a launcher that read all its children's usage, or the
    peak of every call so far, reports the first call's again)."""
    work = ("import time\nx = bytearray(200 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\n"
            "sum(range(10 ** 7))\nprint(time.process_time())")
    busy = run_python(work, LIMITS)
    assert busy.error is None, busy
    own_cpu_s = float(busy.output)
    assert busy.cpu_s >= own_cpu_s and busy.max_rss_mb >= 200, busy
    trivial = run_python("pass", LIMITS)
    assert trivial.error is None and trivial.cpu_s < own_cpu_s and trivial.max_rss_mb < 100, (trivial, busy)


# ---- limits --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, code, expect", [
    ("hang", "while True: pass", r"CPU time limit \(2 s\) exceeded"),
    ("crash", "import ctypes\nctypes.string_at(0)", "SIGSEGV"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()", "PermissionError"),
    ("a program", "import subprocess\nsubprocess.run(['ls', '/'])", "PermissionError"),
    ("exec", "import os\nos.execv('/opt/python/bin/python3', ['python3', '-c', 'print(1)'])", "PermissionError"),
    ("memory", "x = []\nwhile True:\n    x.append(bytearray(16 << 20))", "MemoryError"),
    ("output", "while True:\n    print('x' * 1000)", "output longer than"),
    ("big file", "open('big', 'wb').write(bytes(64 << 20))", "File too large"),
    ("tmpfs full", "for i in range(64):\n    open(f'f{i}', 'wb').write(bytes(1 << 20))", "No space left"),
    ("threads", "import threading, time\nthreading.stack_size(1 << 16)\nfor i in range(200):\n"
                "    threading.Thread(target=time.sleep, args=(3,)).start()",
     "can't start new thread"),
])
def test_sandbox_stops_what_escapes_its_limits(name, code, expect):
    if name == "threads" and os.geteuid() != 0:
        pytest.fail("the thread limit is enforced only where the worker is root (each call its own uid); run as root")
    r = run_python(code, LIMITS)
    assert r.error is not None and re.search(expect, r.error + r.output), (name, r)
    assert len(r.output) <= LIMITS.max_output_bytes


def test_a_sleeping_call_is_stopped_at_the_wall_clock_limit():
    """The limit is a control call's time (the sandbox's start on this machine, now) times 5: the code has started
    (its line is out) when the limit stops it, and not before the limit."""
    control = run_python("pass", LIMITS)
    assert control.error is None, control
    wall_s = round(max(1.0, 5 * control.seconds), 1)
    r = run_python("print('sleeping', flush=True)\nimport time\ntime.sleep(600)", Limits(wall_s=wall_s, cpu_s=2))
    assert r.timed_out and r.error == f"timed out after {wall_s:g} s" and r.output == "sleeping\n", r
    assert r.seconds >= wall_s


# ---- the system-call allow-list ------------------------------------------------------------------------

# x86_64 numbers and harmless arguments: unconfined, each reaches the kernel (an answer other than EPERM:
# EFAULT, EINVAL, EBADF, success...); inside, the filter answers EPERM before the kernel looks.
CALLS = {"mount": (165, 0, 0, 0, 0, 0), "umount2": (166, 0, 0), "mount_setattr": (442, -1, 0, 0, 0, 0),
         "open_tree": (428, -1, 0, 0), "move_mount": (429, -1, 0, -1, 0, 0), "fsopen": (430, 0, 0),
         "fsconfig": (431, -1, 0, 0, 0, 0), "fsmount": (432, -1, 0, 0), "fspick": (433, -1, 0, 0),
         "pivot_root": (155, 0, 0), "chroot": (161, 0), "unshare": (272, 0), "setns": (308, -1, 0),
         "keyctl": (250, 0, 0, 0, 0, 0), "add_key": (248, 0, 0, 0, 0, 0), "request_key": (249, 0, 0, 0, 0),
         "io_uring_setup": (425, 0, 0), "userfaultfd": (323, -1), "bpf": (321, -1, 0, 0),
         "perf_event_open": (298, 0, 0, 0, 0, 0), "ptrace": (101, -1, 0, 0, 0),
         "process_vm_readv": (310, 0, 0, 0, 0, 0, 1), "execve": (59, 0, 0, 0), "execveat": (322, -1, 0, 0, 0, 0),
         "memfd_create": (319, 0, 0), "socket": (41, 2, 1, 0), "socket (netlink)": (41, 16, 3, 0),
         "socket (unix)": (41, 1, 1, 0), "shmget": (29, 0, 0, 0), "open_by_handle_at": (304, -1, 0, 0),
         "seccomp": (317, -1, 0, 0), "capset": (126, 0, 0), "pidfd_open": (434, -1, 0),
         "prctl (death signal)": (157, 1, 0, 0, 0, 0), "prctl (dumpable)": (157, 4, 1, 0, 0, 0),
         "ioctl (TIOCSTI)": (16, 0, 0x5412, 0)}
SYSCALL_PAYLOAD = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, (nr, *args) in {CALLS!r}.items():
    ctypes.set_errno(0)
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    print(name + ":", "ok" if r != -1 else os.strerror(ctypes.get_errno()))
"""


def test_refused_system_calls_reach_the_kernel_unconfined_and_get_eperm_inside(tmp_path):
    assert os.uname().machine == "x86_64", "the payload's syscall numbers are x86_64's"
    free = dict(line.split(": ", 1) for line in unconfined(SYSCALL_PAYLOAD, tmp_path).splitlines())
    inside = run_python(SYSCALL_PAYLOAD, LIMITS)
    assert inside.error is None, inside
    confined = dict(line.split(": ", 1) for line in inside.output.splitlines())
    assert set(free) == set(confined) == set(CALLS)
    for name in CALLS:
        assert free[name] != "Operation not permitted", (name, "unconfined: the payload does not reach the kernel")
        assert confined[name] == "Operation not permitted", (name, confined[name])
    assert {n.split(" ")[0] for n in CALLS} <= set(REFUSED) | {"prctl", "ioctl"}  # each one is listed with why


# ---- escapes -------------------------------------------------------------------------------------------

def mount_setattr_payload(target: str) -> str:
    """Clear MOUNT_ATTR_RDONLY on `target` (recursively), then write a file there: the #37 escape."""
    return f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]
attr = MountAttr(0, 1, 0, 0)  # clear MOUNT_ATTR_RDONLY
r = libc.syscall(442, -100, {target!r}.encode(), 0x8000, ctypes.byref(attr), 32)
print("mount_setattr", r, os.strerror(ctypes.get_errno()) if r else "")
open(os.path.join({target!r}, "escaped"), "w").write("x")
print("wrote")
"""


def test_the_read_only_mounts_cannot_be_made_writable(tmp_path):
    # unconfined: under the old confinement (a read-only bind made in the code's own user namespace) the
    # payload clears the flag and writes into the host directory
    out = unconfined(mount_setattr_payload(str(tmp_path)), tmp_path, old_namespaces=True)
    assert "wrote" in out and (tmp_path / "escaped").exists(), out
    (tmp_path / "escaped").unlink()
    # inside: the bound host directories (the allowed packages are the host's own files) stay read-only
    import numpy

    host_dir = os.path.dirname(numpy.__file__)
    for target in ("/opt/packages/numpy", "/"):
        r = run_python(mount_setattr_payload(target), LIMITS)
        assert "mount_setattr -1 Operation not permitted" in r.output and "Read-only file system" in r.output, r
    assert not os.path.exists(os.path.join(host_dir, "escaped"))


NEW_MOUNT_API = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fs = libc.syscall(430, b"tmpfs", 0)                       # fsopen
print("fsopen", fs, os.strerror(ctypes.get_errno()) if fs < 0 else "")
if fs >= 0:
    libc.syscall(431, fs, 6, None, None, 0)               # fsconfig(FSCONFIG_CMD_CREATE)
    mnt = libc.syscall(432, fs, 0, 0)                     # fsmount
    r = libc.syscall(429, mnt, b"", -100, os.getcwd().encode(), 4)  # move_mount over the working directory
    print("move_mount", r)
    open("new-mount-file", "w").write("x")
    print("wrote on a mount of its own")
tree = libc.syscall(428, -100, b"/", 1 | 0x8000)          # open_tree(OPEN_TREE_CLONE | AT_RECURSIVE)
print("open_tree", tree, os.strerror(ctypes.get_errno()) if tree < 0 else "")
"""


def test_the_new_mount_api_is_closed(tmp_path):
    out = unconfined(NEW_MOUNT_API, tmp_path, old_namespaces=True)  # a read-only cwd, then a fresh mount over it
    assert "move_mount 0" in out and "wrote on a mount of its own" in out and re.search(r"open_tree \d+ ", out), out
    r = run_python(NEW_MOUNT_API, LIMITS)
    assert "fsopen -1 Operation not permitted" in r.output and "open_tree -1 Operation not permitted" in r.output, r


def outliving_payload(name: str, then: str = "pass") -> str:
    """Leave the process group, clear the death signal, ignore signals, rename itself, keep threads, say
    "staying", run `then` and sleep (costing no CPU): in a forked child where fork works, else in itself."""
    return f"""
import ctypes, os, signal, threading, time
libc = ctypes.CDLL(None, use_errno=True)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(s, signal.SIG_IGN)
def stay():
    try:
        os.setsid()
    except OSError:
        pass
    libc.prctl(1, 0, 0, 0, 0)                  # PR_SET_PDEATHSIG 0
    libc.prctl(15, {name.encode()!r}, 0, 0, 0)  # PR_SET_NAME
    threading.Thread(target=time.sleep, args=(600,)).start()
    print("staying", flush=True)
    {then}
    time.sleep(600)
try:
    pid = os.fork()
except OSError:
    pid = -1
if pid == 0:
    stay()
elif pid < 0:
    stay()
else:
    time.sleep(600)
"""


def alive_named(name: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = open(f"/proc/{pid}/comm").read().strip()
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if comm == name and state != "Z":
            found.append(int(pid))
    return found


def test_every_process_of_a_call_ends_with_it(tmp_path):
    name = "mp" + secrets.token_hex(5)
    # unconfined, killed as the sandbox used to kill (the process group): the payload survives
    proc = subprocess.Popen([sys.executable, "-I", "-c", outliving_payload(name)], cwd=tmp_path,
                            start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: alive_named(name), "the unconfined payload to rename itself (after its setsid)")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert alive_named(name), "unconfined, the payload should outlive its process group's kill"
    finally:
        for pid in alive_named(name):
            os.kill(pid, signal.SIGKILL)
    # inside: it is the PID namespace's init; the call's end kills it and everything in its namespace. The call
    # ends at its output cap, which the payload passes right after its line (a wall limit raced its start)
    r = run_python(outliving_payload(name, then='print("x" * 65536, flush=True)'), LIMITS)
    assert r.error == f"output longer than {LIMITS.max_output_bytes} bytes: stopped", r
    assert r.output.startswith("staying\nxxx"), r
    assert alive_named(name) == []  # reaped before run_python returned: nothing of it is left


SHM_PAYLOAD = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget({key}, 1 << 20, 0o1600)  # IPC_CREAT | 0600: a System V segment outside any address space
print("shmget", shmid, os.strerror(ctypes.get_errno()) if shmid < 0 else "")
"""


def sysv_segments(key: int) -> list[int]:
    lines = open("/proc/sysvipc/shm").read().splitlines()[1:]
    return [int(f[1]) for f in map(str.split, lines) if int(f[0]) == key]


def test_no_ipc_object_outlives_the_call(tmp_path):
    key = secrets.randbelow(1 << 30) + 1
    libc = ctypes.CDLL(None, use_errno=True)
    out = unconfined(SHM_PAYLOAD.format(key=key), tmp_path)
    try:
        assert "shmget" in out and sysv_segments(key), (out, "unconfined, the segment should outlive the process")
    finally:
        for shmid in sysv_segments(key):
            libc.shmctl(shmid, 0, None)  # IPC_RMID
    r = run_python(SHM_PAYLOAD.format(key=key), LIMITS)
    assert "shmget -1 Operation not permitted" in r.output, r
    assert sysv_segments(key) == []


def socket_payload(path: str, abstract: str, port: int) -> str:
    return f"""
import socket
for family, address in ((socket.AF_UNIX, {path!r}), (socket.AF_UNIX, "\\0" + {abstract!r}),
                        (socket.AF_INET, ("127.0.0.1", {port}))):
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(1)
        s.connect(address)
        print("connected", address)
    except OSError as e:
        print("refused", address, e)
"""


def test_no_host_service_is_reachable(tmp_path):
    path, abstract = str(tmp_path / "service.sock"), "megappo-test-" + secrets.token_hex(4)
    servers = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX), socket.socket()]
    for s, address in zip(servers, (path, "\0" + abstract, ("127.0.0.1", 0))):
        s.bind(address)
        s.listen(8)
        s.settimeout(0.2)
    port = servers[2].getsockname()[1]
    try:
        out = unconfined(socket_payload(path, abstract, port), tmp_path)
        assert out.count("connected") == 3, out  # a unix socket on a path (Ray's), an abstract one, loopback TCP
        for s in servers:
            s.accept()[0].close()
        r = run_python(socket_payload(path, abstract, port), LIMITS)
        assert r.error is None and "connected" not in r.output and r.output.count("refused") == 3, r
        for s in servers:
            with pytest.raises(socket.timeout):
                s.accept()  # nothing reached it
    finally:
        for s in servers:
            s.close()


def reading_payload(roots: list, secret: str, paths: list) -> str:
    """Walk `roots`, reading every small file, and print each one holding `secret`; then say which of
    `paths` exist. Prints what the visible world is, too."""
    return f"""
import os
for root in {roots!r}:
    for d, dirs, files in os.walk(root):
        if d == "/proc" or d.startswith("/proc/"):
            dirs[:] = []
            continue
        for f in files:
            p = os.path.join(d, f)
            try:
                if {secret!r} in p or (os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p) < 65536
                                       and {secret!r}.encode() in open(p, "rb").read()):
                    print("found", p)
            except OSError:
                pass
for p in {paths!r}:
    print("exists" if os.path.exists(p) else "absent", p)
print("root", sorted(os.listdir("/")), "tmp", os.listdir("/tmp") if os.path.isdir("/tmp") else None)
print("fds", sorted(map(int, os.listdir("/proc/self/fd")))[:4], "host", os.uname().nodename)
"""


def test_nothing_of_the_host_is_in_view(tmp_path, monkeypatch):
    """The run's training parquet, its ground-truth answers and a credential are planted; from inside,
    a walk of everything visible finds none of them (a policy cannot learn to read the answer key)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    secret = "ANSWER-" + secrets.token_hex(8)
    data = tmp_path / "run" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["2+2?"], "ground_truth": [secret]}), data / "train.parquet",
                   compression="none")  # the answer's bytes as they are, so a byte search can find them
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".netrc").write_text(f"machine example login me password {secret}\n")
    monkeypatch.setenv("WANDB_API_KEY", secret)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [str(data / "train.parquet"), str(tmp_path), repo, "/work", "/home", "/root", "/run", "/var", "/dev/shm",
             "/etc", os.environ.get("TMPDIR", "/tmp") + "/ray"]
    out = unconfined(reading_payload([str(tmp_path)], secret, paths), tmp_path)
    assert f"found {data / 'train.parquet'}" in out and f"found {tmp_path / 'home' / '.netrc'}" in out, out
    assert f"exists {data / 'train.parquet'}" in out
    r = run_python(reading_payload(["/"], secret, paths) + "print(sorted(os.environ))",
                   Limits(wall_s=60, cpu_s=30, max_output_bytes=1 << 16))
    assert r.error is None, r
    assert "found" not in r.output and "exists" not in r.output and secret not in r.output, r.output
    assert "root ['dev', 'lib', 'lib64', 'opt', 'proc', 'tmp', 'usr'] tmp []" in r.output, r.output
    assert "['HOME', 'LANG', 'LD_LIBRARY_PATH', 'PATH', 'TMPDIR']" in r.output
    assert "fds [0, 1, 2, 3] host sandbox" in r.output  # stdin/out/err and the listing's own: nothing inherited


def test_the_tool_cannot_write_anything_but_its_tmpfs():
    code = """
import os
for d in ("/", "/opt/python/lib", "/opt/packages/numpy", "/usr/lib", "/dev", "/proc/self"):
    try:
        open(os.path.join(d, "x"), "w").write("x")
        print("wrote", d)
    except OSError as e:
        print("refused", d, e.strerror)
open("/tmp/x", "w").write("x"); print("tmp ok")
"""
    r = run_python(code, LIMITS)
    assert r.error is None and "wrote" not in r.output and r.output.count("refused") == 6 and "tmp ok" in r.output, r


def test_each_call_starts_from_an_empty_tmpfs():
    first = run_python("open('/tmp/left', 'w').write('x'); import os; print(os.listdir('/tmp'))", LIMITS)
    second = run_python("import os; print(os.listdir('/tmp'))", LIMITS)
    assert first.output == "['left']\n" and second.output == "[]\n"


def test_each_live_call_holds_a_uid_no_other_live_call_has(tmp_path):
    """RLIMIT_NPROC counts a uid's processes machine-wide: two calls sharing a uid share one thread budget. The
    per-call uid was pid << 10 + a counter mod 2^20, which two workers' pids could make equal; now each live call
    leases a uid (a lock file each): calls alive at once, in this process and in another, hold different ones,
    and a uid comes free when its call ends (or its process dies)."""
    import multiprocessing as mp

    from megappo.sandbox.run import uid_lease

    ctx = mp.get_context("spawn")
    held, release = ctx.Queue(), ctx.Event()
    other = ctx.Process(target=_hold_a_uid, args=(tmp_path, held, release))
    with uid_lease(tmp_path) as a, uid_lease(tmp_path) as b:
        other.start()
        c = held.get(timeout=60)
        assert len({a, b, c}) == 3, (a, b, c)
        release.set()
        other.join(timeout=60)
    with uid_lease(tmp_path) as again:
        assert again == a  # the lowest free one: the files stay as few as the calls that ran at once
    assert len(list(tmp_path.iterdir())) == 3


def _hold_a_uid(lease_dir, held, release):
    from megappo.sandbox.run import uid_lease

    with uid_lease(lease_dir) as uid:
        held.put(uid)
        release.wait(60)
