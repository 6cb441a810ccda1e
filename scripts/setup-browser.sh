#!/usr/bin/env bash
# The browser the page tests drive (`make test` runs this; `make serve` needs no browser).
set -euo pipefail
cd "$(dirname "$0")/.."
# tests/test_pages.py drives a real browser over HTTP/3: Debian's chromium, as Playwright's own
# `playwright install` downloads from a CDN that a machine with only package registries cannot
# reach.
scripts/apt-install.sh chromium chromium "tests/test_pages.py will skip (CI fails them)"
