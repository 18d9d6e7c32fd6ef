# Every target that runs project code first runs scripts/setup.sh (fast when already set up), so
# `make demo` and `make test` work on a fresh machine.
VENV   := .venv
BIN    := $(VENV)/bin
PYTHON := $(BIN)/python

export MC_LOG_LEVEL ?= WARNING
export NO_MKDOCS_2_WARNING ?= 1

.DEFAULT_GOAL := help
.PHONY: help setup demo test test-gpu soak lint format typecheck docs docs-serve bench bench-full interop vllm clean

help:
	@echo "make setup    create .venv, install Debian libraries and pip packages (idempotent)"
	@echo "make demo     run the demo: one prefill -> decode KV-cache transfer on this machine"
	@echo "make test     ruff + mypy + mkdocs --strict + check-site + pytest (what CI runs)"
	@echo "make test-gpu the GPU tests (CUDA KV on both sides, device staging); they skip without a GPU"
	@echo "make soak     the interleaving state machine with a large example budget (SOAK_EXAMPLES, SOAK_STEPS)"
	@echo "make lint     ruff + mypy"
	@echo "make format   ruff format + ruff check --fix"
	@echo "make docs     build the documentation into site/"
	@echo "make bench    raw Mooncake vs aiotransfer on this machine (aiotransfer bench)"
	@echo "make bench-full  every suite figure, every engine (python -m benchmarks full; BENCH_ARGS=--quick)"
	@echo "make interop  tests against SGLang (needs the SGLang venv)"
	@echo "make vllm     tests against vLLM for CPU (builds the vLLM venv)"

setup:
	@bash scripts/setup.sh

demo: setup
	$(PYTHON) -m aiotransfer demo

test: setup
	@bash scripts/interop-venv.sh >/dev/null  # SGLang 0.5.23 for the interop tests (cached per machine)
	@bash scripts/vllm-venv.sh >/dev/null || echo "[make] the vLLM venv could not be built: the vLLM tests will be skipped"
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/mkdocs build --strict --quiet
	$(PYTHON) scripts/check-site.py site
	$(BIN)/pytest -q

test-gpu: setup
	$(BIN)/pytest -m gpu -s

SOAK_EXAMPLES ?= 2000
SOAK_STEPS    ?= 60

soak: setup
	AIOTRANSFER_INTERLEAVING_EXAMPLES=$(SOAK_EXAMPLES) AIOTRANSFER_INTERLEAVING_STEPS=$(SOAK_STEPS) \
		$(BIN)/pytest -q -s -p no:cacheprovider -o timeout=0 tests/test_interleavings.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: setup
	$(BIN)/mypy

docs: setup
	$(BIN)/mkdocs build --strict
	$(PYTHON) scripts/check-site.py site

docs-serve: setup
	$(BIN)/mkdocs serve

bench: setup
	$(PYTHON) -m aiotransfer bench

bench-full: setup
	$(PYTHON) -m benchmarks full $(BENCH_ARGS)

interop: setup
	@bash scripts/interop-venv.sh
	$(BIN)/pytest -q -m interop

vllm: setup
	@bash scripts/vllm-venv.sh >/dev/null
	$(BIN)/pytest -q -m vllm

clean:
	rm -rf site build dist .cache .pytest_cache .mypy_cache .ruff_cache .hypothesis
