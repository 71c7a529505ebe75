# Set-up is part of every target: on a fresh machine `make train` or `make test` is all it takes.
# torch is pinned *before* the package is installed: an unpinned torch pulls several GB of CUDA wheels
# (on this project's CPU machines `torch==2.13.0` resolves to the CPU wheel on disk). Override with
# `make test TORCH=torch==2.4.1` (or TORCH= to keep whatever torch the interpreter already has).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test bench lint notebooks

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# The main job: the sample digits CNN with mgpu_ddp (2 CPU processes without a GPU).
train: $(STAMP)
	$(BIN)/python -m lightning_mgpu.examples.train

test: $(STAMP)
	$(BIN)/python -m pytest

# Re-run every notebook and store its outputs (tests/test_notebooks.py fails on outputs older than the cells).
notebooks: $(STAMP)
	$(BIN)/python notebooks/execute.py --write notebooks/*.ipynb

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_ddp.py

lint: $(STAMP)
	$(BIN)/python -m pip install -q ruff mypy
	$(BIN)/ruff check lightning_mgpu tests benchmarks
	$(BIN)/mypy lightning_mgpu
