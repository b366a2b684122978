# Two entry points, each installs what it needs into .venv:
#   make bench   the main job: prefix caching against naive allocation
#   make test    lint, then the whole test suite (kernels under TRITON_INTERPRET=1 on a CPU),
#                vLLM 0.33.0's own scheduler tests on vLLM's manager and on prefixkv's included
#   make lint    ruff (rules in pyproject.toml) and mypy --strict on src/prefixkv
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch 2.13.0, CPU build: PyPI's Linux x86_64 wheel of torch is the CUDA build (526 MB, and
# the nvidia-* wheels it requires), so the CPU build (2.13.0+cpu, which pip ranks above
# 2.13.0) comes from PyTorch's CPU index. Only torch itself (--no-deps): its requirements
# (filelock, sympy, ...) come with the next install, which resolves them for the torch
# installed, from pip's own indexes. A machine that cannot reach PyTorch's index (pip warns,
# retries for about 8 s, goes on) takes torch from its own indexes or find-links;
# `make TORCH_INDEX=` leaves the extra index out.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --no-deps torch==2.13.0 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.[kernels,test,bench]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# vLLM's release files, fetched once (tests/engines/fetch.py): the wheel and the sdist's
# tests/. The wheel goes in --no-deps, with the pure-Python modules its scheduler needs.
ENGINES := .cache/engines
VLLM_VERSION := 0.33.0
$(VENV)/.vllm-installed: $(VENV)/.installed tests/engines/fetch.py tests/engines/vllm-requirements.txt
	$(BIN)/python tests/engines/fetch.py vllm
	$(BIN)/pip install -q --no-deps $(ENGINES)/vllm-$(VLLM_VERSION)-cp38-abi3-manylinux_2_28_x86_64.whl
	$(BIN)/pip install -q -r tests/engines/vllm-requirements.txt
	touch $@

install-vllm: $(VENV)/.vllm-installed

# SGLang's Python sources, --no-deps (tests/engines/sglang_hicache imports its storage
# interface, its backend loader and its page hash, whose C++ source SGLang builds on
# first use with torch's JIT build: ninja here, g++ and OpenSSL's headers on the machine).
SGLANG_VERSION := 0.5.23
$(VENV)/.sglang-installed: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(BIN)/pip install -q ninja
	touch $@

install-sglang: $(VENV)/.sglang-installed

# Any nonzero pytest status fails the target, 5 (no tests collected) included.
# Two pytest-xdist workers, one per core of the 2-core machines this runs on; each takes
# whole files (--dist loadfile), so a module's fixtures are built once, in collection order
# (--no-loadscope-reorder: xdist would otherwise start the files with the most tests first):
# tests/conftest.py puts the longest files first (LONGEST_FIRST), tests/engines/test_vllm_suite.py,
# vLLM's own suite for minutes, at the head, so the run ends on short files on both workers.
# `make test PYTEST_WORKERS=0` runs the tests in one process.
# PYTHONDONTWRITEBYTECODE set empty: bytecode caches (__pycache__/, ignored by git) are
# written whatever the environment says. Each worker compiles and assertion-rewrites every
# test module at collection: 11.3 s of CPU a worker without them, 5.5 s from the second run on.
PYTEST_WORKERS ?= 2
test: install-vllm install-sglang lint
	PYTHONDONTWRITEBYTECODE= TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: install
	$(BIN)/prefixkv bench

.PHONY: install install-vllm install-sglang lint test bench
