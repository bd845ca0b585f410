"""Write the top_level.txt that a wheel built without setuptools lacks, into this interpreter's installed
distributions, so that `importlib.metadata.packages_distributions()` reads one small file per distribution
instead of inferring the names from its RECORD, which stats every installed file.

Why: transformers calls packages_distributions() when it is imported (utils/import_utils.py), and so does every
process that imports it: each Ray worker, each spawned rank, each CLI call. In this venv (~300 distributions, half
without top_level.txt, ~55k files) that is ~1.3 s of stat calls per process on a 2-core machine.

The names written are the ones the standard library infers (`importlib.metadata._top_level_inferred`, the same
function packages_distributions() falls back to), and the run checks that packages_distributions() gives the same
mapping after as before; a distribution the inference finds no name for is left alone. Idempotent (a distribution
that declares its names is not touched). Run by `make install` and `make docs-install` after pip.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import time
from pathlib import Path


def main() -> int:
    t0 = time.perf_counter()
    before = md.packages_distributions()
    seconds_before = time.perf_counter() - t0
    written = 0
    for dist in md.distributions():
        folder = getattr(dist, "_path", None)  # PathDistribution: its .dist-info folder
        if dist.read_text("top_level.txt") is not None or not isinstance(folder, Path) or not folder.is_dir():
            continue
        names = sorted(set(md._top_level_inferred(dist)))
        if names:
            (folder / "top_level.txt").write_text("".join(n + "\n" for n in names))
            written += 1
    t1 = time.perf_counter()
    after = md.packages_distributions()
    seconds_after = time.perf_counter() - t1
    norm = lambda m: {k: sorted(v) for k, v in m.items()}  # noqa: E731
    if norm(after) != norm(before):
        changed = sorted(k for k in set(before) | set(after) if sorted(before.get(k, [])) != sorted(after.get(k, [])))
        print(f"declare_top_level: packages_distributions() changed for {changed[:5]}: remove the top_level.txt "
              "files this script wrote (make clean-venv && make install)", file=sys.stderr)
        return 1
    print(f"declare_top_level: {written} distributions given a top_level.txt; packages_distributions() "
          f"{seconds_before:.2f} s -> {seconds_after:.2f} s, the same {len(after)} names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
