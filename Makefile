# Two commands on a fresh machine: `make run` and `make test`. Both build .venv themselves.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
# VENV may point at an existing environment (the fresh-clone test reuses the suite's).
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Bytecode caches for the project's own modules (gitignored __pycache__/): with
# PYTHONDONTWRITEBYTECODE set, as some CI images do, every API, worker, slot and run process compiled
# the trainjobs sources it imports again (~0.1 s of CPU each start; the suite starts hundreds).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test lint typecheck pytest venv clean bench chromium

# The venv is filled by uv (itself from PyPI, into the venv): the same versions as pip resolves, in
# about 15 s here against pip's 90, and a clean clone's `make test` builds it every time. uv reads no
# pip configuration, so PIP_FIND_LINKS (where a machine keeps local wheels, such as a CPU torch) is
# handed over.
UV := $(if $(PIP_FIND_LINKS),UV_FIND_LINKS="$(PIP_FIND_LINKS)") UV_PYTHON=$(BIN)/python $(BIN)/python -m uv pip

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv
	$(UV) install -q --upgrade pip
	# torch pinned in the one resolution: the CPU wheel on this disk, never an unpinned CUDA build.
	$(UV) install -q -e '.[all,dev]' torch==2.13.0
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/trainjobs dev --example

lint: $(STAMP)
	$(BIN)/ruff check trainer_core service_core api worker trainjobs tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

# The browser tests (tests/ui) drive the distribution's Chromium through Playwright (a dev extra);
# Playwright's own browser download is often unreachable. Installed when missing and we are root.
chromium:
	@test -x /usr/bin/chromium || [ "$$(id -u)" != 0 ] || { apt-get update -q && apt-get install -y -q chromium; }

# Three test processes on the two cores by default (xdist; tests/conftest.py says how the work is split).
# With two, both cores were idle a quarter of the time, each test process waiting on the services it
# started (process starts, polls); a third fills that: on a quiet 2-core machine the suite took 427 s
# with three (cores 91% busy) against 490 s with two (77%). A fourth showed no gain: a clean-clone
# `.ci/run` took 835 s with four, against 744-827 s with three (2026-12-07). PYTEST_WORKERS=0 runs
# serially.
PYTEST_WORKERS ?= 3

PYTEST_RUN = $(BIN)/python -m pytest tests -n $(PYTEST_WORKERS) --durations=30

pytest: $(STAMP) chromium
	$(PYTEST_RUN)

# The venv and the browser are built side by side: uv's unpacking and apt's download and unpack each
# leave a core idle, and on a fresh machine they are the ~45 s before the first test. mypy starts as soon
# as the venv is there, at the lowest priority: with no cache (a clean clone) it takes ~45 s of one core,
# which the rest of apt's install and then the suite's waits leave free. Its report prints after
# pytest's; either failing (or the lint, or the browser's install) fails the target.
test:
	@log=$$(mktemp); \
	$(MAKE) --no-print-directory chromium > $$log.apt 2>&1 & browser=$$!; \
	$(MAKE) --no-print-directory lint || { wait $$browser; cat $$log.apt; rm -f $$log $$log.apt; exit 1; }; \
	nice -n 19 $(BIN)/mypy > $$log 2>&1 & typing=$$!; \
	wait $$browser; installed=$$?; cat $$log.apt; rm -f $$log.apt; \
	if [ $$installed -ne 0 ]; then wait $$typing; rm -f $$log; exit 1; fi; \
	$(PYTEST_RUN); tests=$$?; \
	wait $$typing; typed=$$?; echo "== mypy =="; cat $$log; rm -f $$log; \
	test $$tests -eq 0 -a $$typed -eq 0

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
