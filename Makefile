# Two entry points, each self-installing on a fresh machine:
#   make demo   - the offline demo on the built-in scripted model (no API key)
#   make test   - ruff, mypy and the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint bench-kernel clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/queryloop demo

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q

bench-kernel: $(BIN)/.installed
	$(BIN)/python -m bench kernel

clean:
	rm -rf $(VENV) *.egg-info
