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

# Benchmarks print markdown tables (figures go to benchmarks/RESULTS.md by hand) and
# write plots to benchmarks/out/. The peers (Ray Tune, Optuna) and matplotlib are
# benchmark-only dependencies.
bench: $(STAMP)
	$(BIN)/pip install -q -r requirements-bench.txt
	mkdir -p benchmarks/out
	$(BIN)/python benchmarks/plan_bench.py
	$(BIN)/python benchmarks/overhead_bench.py
	$(BIN)/python benchmarks/study_bench.py --plot benchmarks/out/study_bench.png
	$(BIN)/python benchmarks/paper_studies.py --plot benchmarks/out/paper_studies.png
	$(BIN)/python benchmarks/scheduler_compare.py --plot benchmarks/out/scheduler_compare.png
	$(BIN)/python benchmarks/vs_peers.py --plot benchmarks/out/vs_peers.png
	$(BIN)/python benchmarks/ray_bench.py --plot benchmarks/out/ray_bench.png
	$(BIN)/python benchmarks/fusion_bench.py --plot benchmarks/out/fusion_bench.png
	$(BIN)/python benchmarks/startup_bench.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
