# The whole set-up on a fresh machine: `make demo` (the live dashboard) and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PORT    ?= 8501

.PHONY: demo test venv clean-packs

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip wheel

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.runtime

demo: $(VENV)/.runtime
	$(BIN)/python -m streamlit run dashboards/live.py --server.headless true --server.port $(PORT)

test: $(VENV)/.test
	$(BIN)/python -m pytest -q

clean-packs:
	rm -rf $${WORKBENCH_CACHE:-$$HOME/.cache/moe-workbench}/packs
