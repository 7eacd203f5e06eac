# Each target builds its own virtualenv from nothing; second runs reuse it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rayrb-installed
# The offline scikit-learn OpenML cache, when this checkout sits beside ../shared.
DATA_HOME ?= $(if $(wildcard ../shared/data/openml),../shared/data,)
DATASET ?= openml:shuttle
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0

.PHONY: install test test-fast test-bench lint docs docs-check demo bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel on this machine's disk; a plain `torch` pulls a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Two pytest workers, each with its own local Ray, a test file at a time on one worker (a module's shared actors
# stay with it): a serial run leaves about a quarter of the CPU idle while actors start. Files go out in the order
# tests/conftest.py gives them (the longest first), not xdist's (most tests first). TEST_WORKERS=0: serial.
# Bytecode written first: every actor's process imports rayrb (and test-defined actors their test module), some
# 1,800 processes a run, and with PYTHONDONTWRITEBYTECODE set (as on these machines) each compiled it again.
TEST_WORKERS ?= 2
test: install lint docs
	$(PY) -m compileall -q rayrb tests
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The benchmark's smoke sections outside `make test` (all but the headline: sampling, writing, preprocess, draw path,
# consumers, real data, two nodes, two copies, slices, start-up, cold reads): minutes,
# so apart; run them after touching pipelines/bench/.
test-bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m pytest -q -m bench tests/test_benchmark.py

# The layers without Ray: pure decisions and durability (no actors), with their doctests. Seconds, not minutes:
# on two workers 19 to 21 s here, against 25 to 29 s in one process (TEST_WORKERS=0).
test-fast: install
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS)) -m "not ray" tests/core tests/durability \
		rayrb/core rayrb/durability rayrb/errors.py

lint: install
	$(PY) -m ruff check .

# The docs site (MkDocs, Material, an API reference from the docstrings) into build/site; --strict: a broken link,
# a missing page or a reference to a name that does not exist fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Every page opened in headless Chromium (Debian's, installed here if missing); screenshots in build/screenshots.
docs-check: docs
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	$(PY) scripts/docs_check.py --site build/site --out build/screenshots

demo: install
	$(PY) pipelines/train_bandit.py --dataset $(DATASET) $(if $(DATA_HOME),--data-home $(DATA_HOME),)

bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) pipelines/benchmark.py $(if $(DATA_HOME),--data-home $(DATA_HOME),)

clean:
	rm -rf $(VENV) build *.egg-info
