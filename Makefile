# The two commands a newcomer needs:
#   make serve   set up, then serve the embedded deployment on http://localhost:8000
#   make test    set up, then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
DEPLOYMENT ?= embedded
PORT ?= 8000
WORKERS ?= 1

.PHONY: setup serve test test-fast test-multihost browser lint bench clean

# The stamp lives in the venv, so removing the venv also forgets that setup ran.
STAMP := $(VENV)/.setup-stamp

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh scripts/apt-install.sh
	VENV=$(VENV) scripts/setup.sh
	touch $@

serve: setup
	$(PY) -m serving --deployment $(DEPLOYMENT) --port $(PORT) --workers $(WORKERS)

# Every test that starts no vLLM engine, no network namespace and no browser (tests/conftest.py
# marks each from the fixtures it uses). A module's tests stay on one worker, so that its servers
# start once. Three workers on two cores: many of these tests wait out emulated network delays,
# and a third worker fills that idle time (measured: 116 s with two, 100 s with three).
# Some machines set PYTHONDONTWRITEBYTECODE; then every test process and every server a test
# starts compiles the project from source again, and pytest rewrites every test module's asserts
# in each xdist worker (measured: the fast tier took 112 s with it set, 104 s without).
unexport PYTHONDONTWRITEBYTECODE

FAST := not vllm and not netns and not browser
PYTEST_FAST := $(PY) -m pytest -q -n 3 --dist loadscope -m "$(FAST)"

# The whole suite: the fast tier in parallel, then the rest in one process, where the vLLM
# servers start once and no other test takes their cores (their deadlines are real).
test: setup browser lint
	$(PYTEST_FAST)
	$(PY) -m pytest -q -m "not ($(FAST))"

test-fast: setup
	$(PYTEST_FAST)

# Engine hosts and front-ends on loopback addresses of their own, as hosts (part of test-fast).
test-multihost: setup
	$(PY) -m pytest -q -m multihost

# Debian's chromium, for tests/test_pages.py; installed with apt where it is missing.
browser:
	scripts/setup-browser.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) scripts/private_imports.py
	$(VENV)/bin/mypy

bench: setup
	$(PY) -m benchmarks.api_overhead

clean:
	rm -rf $(VENV) .models
