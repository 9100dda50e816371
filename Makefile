# Set-up and checks. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck pytest bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,torch]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/digits.py

lint: $(STAMP)
	$(BIN)/ruff check stagetree tests benchmarks examples
	$(BIN)/ruff format --check stagetree tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_bench.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
