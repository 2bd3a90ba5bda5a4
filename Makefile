# Every target creates .venv itself on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINT_PATHS := src tests $(wildcard bench) $(wildcard examples)

.PHONY: venv test test-fast test-full lint typecheck format demo recipes-check clean

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

# mypy over src/ (configured in pyproject.toml [tool.mypy]); CI starts without a cache.
typecheck: $(STAMP)
	$(BIN)/mypy src

format: $(STAMP)
	$(BIN)/ruff format $(LINT_PATHS)
	$(BIN)/ruff check --fix $(LINT_PATHS)

# The README's test command: every test, the slow guarantees included (torchrun DDP/FSDP2
# equivalence and kill-and-resume, the bad-input matrix, Ray failure handling). Two pytest
# workers (one per core of the CI machine), a test file per worker at a time so that a
# file's module fixtures are built once.
TEST_WORKERS ?= 2
test: lint typecheck
	CI=true $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=15

# A quick development loop without the tests marked slow.
test-fast: lint typecheck
	CI=true $(BIN)/python -m pytest -m "not slow"

test-full: test

demo: $(STAMP)
	$(BIN)/uniweave demo --out runs/demo

# Every recipe after the recipes its header names (`# needs:`), 2 updates each, in a temporary
# copy of recipes/ and examples/ (tests/recipe_chains.py; also tests/test_recipes.py, slow).
recipes-check: $(STAMP)
	$(BIN)/python tests/recipe_chains.py

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info
