# make run: set up and run the main sweep on the embedded CPU default: the mbs=1 baseline (added by the sweep),
# the original greedy padded budgets and the default balanced packed ones, budgets that plan alike measured once,
# on one backend loaded for the whole sweep (hot=true).
# make test: set up and run the whole test suite, tests/unit and tests/integration (what CI runs).
# make test-fast: set up and run tests/unit only: in-process, no CLI runs, servers or ranks.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Two pytest workers; tests sharing a fixture keep to one (tests/conftest.py). WORKERS= runs them in one process.
WORKERS ?= -n 2 --dist loadgroup
SWEEP ?= mtpm=16384,32768,65536,131072 batching=greedy_padded,default hot=true

.PHONY: setup run test test-fast clean

setup: $(VENV)/.installed

# The venv sees system packages so a machine's own torch (a CUDA build, say) is
# reused; torch==2.13.0 is installed only when no torch is importable. Then the
# harness's pinned requirements and the suite's, and the library from the checkout
# (editable, compat mode: the checkout goes on sys.path, so the harness, backends,
# reports and the Hydra plugin, which the library's wheel leaves out, import from it).
# pip writes each package's bytecode one file at a time; compileall writes them on
# every core (the set-up took 39.5 s with pip's, 31.0 s with it, 2026-12-07, 2 cores),
# and, like pip, goes on past a file that does not compile.
$(VENV)/.installed: pyproject.toml requirements/harness.txt requirements/test.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV) || \
	  { $(PYTHON) -m pip install --user --quiet virtualenv && $(PYTHON) -m virtualenv --system-site-packages $(VENV); }
	@$(BIN)/python -c "import torch" 2>/dev/null && echo "torch present: $$($(BIN)/python -c 'import torch; print(torch.__version__)')" || \
	  $(BIN)/python -m pip install --quiet --no-compile torch==2.13.0
	$(BIN)/python -m pip install --quiet --no-compile -r requirements/harness.txt -r requirements/test.txt
	$(BIN)/python -m pip install --quiet --no-deps --config-settings editable_mode=compat -e .
	@$(BIN)/python -m compileall -qq -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
	@touch $@

run: setup
	$(BIN)/python -m harness -m $(SWEEP)

# Python writes its bytecode caches (git-ignored __pycache__) during the tests even where the environment says not
# to (PYTHONDONTWRITEBYTECODE=1, as on the machines CI runs on): without them pytest rewrites the assertions of every
# test module in every worker at every run (collecting tests/unit: 6.5 s with them unwritten, 3.9 s once written).
TEST_ENV := PYTHONDONTWRITEBYTECODE=

test: setup
	$(TEST_ENV) $(BIN)/python -m pytest -q $(WORKERS)

test-fast: setup
	$(TEST_ENV) $(BIN)/python -m pytest -q $(WORKERS) tests/unit

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
