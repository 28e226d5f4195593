# Quick start: `make demo` and `make test`. Both create .venv when it is missing
# and install the project into it (editable) before running.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
PYTEST_ARGS ?=

export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONUNBUFFERED = 1

.PHONY: demo test install bench clean help
.PHONY: test-torch
# Tests that run on every Keras backend (Keras fixes its backend at import, so each
# backend gets its own pytest process): JAX inside `make test`, PyTorch opt-in.
MULTIBACKEND_TESTS := tests/test_models_backends.py tests/test_training_backends.py

help:
	@echo "make demo   - set up .venv and run the end-to-end demo on bundled data"
	@echo "make test   - set up .venv and run the test suite"
	@echo "make bench  - run the benchmarks in benchmarks/ (long)"
	@echo "make test-torch - the multi-backend model/training tests on PyTorch (CPU)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(STAMP): setup.py | $(BIN)/python
	$(BIN)/python -m pip install -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tfaploss demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	KERAS_BACKEND=jax $(BIN)/python -m pytest $(PYTEST_ARGS) $(MULTIBACKEND_TESTS)

test-torch: $(STAMP)
	KERAS_BACKEND=torch $(BIN)/python -m pytest $(PYTEST_ARGS) $(MULTIBACKEND_TESTS)

bench: $(STAMP)
	$(BIN)/python benchmarks/losses.py

clean:
	rm -rf $(VENV) build *.egg-info
