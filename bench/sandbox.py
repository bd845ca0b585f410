"""What one python-tool call costs: the sandbox (megappo/sandbox/run.py) against a bare interpreter.

    .venv/bin/python bench/sandbox.py [--calls 30]

Prints one JSON object: wall milliseconds per call (p50 / p95 / mean) for `print(1)` and for a call that
imports numpy, each sandboxed and as a plain `python -I -S` subprocess (the floor: one interpreter start),
measured interleaved in one run. The sandbox starts two interpreters (the outer stage, then the tool's
own after the namespaces and the minimal root are built).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megappo.sandbox.run import Limits, isolation_problem, run_python  # noqa: E402

CODES = {"print": "print(1)", "numpy": "import numpy; print(numpy.arange(4).sum())"}


def bare(code: str) -> float:
    t0 = time.perf_counter()
    flags = ["-I"] if "numpy" in code else ["-I", "-S"]  # numpy needs the venv's site-packages
    subprocess.run([sys.executable, *flags, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - t0


def sandboxed(code: str) -> float:
    r = run_python(code, Limits(wall_s=30, cpu_s=30))
    assert r.error is None, r
    return r.seconds


def summary(seconds: list[float]) -> dict:
    ms = sorted(s * 1000 for s in seconds)
    return {"p50_ms": round(statistics.median(ms), 1), "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 1),
            "mean_ms": round(statistics.fmean(ms), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    problem = isolation_problem()
    if problem:
        sys.exit(f"bench/sandbox.py: this machine cannot build the sandbox: {problem}")
    times: dict[str, list[float]] = {f"{k}_{w}": [] for k in CODES for w in ("sandbox", "bare")}
    for _ in range(args.calls):
        for name, code in CODES.items():
            times[f"{name}_sandbox"].append(sandboxed(code))
            times[f"{name}_bare"].append(bare(code))
    out = {k: summary(v) for k, v in times.items()}
    out["calls"] = args.calls
    out["overhead_ms_p50"] = round(out["print_sandbox"]["p50_ms"] - out["print_bare"]["p50_ms"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
