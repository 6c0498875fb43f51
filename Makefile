# Two commands (see README):  make run   |   make test
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-sdk bench-quick report clean

$(STAMP): pyproject.toml edge_sdk/pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (Python 3.11 is required; set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ./edge_sdk --config-settings editable_mode=compat
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

## the main job on the embedded default data set (scikit-learn's 8x8 digits, no download):
## federated training -> ONNX bundle -> new clients personalise on onnxruntime (no torch on the device side)
run: $(STAMP)
	$(BIN)/fl-server train --dataset digits --method TENT --out runs/default
	$(BIN)/fl-server export runs/default --out runs/default-bundle
	$(BIN)/python examples/personalize_on_device.py --bundle runs/default-bundle

## the whole test suite (real MNIST / Fashion-MNIST from ../shared/data when present)
test: $(STAMP)
	$(BIN)/python -m pytest -q

## edge_sdk alone in a fresh venv: proves `pip install ./edge_sdk` pulls no torch
test-sdk: $(STAMP)
	bash scripts/check_edge_sdk_venv.sh

bench-quick: $(STAMP)
	$(BIN)/fl-server bench upfl-table1 --quick --seeds 1

report: $(STAMP)
	$(BIN)/fl-server report

clean:
	rm -rf runs .pytest_cache
