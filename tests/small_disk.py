"""A real small disk without privileges, for the full-disk tests: a tmpfs of a given size, mounted by a helper
process in a user + mount namespace of its own (what the python tool's sandbox already needs: no CAP_SYS_ADMIN,
no root) and reached by every process of this user, Ray's workers included, through /proc/<helper>/root: a
path there resolves in the helper's mount namespace. A write past its size fails as on a full disk (ENOSPC,
statvfs says 0 free); the disk goes when the helper does."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path


@contextlib.contextmanager
def small_disk(where: Path, size: str):
    """A `size` tmpfs (e.g. "4m") over the empty dir `where`, seen at the path this yields. A machine that cannot
    make one fails the test in one line (CI must not go green with the full-disk paths untested)."""
    where.mkdir(parents=True, exist_ok=True)
    helper = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                               'mount -t tmpfs -o "size=$1" tmpfs "$0" && echo mounted && exec sleep infinity',
                               str(where), size], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if helper.stdout.readline() != "mounted\n":
            helper.wait(timeout=60)
            why = " ".join(helper.stderr.read().split())
            raise AssertionError(f"cannot make a {size} tmpfs in a user namespace here: {why}")
        yield Path(f"/proc/{helper.pid}/root") / where.relative_to("/")
    finally:
        helper.kill()
        helper.wait()
