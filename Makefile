# Two commands do everything on a fresh machine:
#   make run    install, then run the main job on its embedded default (CPU or GPU):
#               deepspeed launch/train.py --deepspeed ds_configs/zero2_offload.json
#   make test   install the test extras, then run the test suite
# TORCH pins the PyTorch wheel installed first, so pip does not pull a different (multi-GB CUDA) build
# through the other dependencies; on a GPU machine pass the build you want, e.g. TORCH="torch==2.11.0".

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: run demo test install install-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"

install: $(BIN)/python
	$(BIN)/pip install -q -e .

install-test: $(BIN)/python
	$(BIN)/pip install -q -e ".[test]"

run: install
	$(BIN)/deepspeed launch/train.py --deepspeed ds_configs/zero2_offload.json

demo: install
	$(BIN)/python launch/demo.py

test: install-test
	$(BIN)/python -m pytest -q
