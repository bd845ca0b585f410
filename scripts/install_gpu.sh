#!/usr/bin/env bash
# The GPU stack (CUDA 12.x/13.x, x86_64, Python 3.12) in its own venv: `make install-gpu` runs this.
# Every pin lives in a requirements file that tools/gpu_check.py reads back (requirements-gpu.txt,
# requirements-gpu-te.txt); the order matters (docs/ENVIRONMENT.md, "Installing TE 2.11.0"):
#   1. build tools first: transformer_engine_torch is an sdist built with --no-build-isolation, and its
#      setup.py imports `wheel` and `packaging` (pip installs nothing for it then); ninja keeps torch's
#      extension build off the slow distutils backend
#   2. torch 2.13.0 alone (PyPI's linux x86_64 wheel is the CUDA 13 build vllm 0.32.0 was compiled against)
#   3. the stack (vllm 0.32.0 CUDA, megatron-core, ray, ...), never allowed to replace that torch
#   4. Transformer Engine, compiled against that torch (needs nvcc >= 12 and a C++17 compiler on the host)
#   5. megappo itself (editable)
# NVIDIA apex (fused Adam / norms) is optional: megatron falls back to TE or torch without it. To build it,
# set APEX=1 (needs git access to github.com/NVIDIA/apex; the commit is pinned below).
#
#   scripts/install_gpu.sh [--venv DIR] [--python python3.12] [--skip-stack]
#   --skip-stack: steps 1, 2 and 4 only (checks the build steps on a machine without the ~6 GB CUDA stack;
#                 step 4 then stops at TE's first CUDA-only line: it needs a CUDA torch)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-gpu PYTHON=${PYTHON:-} SKIP_STACK=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --venv) VENV=$2; shift 2 ;;
    --python) PYTHON=$2; shift 2 ;;
    --skip-stack) SKIP_STACK=1; shift ;;
    *) echo "install_gpu.sh: unknown argument $1 (use --venv DIR, --python PY, --skip-stack)" >&2; exit 2 ;;
  esac
done
APEX_COMMIT=6424da3b4faa6c8f062da4a48c424fff3f02d42d
step() { echo "[install-gpu] $*"; }
torch_pin=$(grep -E '^torch==' requirements-gpu.txt | cut -d' ' -f1)

[[ -n $PYTHON ]] || PYTHON=$(scripts/find_python.sh)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
step "1/5 build tools (pip, setuptools, wheel, packaging, ninja)"
"${PIP[@]}" install -q --upgrade pip setuptools wheel packaging ninja
step "2/5 $torch_pin (alone)"
"${PIP[@]}" install -q "$torch_pin"
if [[ $SKIP_STACK == 0 ]]; then
  step "3/5 requirements-gpu.txt (vllm CUDA, megatron-core, ray, ...) constrained to $torch_pin"
  "${PIP[@]}" install -q -r requirements-gpu.txt
fi
step "4/5 Transformer Engine (requirements-gpu-te.txt, compiled against $torch_pin)"
"${PIP[@]}" install -q --no-build-isolation -r requirements-gpu-te.txt
if [[ ${APEX:-0} == 1 ]]; then
  step "4b apex at $APEX_COMMIT"
  src=$(mktemp -d)
  git clone -q https://github.com/NVIDIA/apex "$src/apex" && git -C "$src/apex" checkout -q "$APEX_COMMIT"
  "${PIP[@]}" install -v --no-build-isolation --config-settings "--build-option=--cpp_ext" \
    --config-settings "--build-option=--cuda_ext" "$src/apex"
fi
step "5/5 megappo (editable)"
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import megappo, megatron.core, vllm, ray, transformer_engine.pytorch; print('megappo GPU stack OK')"
echo "next: make gpu-check"
