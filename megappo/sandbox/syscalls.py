"""The python tool's system-call allow-list: the one place that says what sandboxed code may ask the kernel.

Everything not listed here is refused with EPERM (Python raises PermissionError), so a call the kernel
adds later is refused too. The list is what CPython needs to run pure Python and the standard library's
computing modules (and numpy's threads) once the interpreter has started: files on the read-only root and
the tmpfs, memory, threads, time, signals to itself, polling, and the socketpair asyncio wakes itself
with. `build_filter()` compiles it with libseccomp (pyseccomp) into the BPF program that the sandbox
loads just before the tool's code runs (megappo/sandbox/child.py).

Refused on purpose (the notable ones; the test suite calls each from inside and expects EPERM):
"""

from __future__ import annotations

import errno
import tempfile
from functools import lru_cache

# ---- allowed without conditions: name -> why CPython needs it -------------------------------------------
ALLOWED: dict[str, str] = {}


def _allow(why: str, *names: str) -> None:
    for n in names:
        ALLOWED[n] = why


_allow("read and write open files (the tmpfs, the read-only stdlib, pipes)",
       "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
       "lseek", "close", "close_range", "dup", "dup2", "dup3", "fcntl", "flock", "fsync", "fdatasync",
       "fadvise64", "fallocate", "ftruncate", "truncate", "sendfile", "copy_file_range")
_allow("open and look up files (the mounts decide what exists and what is writable)",
       "open", "openat", "openat2", "creat", "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs",
       "access", "faccessat", "faccessat2", "getdents", "getdents64", "readlink", "readlinkat", "getcwd", "chdir",
       "fchdir", "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr")
_allow("change files in the working tmpfs (the only writable mount)",
       "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat",
       "symlink", "symlinkat", "chmod", "fchmod", "fchmodat", "utimensat", "futimesat", "utimes", "umask")
_allow("memory: the allocator, dlopen of extension modules, numpy's buffers (RLIMIT_AS bounds the total)",
       "brk", "mmap", "munmap", "mprotect", "mremap", "madvise", "msync", "mincore")
_allow("threads (threading, concurrent.futures, OpenBLAS) and their synchronisation; processes are refused "
       "by the clone rule below", "futex", "set_robust_list", "get_robust_list", "set_tid_address", "rseq",
       "arch_prctl", "sched_yield", "sched_getaffinity", "sched_getparam", "sched_getscheduler",
       "sched_get_priority_max", "sched_get_priority_min", "getpriority", "membarrier", "exit", "exit_group")
_allow("signals within the process (the sandbox's own PID namespace holds nothing else)",
       "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait", "rt_sigsuspend",
       "sigaltstack", "kill", "tgkill", "tkill", "pause")
_allow("time and timers (time, signal.alarm/setitimer, sleeping)",
       "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time", "getitimer",
       "setitimer", "alarm", "times")
_allow("facts about itself (os.getpid, os.cpu_count, resource.getrusage, random's seed)",
       "getpid", "gettid", "getppid", "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid",
       "getgroups", "getpgrp", "getpgid", "getsid", "uname", "sysinfo", "getrusage", "getrlimit", "getcpu",
       "getrandom")
_allow("waiting on file descriptors (selectors, asyncio's event loop)",
       "select", "pselect6", "poll", "ppoll", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
       "epoll_pwait", "epoll_pwait2", "eventfd2", "pipe", "pipe2")
_allow("I/O on the socketpair below (asyncio's self-pipe); socket() itself is refused, so no other socket exists",
       "sendto", "recvfrom", "sendmsg", "recvmsg", "shutdown", "getsockname", "getpeername", "getsockopt",
       "setsockopt")
_allow("wait for children: there are none (answers ECHILD)", "wait4", "waitid")

# ---- allowed only with these arguments ----------------------------------------------------------------
CLONE_THREAD = 0x00010000
CLONE_NEW_ANY = 0x7E020080  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
AF_UNIX = 1
PR_SET_NAME, PR_GET_NAME = 15, 16
IOCTLS = {0x5401: "TCGETS (isatty)", 0x5413: "TIOCGWINSZ (shutil.get_terminal_size)", 0x541B: "FIONREAD",
          0x5421: "FIONBIO", 0x5450: "FIONCLEX", 0x5451: "FIOCLEX"}
CONDITIONAL: dict[str, str] = {
    "clone": "only a thread (CLONE_THREAD set, no namespace flag): a new process, a fork bomb, is refused",
    "clone3": "answers ENOSYS (its flags are behind a pointer a filter cannot read): glibc then uses clone",
    "socketpair": "AF_UNIX only: asyncio's event loop wakes itself through one",
    "ioctl": "only " + ", ".join(IOCTLS.values()) + ": no terminal injection, no device control",
    "prctl": "only PR_SET_NAME / PR_GET_NAME (thread names); not the death signal, not seccomp, not dumpable",
    "prlimit64": "only on itself (pid 0): it may lower its limits, never raise them (no capabilities)",
}

# ---- refused: the notable ones and why (everything unlisted is refused the same way) ----------------------
REFUSED: dict[str, str] = {
    "mount": "old mount API: could remount the root writable or mount over it",
    "umount2": "could uncover what lies under a mount",
    "mount_setattr": "could clear MOUNT_ATTR_RDONLY (the escape issue #37 found)",
    "open_tree": "new mount API: clones mount trees",
    "move_mount": "new mount API: attaches mounts",
    "fsopen": "new mount API: makes a filesystem context",
    "fsconfig": "new mount API",
    "fsmount": "new mount API",
    "fspick": "new mount API: reconfigures an existing mount",
    "pivot_root": "changes the root",
    "chroot": "changes the root",
    "unshare": "new namespaces (a user namespace would give it capabilities again)",
    "setns": "joins other namespaces",
    "keyctl": "the kernel keyring is shared outside the sandbox",
    "add_key": "kernel keyring",
    "request_key": "kernel keyring",
    "io_uring_setup": "io_uring runs I/O outside this filter's view",
    "io_uring_enter": "io_uring",
    "io_uring_register": "io_uring",
    "userfaultfd": "a classic tool for exploiting kernel races",
    "bpf": "loads programs into the kernel",
    "perf_event_open": "kernel attack surface and side channels",
    "ptrace": "inspects and controls processes",
    "process_vm_readv": "reads another process's memory",
    "process_vm_writev": "writes another process's memory",
    "fork": "new processes (every process of a call must end with it)",
    "vfork": "new processes",
    "execve": "no program is run after the interpreter started",
    "execveat": "no program is run after the interpreter started",
    "memfd_create": "anonymous files outside the tmpfs size cap (and a way to exec code)",
    "socket": "no sockets: the network namespace has only a downed loopback, and unix sockets could reach host services",
    "shmget": "System V IPC: objects that could outlive the call (the IPC namespace also ends with it)",
    "msgget": "System V IPC",
    "semget": "System V IPC",
    "kexec_load": "replaces the kernel",
    "init_module": "loads kernel code",
    "finit_module": "loads kernel code",
    "setuid": "identity changes",
    "setgid": "identity changes",
    "setgroups": "identity changes",
    "capset": "capabilities",
    "seccomp": "filters may only be added by the sandbox itself",
    "name_to_handle_at": "file handles can reach files outside the visible tree",
    "open_by_handle_at": "file handles can reach files outside the visible tree (the shocker escape)",
    "syslog": "kernel log",
    "reboot": "the machine",
    "swapon": "the machine",
    "acct": "the machine",
    "quotactl": "the machine",
    "lookup_dcookie": "kernel internals",
    "pidfd_open": "handles to processes",
    "pidfd_getfd": "takes another process's file descriptors",
    "landlock_create_ruleset": "not needed",
}
__doc__ += "".join(f"- {name}: {why}\n" for name, why in REFUSED.items())


@lru_cache(maxsize=None)
def build_filter() -> bytes:
    """The allow-list as a seccomp BPF program (bytes of struct sock_filter) for this machine's architecture."""
    import pyseccomp as sc

    overlap = set(ALLOWED) & (set(REFUSED) | set(CONDITIONAL))
    assert not overlap, f"syscalls both allowed and refused: {overlap}"
    f = sc.SyscallFilter(defaction=sc.ERRNO(errno.EPERM))
    for name in ALLOWED:
        f.add_rule(sc.ALLOW, name)
    f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD | CLONE_NEW_ANY, CLONE_THREAD))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(sc.ALLOW, "socketpair", sc.Arg(0, sc.EQ, AF_UNIX))
    for request in IOCTLS:
        f.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.EQ, request))
    for option in (PR_SET_NAME, PR_GET_NAME):
        f.add_rule(sc.ALLOW, "prctl", sc.Arg(0, sc.EQ, option))
    f.add_rule(sc.ALLOW, "prlimit64", sc.Arg(0, sc.EQ, 0))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


__all__ = ["ALLOWED", "CONDITIONAL", "REFUSED", "build_filter"]
