# Two entry points, each installs what it needs into .venv:
#   make bench   the main job: prefix caching against naive allocation
#   make test    lint, then the whole test suite (kernels under TRITON_INTERPRET=1 on a CPU)
#   make lint    ruff (rules in pyproject.toml) and mypy --strict on src/prefixkv
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	# CPU build of torch, pinned: a bare `torch` requirement would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[kernels,test,bench]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# Any nonzero pytest status fails the target, 5 (no tests collected) included.
test: lint
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

bench: install
	$(BIN)/prefixkv bench

.PHONY: install lint test bench
