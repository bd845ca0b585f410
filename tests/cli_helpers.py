"""The megappo command line in this process: `megappo.cli.main(args)` from the repo dir, its stdout and stderr
captured, argparse's and sys.exit's codes as the return code. A new interpreter spends 5-8 s importing torch,
transformers and Ray before it prints anything; the entry point is the same either way. (A command that builds a
vLLM engine stays in a process of its own: an in-process engine shares this process's distributed state.)"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd=REPO) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `megappo ARGS`, run here."""
    from megappo.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in args])
            except SystemExit as e:  # as the interpreter exits: a message goes to stderr with code 1
                rc = e.code if not isinstance(e.code, str) else (print(e.code, file=sys.stderr), 1)[1]
    finally:
        os.chdir(here)
    return int(rc or 0), out.getvalue(), err.getvalue()
