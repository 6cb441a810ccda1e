# The two commands a newcomer needs:
#   make serve   set up, then serve the embedded deployment on http://localhost:8000
#   make test    set up, then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
DEPLOYMENT ?= embedded
PORT ?= 8000

.PHONY: setup serve test browser lint bench clean

# The stamp lives in the venv, so removing the venv also forgets that setup ran.
STAMP := $(VENV)/.setup-stamp

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	VENV=$(VENV) scripts/setup.sh
	touch $@

serve: setup
	$(PY) -m serving --deployment $(DEPLOYMENT) --port $(PORT)

test: setup browser lint
	$(PY) -m pytest -q

# Debian's chromium, for tests/test_pages.py; installed with apt where it is missing.
browser:
	scripts/setup-browser.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

bench: setup
	$(PY) -m benchmarks.api_overhead

clean:
	rm -rf $(VENV) .models
