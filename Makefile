# Two commands (see README):  make run   |   make test
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast test-lab test-sdk bench-quick report clean

$(STAMP): pyproject.toml setup.py edge_sdk/pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (Python 3.11 is required; set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,flower]'
	@# the coordinator requires the SDK from ./edge_sdk by path (setup.py); make that copy editable too
	$(BIN)/pip install -q --no-deps -e ./edge_sdk --config-settings editable_mode=compat
	@touch $(STAMP)

setup: $(STAMP)

## the main job on the embedded default data set (scikit-learn's 8x8 digits, no download): the coordinator
## comes up, trains and exports its default bundles in the background, a device joins it, personalises and
## streams predictions (onnxruntime, no torch on the device side); then the coordinator stops
run: $(STAMP)
	BIN=$(BIN) bash scripts/run_default.sh

## the whole test suite (real MNIST / Fashion-MNIST from ../shared/data when present); one worker per core, at most
## four, each taking whole test files (a file's fixtures are built once); PYTEST_WORKERS=0 runs it in one process
PYTEST_WORKERS ?= auto
WORKERS := -n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadfile
test: $(STAMP)
	$(BIN)/python -m pytest -q $(WORKERS)

## the fast lane for development: the tests under ~5 s each (leaves out those marked slow: tests/slow_tests.txt)
## it skips only what make test skips where both run (what the machine lacks: docs/cli.md, Tests)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(WORKERS)

## the results lab's own tests (lab/: the paper-reproduction harness, outside the package; CI runs them after make test)
test-lab: $(STAMP)
	$(BIN)/python -m pytest -q lab/tests

## edge_sdk alone in a fresh venv: proves `pip install ./edge_sdk` pulls no torch
test-sdk: $(STAMP)
	PYTHON=$(PYTHON) bash scripts/check_edge_sdk_venv.sh

bench-quick: $(STAMP)
	$(BIN)/python -m lab bench upfl-table1 --quick --seeds 1

report: $(STAMP)
	$(BIN)/python -m lab report

clean:
	rm -rf runs .pytest_cache
