#!/usr/bin/env bash
# The browser the page tests drive (`make test` runs this; `make serve` needs no browser).
set -euo pipefail
# tests/test_pages.py drives a real browser over HTTP/3: Debian's chromium, as Playwright's own
# `playwright install` downloads from a CDN that a machine with only package registries cannot
# reach. Installed where it is missing and apt can (as root, or with sudo); else those tests skip.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; else SUDO=no; fi
  if [ "$SUDO" != no ]; then
    echo "setup: installing chromium with apt, for the browser tests"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium \
      || echo "setup: could not install chromium; tests/test_pages.py will skip (CI fails them)"
  else
    echo "setup: chromium missing and no root to apt-get it; tests/test_pages.py will skip (CI fails them)"
  fi
fi
