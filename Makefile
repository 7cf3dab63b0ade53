# Two entry points, each self-installing on a fresh machine (Python >= 3.11 and make):
#   make demo   - installs the package alone and runs the offline demo (no API key)
#   make test   - installs the package with its `dev` extra, then runs ruff, mypy and the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint bench-kernel clean

# The package and its own dependencies: what `pip install queryloop` gives a user.
$(VENV)/.package: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

# Everything the tests, the examples and the benchmarks use (Ray, MCP, matplotlib, ruff, mypy ...).
$(VENV)/.dev: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.package

demo: $(VENV)/.package
	$(BIN)/queryloop demo

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The suite on TEST_WORKERS processes (pytest-xdist). Two, not `auto`: `auto` counts physical cores, one on
# a two-vCPU machine such as CI's. `--dist loadfile` keeps each test module on one worker, so a module-wide
# fixture is made once, not once per worker (tests/hosts/test_ray.py's Ray cluster, test_packaging.py's
# wheel and environment, test_readme.py's run of every example). `make test TEST_WORKERS=0`: one process.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

bench-kernel: $(VENV)/.dev
	$(BIN)/python -m bench kernel

clean:
	rm -rf $(VENV) *.egg-info
