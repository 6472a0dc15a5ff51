#!/usr/bin/env bash
# The test command: set up the environment (scripts/setup.sh), then run the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k verify).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --timeout 900 "$@"
