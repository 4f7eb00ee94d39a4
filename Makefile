# Every target installs what it needs first, so a fresh clone needs nothing but python3.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test lint unit demo up clean

$(STAMP): pyproject.toml examples/loom-guess/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,trl]'
	# The example environments, installed as an operator installs a user's package (tests run jobs on them).
	$(PY) -m pip install -q --no-deps --no-build-isolation -e examples/loom-guess
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check libs services cli tests examples
	$(VENV)/bin/ruff format --check libs services cli tests examples
	$(VENV)/bin/mypy libs/loom services cli/loom_cli

test: lint
	$(VENV)/bin/pytest -q -ra

unit: install
	$(VENV)/bin/pytest -q -ra tests/unit

demo: install
	$(VENV)/bin/loom demo

up: install
	$(VENV)/bin/loom up

clean:
	rm -rf $(VENV) .loom .pytest_cache .mypy_cache .ruff_cache
