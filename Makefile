# Two commands from a fresh clone: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-long lint install clean gpu-check

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,sam,report,ray]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/streamxm demo

test: install
	$(PY) -m ruff format --check streamxm api workers tests
	$(PY) -m ruff check streamxm api workers tests
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not long"

# The long tests (quality on the benchmark data, long streams): CI runs them after `make test`.
test-long: install
	$(PY) -m pytest -q -m long

# On a machine with CUDA: SAM learning and a shard's tower rebuild on CUDA against the CPU.
gpu-check: install
	$(PY) scripts/gpu_check.py

clean:
	rm -rf $(VENV) .streamxm
