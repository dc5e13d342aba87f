# The whole set-up on a fresh machine: `make demo` (the live dashboard) and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PORT    ?= 8501
HOST    ?= 127.0.0.1

.PHONY: demo booth test browser venv notebooks figures notebook-outputs clean-packs

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip wheel

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# llama-cpp-python (test extra) builds llama.cpp with -march=native. On Intel CPUs with AMX, GCC 12 miscompiles
# ggml's AMX k-quant kernel (it faults on batches of 2+ tokens), so x86 builds leave AMX out where the compiler
# knows the flags. (pip's wheel cache keeps serving a build made before this; engines/llamacpp_engine.py turns
# ggml's extra buffer types, AMX among them, off at run time on every build.)
NO_AMX := $(shell echo | c++ -x c++ -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -E - >/dev/null 2>&1 && echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")

$(VENV)/.test: pyproject.toml | $(BIN)/python
	CFLAGS="$(NO_AMX) $$CFLAGS" CXXFLAGS="$(NO_AMX) $$CXXFLAGS" $(BIN)/pip install -q -e ".[test]"
	touch $@

# OpenCompass (tests/test_opencompass_*.py) runs in its own environment: it needs numpy<2 and pyarrow<19, which the
# workbench's own environment cannot hold (evals/opencompass/README.md).
OC_VENV := .venv-opencompass
$(OC_VENV)/.ok:
	$(PY) -m venv $(OC_VENV)
	$(OC_VENV)/bin/pip install -q --upgrade pip
	$(OC_VENV)/bin/pip install -q "opencompass==0.5.4" "numpy<2" "pyarrow<19" "torch==2.13.0"
	touch $@

# The browser test (tests/test_dashboard_e2e.py) drives Debian's chromium: installed here when root, else said loudly.
# On macOS it drives Google Chrome or Chromium from /Applications, never installed here.
CHROMIUM := /usr/bin/chromium
UNAME := $(shell uname -s)
MAC_BROWSERS := "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome" "/Applications/Chromium.app/Contents/MacOS/Chromium"
browser:
ifeq ($(UNAME),Darwin)
	@for b in $(MAC_BROWSERS); do test -x "$$b" && exit 0; done; \
	  echo "*** make test: no Google Chrome or Chromium in /Applications, so the dashboard browser test (tests/test_dashboard_e2e.py) will SKIP. Enable it by installing Google Chrome, then run make test again. ***" >&2
else
	@test -x $(CHROMIUM) || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "*** make test: $(CHROMIUM) is missing, so the dashboard browser test (tests/test_dashboard_e2e.py) will SKIP. Enable it with: sudo apt-get install -y chromium, then run make test again. ***" >&2
endif

venv: $(VENV)/.runtime

# The page listens on this machine only; HOST=0.0.0.0 opens it to the network (docs/booth.md: what that exposes).
demo: $(VENV)/.runtime
	$(BIN)/python -m streamlit run dashboards/live.py --server.headless true --server.address $(HOST) --server.port $(PORT)

# A booth: every model, pack and trace it shows made first, then the kiosk page; ARGS are its options (docs/booth.md).
booth: $(VENV)/.runtime
	$(BIN)/python -m dashboards.booth --host $(HOST) --port $(PORT) $(ARGS)

test: $(VENV)/.test $(OC_VENV)/.ok browser
	$(BIN)/python -m pytest -q

$(VENV)/.notebooks: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[notebooks]"
	touch $@

notebooks: $(VENV)/.notebooks
	$(BIN)/jupyter lab --allow-root notebooks/

# The full setting, cold: the results/ tables the notebooks share numbers with, then every notebook run in place
# (outputs stored, figures in notebooks/figures/, each stamped). `make notebook-outputs NOTEBOOKS=les_ablation`
# reruns notebooks alone.
NOTEBOOKS ?= $(basename $(notdir $(wildcard notebooks/*.ipynb)))
figures: $(VENV)/.notebooks
	$(BIN)/python benchmarks/ladders.py --model demo --budget 0.25 --tokens 48 --rounds 3
	$(BIN)/python benchmarks/regimes.py --rounds 3 --tokens 32
	$(MAKE) notebook-outputs

notebook-outputs: $(VENV)/.notebooks
	for nb in $(NOTEBOOKS); do PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=3600 "notebooks/$$nb.ipynb" || exit 1; done

clean-packs:
	rm -rf $${WORKBENCH_CACHE:-$$HOME/.cache/moe-workbench}/packs
