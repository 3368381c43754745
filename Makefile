# Two entry points, both doing their own setup on a fresh machine:
#   make run   - the main job on an embedded default
#   make test  - the test suite
# torch is pinned to the CPU wheel: an unpinned `torch` would pull a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# The tiny preset: pp 2 x ep 2 = 4 local gloo ranks, DualPipeV with fb overlap, on the embedded corpus.
run: $(STAMP)
	$(BIN)/fmoe train --metrics runs/tiny/metrics.jsonl --loss-curve runs/tiny/loss-curve.png \
		--trace runs/tiny/trace.json

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25

# On a machine with a GPU or NPU (and torch's device build installed): benchmarks/device_check.py's parts,
# figures in device_check_out/ (about 5-8 minutes on one GPU).
device-check: $(STAMP)
	$(BIN)/python benchmarks/device_check.py --out device_check_out

lint: $(STAMP)
	$(BIN)/ruff check .

.PHONY: setup run test lint device-check
