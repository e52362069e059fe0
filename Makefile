# megatron_moe: set-up, the demo, the tests.
#
#   make demo       set up, then pretrain the tiny GPT-MoE on CPU (examples/pretrain_gpt_moe_tiny_cpu.sh)
#   make test       set up, lint + format check (ruff), check the example scripts' flags, run every tier
#                   (gpu where CUDA is)
#   make test-fast  set up, run the unit tier without its slow tests (under a minute)
#   make test-gpu   set up, run the gpu tier on this machine's GPU (fails where there is none)
#   make test-faults set up, run the fault battery (tests/faults, under 4 minutes)
#   make lint       ruff's lint and format check;  make format  applies ruff's fixes and formatting
#   make install    set up only: .venv with torch first, then this package editable with its test extra
#   make clean      remove runs/, data/ and caches;  make distclean also removes the venv
#
# Test tiers are pytest markers (pyproject.toml; tests/conftest.py marks each test by its folder):
# unit, distributed (torchrun, gloo), faults (the fault battery), slurm (a private cluster; skipped without root/apt-get),
# gpu (skipped without CUDA), slow (unit tests of several seconds). A tier alone, e.g.:
#   make test PYTEST_ARGS="-q -m distributed"      make test PYTEST_ARGS="-q -m 'not slurm'"
#
# Variables: VENV (.venv), PYTHON_BOOTSTRAP (python3.11, else python3), TORCH_SPEC
# (torch==2.13.0: the CPU wheel on this machine's disk, the CUDA build from PyPI
# elsewhere; empty: keep the torch the venv sees), EXTRAS (test; test,gpu on GPUs),
# VENV_ARGS (e.g. --system-site-packages in a container that ships torch),
# PYTEST_ARGS, DEMO_ARGS (extra trainer flags for the demo, e.g. --train-iters 20).

SHELL := /bin/bash
.DEFAULT_GOAL := help
.PHONY: help install bytecode demo test test-fast test-gpu test-faults lint format check-examples clean distclean

VENV ?= .venv
PYTHON_BOOTSTRAP ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test
VENV_ARGS ?=
PYTEST_ARGS ?= -q -ra --durations=10
DEMO_ARGS ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.megatron_moe-installed
DEMO_RUN_DIR := runs/gpt_moe_tiny_cpu
export PIP_DISABLE_PIP_VERSION_CHECK := 1

help:
	@sed -n '3,10p' Makefile | sed 's/^# *//'

$(PY):
	@test -n "$(PYTHON_BOOTSTRAP)" || { echo "error: no python3.11 or python3 on PATH (set PYTHON_BOOTSTRAP)"; exit 2; }
	$(PYTHON_BOOTSTRAP) -m venv $(VENV_ARGS) $(VENV)

# torch goes in first and alone: anything that depends on torch, installed
# before it, makes pip fetch a multi-GB CUDA build. Re-run when setup.py changes.
$(STAMP): setup.py | $(PY)
	$(if $(strip $(TORCH_SPEC)),$(PY) -m pip install "$(TORCH_SPEC)")
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

# Every `make demo` is a fresh run (the script itself resumes from its checkpoint).
demo: $(STAMP)
	rm -rf $(DEMO_RUN_DIR)
	PYTHON="$(abspath $(PY))" RUN_DIR="$(abspath $(DEMO_RUN_DIR))" bash examples/pretrain_gpt_moe_tiny_cpu.sh $(DEMO_ARGS)

# Each example's flags parsed and checked against its intended world size (no training).
check-examples: $(STAMP)
	@set -e; export PYTHON="$(abspath $(PY))" DRY_RUN=1 DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/data/tokenizer.model MASTER_ADDR=node0; \
	for spec in pretrain_gpt_moe_tiny_cpu:1:2 pretrain_gpt2_s_moe:1:8 pretrain_gpt2_l_moe:2:8 pretrain_mixtral_8x7b:8:8; do \
		IFS=: read -r name nodes gpus <<<"$$spec"; \
		echo -n "examples/$$name.sh ($$nodes x $$gpus): "; \
		NNODES=$$nodes GPUS_PER_NODE=$$gpus bash examples/$$name.sh | tail -n1; \
	done

# Lint and formatting (settings in pyproject.toml): seconds, so it runs before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Bytecode for this tree's own modules, written once: the suite starts hundreds of Python processes (torchrun ranks,
# tools), and under PYTHONDONTWRITEBYTECODE=1 (set on this project's machines) each compiled the ~30k lines it
# imports anew, 0.8 s of CPU a process. Python reads these wherever that is set, and recompiles a file that changed.
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 megatron_moe tools tests pretrain_gpt_moe.py >/dev/null

test: lint check-examples bytecode
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-fast: bytecode
	$(PY) -m pytest tests -m "unit and not slow" $(PYTEST_ARGS)

# The fault battery alone (tests/faults, under 4 minutes): kill -9 in a save, preemption, two jobs, full disk, ...
test-faults: bytecode
	$(PY) -m pytest tests -m faults $(PYTEST_ARGS)

# The gpu tier alone, each test's own output shown (the Mixtral-shaped run prints its kernels, MFU and memory).
test-gpu: bytecode
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch sees no CUDA GPU here')"
	$(PY) -m pytest tests -m gpu -rA $(PYTEST_ARGS)

clean:
	rm -rf runs data build .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
