#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite. Extra arguments go to pytest,
# e.g. scripts/test.sh -m slow for the long tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
