# make run: set up and run the main sweep on the embedded CPU default.
# make test: set up and run the test suite (what CI runs).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SWEEP ?= mtpm=16384,32768,65536,131072

.PHONY: setup run test clean

setup: $(VENV)/.installed

# The venv sees system packages so a machine's own torch (a CUDA build, say) is
# reused; torch==2.13.0 is installed only when no torch is importable.
$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV) || \
	  { $(PYTHON) -m pip install --user --quiet virtualenv && $(PYTHON) -m virtualenv --system-site-packages $(VENV); }
	@$(BIN)/python -c "import torch" 2>/dev/null && echo "torch present: $$($(BIN)/python -c 'import torch; print(torch.__version__)')" || \
	  $(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@

run: setup
	$(BIN)/python -m harness -m $(SWEEP)

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
