#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite. Extra arguments go to pytest,
# e.g. scripts/test.sh -m slow for the long tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
# The run report is checked in headless Chromium; install Debian's package when it is missing.
# If that fails, the browser test skips and says so.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo -n"
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium; } \
    >/dev/null 2>&1 || echo "scripts/test.sh: could not install chromium; the report browser test will skip" >&2
fi
# Two worker processes, each test file in one of them (module fixtures are built once); each
# worker runs torch on one thread (tests/conftest.py). -n 0 on the command line runs serially.
exec .venv/bin/python -m pytest -q -n "${DIFFTRAIN_TEST_WORKERS:-2}" --dist loadfile "$@"
