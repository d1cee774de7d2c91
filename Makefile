# `make demo` and `make test` each create .venv if missing, install what they need, and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test verify clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dsattn demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

verify: $(STAMP)
	$(BIN)/dsattn verify

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
