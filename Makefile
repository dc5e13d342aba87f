# The whole set-up on a fresh machine: `make demo` (the live dashboard) and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PORT    ?= 8501

.PHONY: demo test venv notebooks figures clean-packs

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

$(VENV)/.notebooks: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[notebooks]"
	touch $@

notebooks: $(VENV)/.notebooks
	$(BIN)/jupyter lab --allow-root notebooks/

# The full setting: rewrites notebooks/figures/*.png; the stored notebooks stay without outputs.
figures: $(VENV)/.notebooks
	for nb in notebooks/*.ipynb; do PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=1800 --output-dir "$${TMPDIR:-/tmp}" "$$nb" || exit 1; done

clean-packs:
	rm -rf $${WORKBENCH_CACHE:-$$HOME/.cache/moe-workbench}/packs
