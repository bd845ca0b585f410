"""A warm `megappo` for shell scripts: one server process imports megappo.cli and the named subcommands' modules
once, and the `megappo` that bash finds first on PATH is this file's client. Each call forks the server, which runs
`megappo.cli.main(argv)` (the console script's entry point) on the caller's own stdin/stdout/stderr (passed over a
Unix socket), cwd and environment, and exits as the interpreter would; the client exits with that code. A new
interpreter spends 1.5-2 s importing torch before `megappo plan` computes for 0.1 s. (A command that builds a vLLM
engine or starts Ray must not be run this way; the console script itself is run by test_slurm's jobs.)

This file is the client too (`python -S cli_server.py call SOCKET ARGS`: standard library only, ~20 ms)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def _exit_code(main, argv: list[str]) -> int:
    """What `sys.exit(main())` would exit with, traceback and flush included."""
    import traceback

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:
        return 120  # as the interpreter exits when flushing its std streams fails
    return code or 0


def _call(conn: socket.socket, main) -> None:
    """In a fork of the server: run one request in a fork of its own, send its exit code back."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    req = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        for i, fd in enumerate(fds):  # the caller's stdin, stdout, stderr
            os.dup2(fd, i)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["megappo", *req["argv"]]
        os._exit(_exit_code(main, req["argv"]))
    _, status = os.waitpid(pid, 0)
    conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
    os._exit(0)


def serve(path: str, commands: list[str]) -> None:
    import importlib
    import signal
    import warnings

    from megappo.cli import SUBCOMMANDS, main

    for c in commands:
        if c in SUBCOMMANDS:
            importlib.import_module(SUBCOMMANDS[c][0])
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-call forks reap themselves
    # torch's import starts a native thread that holds no lock a CLI command takes (DataLoader forks the same way)
    warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            srv.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _call(conn, main)
        conn.close()


def call(path: str, argv: list[str]) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(path)
        socket.send_fds(s, [json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()],
                        [0, 1, 2])
        code = int(s.recv(16) or b"1")
    return code if code >= 0 else 128 - code  # killed by a signal: as bash reports it


@contextlib.contextmanager
def warm_megappo(tmp: Path, commands: list[str]):
    """A server preloaded with `commands`' modules; yields the dir of its `megappo` (put it first on PATH)."""
    sock, here = str(tmp / "megappo.sock"), Path(__file__).resolve()
    proc = subprocess.Popen([sys.executable, str(here), "serve", sock, *commands], cwd=here.parents[1],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", f"the warm megappo server exited {proc.wait()}"
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        (bin_dir / "megappo").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{here}" call "{sock}" "$@"\n')
        (bin_dir / "megappo").chmod(0o755)
        yield bin_dir
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(call(sys.argv[2], sys.argv[3:]))
