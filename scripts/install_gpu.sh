#!/usr/bin/env bash
# The GPU stack (CUDA 13: an NVIDIA driver >= 580; x86_64, Python 3.12) in its own venv: `make install-gpu`
# runs this.
# Every pin lives in a requirements file that tools/gpu_check.py reads back (requirements-gpu.txt,
# requirements-gpu-te.txt); the order matters (docs/ENVIRONMENT.md, "Installing TE 2.11.0"):
#   1. build tools first: transformer_engine_torch is an sdist built with --no-build-isolation, and its
#      setup.py imports `wheel` and `packaging` (pip installs nothing for it then); ninja keeps torch's
#      extension build off the slow distutils backend
#   2. torch 2.13.0 alone (PyPI's linux x86_64 wheel is the CUDA 13 build vllm 0.32.0 was compiled against)
#   3. the stack (vllm 0.32.0 CUDA, megatron-core, ray, ...), never allowed to replace that torch
#   4. Transformer Engine, compiled against that torch (a C++17 compiler; TE reads the CUDA version from nvcc
#      and takes its headers from one toolkit: te_build_env below picks them, docs/ENVIRONMENT.md, "TE 2.17.1's build")
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
die() { echo "install-gpu: $*" >&2; exit 1; }
torch_pin=$(grep -E '^torch==' requirements-gpu.txt | cut -d' ' -f1)

# PyPI's torch 2.13.0 is a CUDA 13.0 build; CUDA 13.x runs on NVIDIA drivers >= 580 only (older: torch sees no GPU)
if drv=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1) && [[ $drv =~ ^[0-9]+ ]]; then
  (( ${drv%%.*} >= 580 )) || die "NVIDIA driver $drv is older than 580, the minimum for $torch_pin (a CUDA 13 build): update the driver first"
  step "NVIDIA driver $drv (>= 580, CUDA 13)"
else
  step "no driver version from nvidia-smi here: where this venv runs, the NVIDIA driver must be >= 580 (CUDA 13)"
fi

# Transformer Engine's build (transformer_engine_torch 2.17.1, build_tools/utils.py) takes its CUDA headers from
# ONE include dir, $CUDA_HOME/include, else nvcc's on PATH, else /usr/local/cuda's, and the CUDA version from that
# toolkit's nvcc (none: RuntimeError). It compiles with g++ (no torch CUDA-version check), so a CUDA 12 toolkit
# would go into a CUDA 13 torch's extension: refused. Its extension includes <cudnn.h> and <nccl.h>, which a stock
# toolkit lacks and torch's nvidia-cudnn / nvidia-nccl wheels hold: CPATH adds those two dirs. Not
# NVTE_BUILD_USE_NVIDIA_WHEELS=1: it drops the toolkit's dir, and torch's wheels lack crt/ and nv/target.
# No toolkit: the venv's nvidia/cuXX from cuda-toolkit[nvcc,cccl] at torch's cuda-toolkit version.
te_build_env() {
  local py=$VENV/bin/python torch_cuda site wheels root nvcc ver h
  torch_cuda=$("$py" -c 'import torch; print(torch.version.cuda or "")')
  [[ -n $torch_cuda ]] || return 0  # a CPU torch: TE's setup.py stops at its first CUDA-only line anyway
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  wheels=$site/nvidia/cu${torch_cuda%%.*}
  if [[ -n ${CUDA_HOME:-} ]]; then root=$CUDA_HOME
  elif nvcc=$(command -v nvcc); then root=${nvcc%/bin/nvcc}
  elif [[ -d /usr/local/cuda ]]; then root=/usr/local/cuda
  else root=$wheels
  fi
  if [[ $root == "$wheels" && ! -x $wheels/bin/nvcc ]]; then
    ver=$("$py" -c 'from importlib.metadata import version; print(version("cuda-toolkit"))')
    step "4/5 no CUDA toolkit: nvcc + headers from cuda-toolkit[nvcc,cccl]==$ver (torch's) into $wheels"
    "${PIP[@]}" install -q "cuda-toolkit[nvcc,cccl]==$ver"
  fi
  nvcc=$root/bin/nvcc
  [[ -x $nvcc ]] || die "no nvcc at $nvcc: Transformer Engine reads the CUDA version from it; set CUDA_HOME to a CUDA $torch_cuda toolkit"
  ver=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
  [[ ${ver%%.*} == "${torch_cuda%%.*}" ]] || die "the CUDA toolkit at $root is $ver, $torch_pin a CUDA $torch_cuda build: TE would compile against $ver headers; set CUDA_HOME to a CUDA ${torch_cuda%%.*} toolkit, or to $wheels (nvcc then installed there)"
  [[ -f $root/include/cuda_runtime.h ]] || die "no cuda_runtime.h in $root/include, where TE takes its CUDA headers from: set CUDA_HOME to the toolkit's root"
  export CUDA_HOME=$root PATH=$root/bin:$PATH
  for h in cudnn nccl; do
    [[ -f $root/include/$h.h ]] && continue
    [[ -f $site/nvidia/$h/include/$h.h ]] || die "no $h.h in $root/include nor in the venv's nvidia-$h wheel ($site/nvidia/$h/include)"
    export CPATH=$site/nvidia/$h/include${CPATH:+:$CPATH}
  done
  step "4/5 TE builds with CUDA $ver from $root${CPATH:+ (+ CPATH $CPATH)}"
}

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
te_build_env
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
"$VENV/bin/python" scripts/declare_top_level.py  # (as make install: transformers' import, ~1 s less per process)
"$VENV/bin/python" -c "import megappo, megatron.core, vllm, ray, transformer_engine.pytorch; print('megappo GPU stack OK')"
echo "next: make gpu-check"
