#!/usr/bin/env bash
# The wheels tools/gpu_smoke.py needs on a GPU machine that has torch, transformers and peft but no package
# registry (a lent box): megatron-core (its pin in requirements-gpu.txt; cp312 manylinux), omegaconf and its
# antlr4 runtime (megappo.config; antlr4 is an sdist, built here into a wheel). Run where pip works:
#   scripts/gpu_smoke_wheels.sh [DIR]        # default .whl
# then on the GPU machine:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl && PYTHONPATH=/tmp/site \
#     python3 tools/gpu_smoke.py --device cuda
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl}
py=${PY:-python3}
pin() { sed 's/#.*//' requirements-gpu.txt requirements-cpu.txt | tr -d ' ' | grep -m1 -E "^$1([=<>]|$)"; }
mkdir -p "$out"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$out" "$(pin megatron-core)"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$out" "$(pin omegaconf)"
"$py" -m pip wheel -q --no-deps -w "$out" "antlr4-python3-runtime==4.9.3"  # omegaconf 2.3's pin (4.9.*)
ls -1 "$out"
