# Two entry points, each installs what it needs into .venv:
#   make bench   the main job: prefix caching against naive allocation
#   make test    the whole test suite (kernels under TRITON_INTERPRET=1 on a CPU)
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

test: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

bench: install
	$(BIN)/prefixkv bench

.PHONY: install test bench
