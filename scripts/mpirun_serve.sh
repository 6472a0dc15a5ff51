#!/usr/bin/env bash
# Serve with MineDraft batch parallelism on two MPI ranks: rank 0 runs HTTP, the scheduler
# and the target verifier; rank 1 runs the bundle's draft model and binds no port.
#
#   scripts/mpirun_serve.sh BUNDLE [--host 127.0.0.1] [--port 8000] [--max-batch-size B]
#                                  [--threads T (per rank)] [other `specbuild serve` options]
#
# The exact line it runs (mpirun from the mpich wheel in the venv; works as root as is):
#
#   .venv/bin/mpirun -disable-auto-cleanup -n 2 \
#       .venv/bin/python -c "from specbuild.cli import main; main()" serve BUNDLE --parallel-draft ...
#
# -disable-auto-cleanup: without it the launcher kills rank 0 within a second of rank 1's
# exit; with it, rank 0 keeps serving and decodes plainly (/health says "degraded").
# Each rank runs under a small guard process (specbuild/mpi/context.py) so that even a
# rank killed by a signal looks like an ordinary exit to the launcher.
# SIGTERM or Ctrl-C to mpirun shuts both ranks down; a SIGKILL of mpirun (or of its process
# group) ends them too, within seconds: no rank outlives its launcher or keeps the port
# (parent-death ties, specbuild/mpi/context.py). curl examples: scripts/serve.sh.
#
# Environment: SPECBUILD_VENV (default .venv); THREADS sets --threads when none is given.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV=${SPECBUILD_VENV:-$ROOT/.venv}
PY="$VENV/bin/python"
MPIRUN="$VENV/bin/mpirun"
if [ $# -lt 1 ]; then
  sed -n '2,6p' "$0" >&2
  exit 2
fi
if [ ! -x "$MPIRUN" ]; then
  echo "error: $MPIRUN not found; install MPI with: $PY -m pip install mpi4py mpich (scripts/setup.sh does)" >&2
  exit 2
fi
ARGS=("$@")
if [ -n "${THREADS:-}" ] && [[ " $* " != *" --threads "* ]]; then
  ARGS+=(--threads "$THREADS")
fi
exec "$MPIRUN" -disable-auto-cleanup -n 2 "$PY" -c "from specbuild.cli import main; main()" \
  serve "${ARGS[@]}" --parallel-draft
