#!/usr/bin/env bash
# Start the OpenAI-compatible server on one process (standard speculation, no MPI).
#
#   scripts/serve.sh BUNDLE [--host 127.0.0.1] [--port 8000] [--max-batch-size B]
#                           [--max-queue N] [--threads T] [other `specbuild serve` options]
#
# Then, from another shell:
#   curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"prompt": "The capital of France is", "max_tokens": 32, "speculation": "ngram"}'
#   curl -sN http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
#        -d '{"messages": [{"role": "user", "content": "Hi!"}], "stream": true}'
#   curl -s http://127.0.0.1:8000/metrics
#
# Environment: SPECBUILD_VENV (default .venv) picks the interpreter; THREADS sets --threads
# when no --threads is given. Ctrl-C or SIGTERM shuts down cleanly.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV=${SPECBUILD_VENV:-$ROOT/.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || PY=${PYTHON:-python3}
if [ $# -lt 1 ]; then
  sed -n '2,6p' "$0" >&2
  exit 2
fi
ARGS=("$@")
if [ -n "${THREADS:-}" ] && [[ " $* " != *" --threads "* ]]; then
  ARGS+=(--threads "$THREADS")
fi
exec "$PY" -c "from specbuild.cli import main; main()" serve "${ARGS[@]}"
