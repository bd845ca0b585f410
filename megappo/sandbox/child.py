"""The sandbox's own side: run as `python -I -S -c <this file's text> STAGE JSON`, never imported.

Stage "outer" starts as the worker's process image (the host's root filesystem, the worker's user):
  1. unshare: new user, mount, network, IPC, UTS, cgroup and PID namespaces. The launcher (run.py)
     writes the user namespace's id maps: namespace root = an unprivileged host uid of its own per call
     where the worker is root, else the worker's own uid;
  2. becomes that namespace root and forks the PID namespace's init, reports its pid, waits on it and
     reports its CPU time and peak memory; its exit status is the init's (a signal death is re-raised).
Stage "init" (pid 1 of the new PID namespace) builds the child's whole world and then locks it:
  3. a fresh tmpfs root holding only: the interpreter and its standard library (/opt/python), the allowed
     packages (/opt/packages), the system's shared-library directories, a /dev of null, zero, random
     and urandom, its own /proc, and a size-capped noexec tmpfs at /tmp (the working directory). Each
     bind is read-only, nosuid, nodev; the host's paths are opened (O_PATH) by the outer stage, so
     nothing of the host is resolved by path here;
  4. pivot_root into it and detach the old root: nothing of the host's tree stays reachable;
  5. remount the root, /dev and the binds read-only, then a nested user + mount namespace: the mounts
     are now copies from a more privileged mount namespace, which the kernel locks (MNT_LOCKED: cannot
     be unmounted to uncover anything; MNT_LOCK_READONLY/NOSUID/NODEV/NOEXEC: the flags cannot be
     cleared, by mount(2) or mount_setattr(2));
  6. execve the interpreter again as a non-root uid of that nested namespace: the exec drops every
     capability, so even a hole in the filter could not mount;
Stage "tool" (the fresh interpreter inside):
  7. checks that only /tmp is writable (fail closed), sets the rlimits, loads the seccomp allow-list
     (megappo/sandbox/syscalls.py, compiled by the launcher, read from stdin), then runs the code (the rest
     of stdin).
"""

import ctypes
import json
import os
import resource  # noqa: F401 - imported now: after its setresuid the outer stage may not read the stdlib's path
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 4, 38, 22, 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}[os.uname().machine]  # no libc wrapper
NAMESPACES = (os.CLONE_NEWUSER | os.CLONE_NEWNS | os.CLONE_NEWNET | os.CLONE_NEWIPC | os.CLONE_NEWUTS
              | os.CLONE_NEWCGROUP | os.CLONE_NEWPID)
INNER_UID = 1000  # the tool's uid in the nested namespace: not its root, so exec drops all capabilities

libc = ctypes.CDLL(None, use_errno=True)


def fail(msg):
    os.write(2, ("sandbox: " + msg + "\n").encode())
    os._exit(125)


def check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        fail(f"{what}: {os.strerror(e)}")


def mount(src, dst, fstype=None, flags=0, data=None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")


def locked_flags(path):
    """The flags a read-only remount of a bind must keep (the kernel refuses to clear locked ones)."""
    f = os.statvfs(path).f_flag
    return ((MS_NOSUID if f & os.ST_NOSUID else 0) | (MS_NODEV if f & os.ST_NODEV else 0)
            | (MS_NOEXEC if f & os.ST_NOEXEC else 0))


def bind_ro(src, dst, nodev=MS_NODEV):
    mount(src, dst, None, MS_BIND)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | nodev | locked_flags(dst))


def make_target(path, is_dir):
    os.makedirs(path if is_dir else os.path.dirname(path), mode=0o755, exist_ok=True)
    if not is_dir:
        open(path, "a").close()


def outer(cfg):
    os.set_inheritable(cfg["ctl"], False)
    os.set_inheritable(cfg["status"], False)
    os.unshare(NAMESPACES)
    os.write(cfg["status"], b"U")
    if os.read(cfg["ctl"], 1) != b"G":
        fail("the launcher did not map the user namespace")
    # the bind sources, opened in this mount namespace (a bind must come from it) and while still the
    # worker's uid (which may traverse e.g. /root to the interpreter): the init resolves no host path
    cfg["binds"] = [(os.open(src, os.O_PATH), inside, is_dir) for src, inside, is_dir in cfg["binds"]]
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    pid = os.fork()
    if pid == 0:
        try:
            init(cfg)
        except BaseException as e:  # noqa: BLE001 - any failure here means no sandbox: say why, run nothing
            fail(f"setup failed: {type(e).__name__}: {e}")
    os.write(cfg["status"], b"C%d\n" % pid)
    os.read(cfg["ctl"], 1)  # the launcher holds a pidfd of the init before it can be reaped
    _, status, usage = os.wait4(pid, 0)
    os.write(cfg["status"], b"R %f %f\n" % (usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024))
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def init(cfg):
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    check(libc.sethostname(b"sandbox", 7), "sethostname")  # its own UTS namespace: not the host's name
    root = cfg["root"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for fd, target, is_dir in cfg["binds"]:
        make_target(root + target, is_dir)
        bind_ro(f"/proc/self/fd/{fd}", root + target)
    for target in cfg["empty"]:  # e.g. the base interpreter's own site-packages: not the tool's packages
        make_target(root + target, True)
        mount("tmpfs", root + target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=555")
    for link, to in cfg["symlinks"]:
        os.symlink(to, root + link)
    os.mkdir(root + "/dev", 0o755)
    mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=4k,mode=755")
    for dev in ("null", "zero", "random", "urandom"):
        make_target(f"{root}/dev/{dev}", False)
        bind_ro(f"/dev/{dev}", f"{root}/dev/{dev}", nodev=0)
    mount(None, root + "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.mkdir(root + "/proc", 0o555)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(root + "/tmp", 0o755)
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=%d,mode=700" % cfg["tmpfs_bytes"])
    os.chdir(root)
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")  # the old root now lies under the new one
    check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNS)  # the copies of every mount above are locked now
    check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")  # the uid change cleared it: /proc/self is ours again
    for name, text in (("setgroups", "deny"), ("uid_map", f"{INNER_UID} 0 1"), ("gid_map", f"{INNER_UID} 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    mount(None, "/proc", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir("/tmp")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    env = {"PATH": "/opt/python/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp",
           "LD_LIBRARY_PATH": "/opt/python/lib"}
    src = cfg["source"]
    del cfg["source"]
    os.execve("/opt/python/bin/python3", ["python3", "-I", "-S", "-c", src, "tool", json.dumps(cfg)], env)


def writable_mounts():
    out = []
    for line in open("/proc/self/mountinfo"):
        f = line.split()
        if "ro" not in f[5].split(","):
            out.append(f[4])
    return out


def tool(cfg):
    writable = [p for p in writable_mounts() if p != "/tmp"]
    if writable:
        fail(f"{writable} stayed writable: refusing to run the code")
    data = sys.stdin.buffer.read()
    size, rest = data.split(b"\n", 1)
    program, code = rest[:int(size)], rest[int(size):].decode()

    def cpu_limit(*_, _write=os.write, _exit=os._exit):  # the soft limit says so; the hard one is SIGKILL
        _write(2, b"CPU time limit exceeded\n")
        _exit(152)

    signal.signal(signal.SIGXCPU, cpu_limit)
    limits = [(resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1), (resource.RLIMIT_AS, cfg["memory_bytes"], None),
              (resource.RLIMIT_FSIZE, cfg["tmpfs_bytes"], None), (resource.RLIMIT_NOFILE, 64, None),
              (resource.RLIMIT_CORE, 0, None)]
    if cfg["nproc"]:  # the call's own host uid: its threads are all that count
        limits.append((resource.RLIMIT_NPROC, cfg["nproc"], None))
    for what, soft, hard in limits:
        resource.setrlimit(what, (soft, soft if hard is None else hard))
    sys.path.append("/opt/packages")
    buf = ctypes.create_string_buffer(program)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")
    sys.stdin = open(os.devnull)
    sys.argv = ["<tool>"]
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
    except SystemExit:
        raise
    except BaseException as e:  # the traceback of the tool's code only, not of this stage
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    stage, config = sys.argv[1], json.loads(sys.argv[2])
    if stage == "outer":
        outer(config)
    elif stage == "tool":
        tool(config)
