# txbroker — the two sacred commands: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DATA   ?= ./txbroker-data

.PHONY: venv run test lint typecheck unit bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: venv
	$(VENV)/bin/txbroker serve --data $(DATA)

lint: venv
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy src

test: venv lint
	$(PY) -m pytest -q

bench: venv
	$(PY) bench/run_core.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
