# Every target creates .venv itself on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINT_PATHS := src tests $(wildcard bench)

.PHONY: venv test test-full lint format demo clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,wandb,ray]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

format: $(STAMP)
	$(BIN)/ruff format $(LINT_PATHS)
	$(BIN)/ruff check --fix $(LINT_PATHS)

test: lint
	CI=true $(BIN)/python -m pytest -m "not slow"

test-full: lint
	CI=true $(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/unirl demo --out runs/demo

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
