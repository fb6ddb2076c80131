# Two commands from a fresh clone: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,sam,report]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/streamxm demo

test: install
	$(PY) -m ruff check streamxm api workers tests
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .streamxm
