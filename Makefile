# The two commands of the README: `make demo` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= 2

.PHONY: setup demo test clean-demo

$(BIN)/dflash-pipeline: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first, so that the unpinned torch requirement does not pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/dflash-pipeline

demo: setup
	PATH=$(CURDIR)/$(BIN):$$PATH snakemake --cores $(CORES) --profile profiles/local

test: setup
	$(BIN)/python -m pytest -q --durations=25 tests

clean-demo:
	rm -rf results resources data/demo .snakemake
