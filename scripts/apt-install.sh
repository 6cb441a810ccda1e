#!/usr/bin/env bash
# scripts/apt-install.sh COMMAND PACKAGE WHAT: install Debian's PACKAGE with apt where COMMAND is
# missing and apt can (as root, or with sudo); else say so, and what goes without it.
set -euo pipefail
command=$1 package=$2 what=$3
if command -v "$command" >/dev/null 2>&1 || [ -x "/usr/sbin/$command" ]; then exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: $command missing and no apt-get to install it; $what"
  exit 0
fi
if [ "$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
  echo "setup: $command missing and no root to apt-get it; $what"
  exit 0
fi
echo "setup: installing $package with apt"
$SUDO apt-get update -qq && $SUDO apt-get install -y -qq "$package" \
  || echo "setup: could not install $package; $what"
