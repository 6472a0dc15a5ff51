#!/usr/bin/env bash
# Serve a bundle through Triton Inference Server (Python backend, streaming, batch > 1).
#
#   scripts/triton_serve.sh BUNDLE [--repo DIR] [--http-port 8000] [--grpc-port 8001]
#                                  [--metrics-port 8002] [--host 127.0.0.1]
#                                  [other `specbuild triton-repo` options, e.g. --threads 4]
#
# CPU (any machine): fetches tritonserver 2.51 from the nvidia-pytriton wheel into
# .cache/tritonserver/ (scripts/get_tritonserver.py), writes the model repository
# (default .cache/triton-repo/<bundle name>) and runs the server on loopback ports.
# GPU, inside an NGC tritonserver container that has specbuild installed: set TRITONSERVER
# to the server binary (e.g. /opt/tritonserver/bin/tritonserver) and pass --device cuda; a
# bundle compiled with --backend tensorrt-llm keeps its torch roles, served here on the GPU.
#
# Then, from another shell:
#   curl -s -X POST http://127.0.0.1:8000/v2/models/specbuild/generate \
#        -d '{"text_input": "The capital of France is", "max_tokens": 32, "speculation": "ngram",
#             "return_perf_metrics": true}'
#   curl -sN -X POST http://127.0.0.1:8000/v2/models/specbuild/generate_stream \
#        -d '{"text_input": "Hello", "max_tokens": 32, "stream": true}'
#   curl -s http://127.0.0.1:8002/metrics | grep specbuild_
# Unary HTTP/gRPC infer (tritonclient) goes to the model specbuild_plain; the gRPC stream
# and generate[_stream] go to specbuild.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV=${SPECBUILD_VENV:-$ROOT/.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || PY=${PYTHON:-python3}
if [ $# -lt 1 ]; then
  sed -n '2,6p' "$0" >&2
  exit 2
fi
BUNDLE=$1; shift
REPO="$ROOT/.cache/triton-repo/$(basename "$BUNDLE")"
HOST=127.0.0.1; HTTP=8000; GRPC=8001; METRICS=8002
REPO_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --repo) REPO=$2; shift 2 ;;
    --host) HOST=$2; shift 2 ;;
    --http-port) HTTP=$2; shift 2 ;;
    --grpc-port) GRPC=$2; shift 2 ;;
    --metrics-port) METRICS=$2; shift 2 ;;
    *) REPO_ARGS+=("$1"); shift ;;
  esac
done

if [ -n "${TRITONSERVER:-}" ]; then
  # a server of your own (e.g. an NGC container): its Python backend uses its own Python
  BACKEND_DIR=${TRITON_BACKEND_DIR:-$(dirname "$(dirname "$TRITONSERVER")")/backends}
  "$PY" -c "from specbuild.cli import main; main()" triton-repo "$BUNDLE" --out "$REPO" "${REPO_ARGS[@]}"
else
  eval "$("$PY" "$ROOT/scripts/get_tritonserver.py" --shell)"
  TRITONSERVER=$TRITON_TRITONSERVER
  BACKEND_DIR=$TRITON_BACKEND_DIR
  export LD_LIBRARY_PATH="$TRITON_LD_LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  "$PY" -c "from specbuild.cli import main; main()" triton-repo "$BUNDLE" --out "$REPO" \
    --python-env "$TRITON_PYTHON_ENV" "${REPO_ARGS[@]}"
fi
echo "tritonserver on http://$HOST:$HTTP (gRPC $HOST:$GRPC, metrics http://$HOST:$METRICS/metrics)" >&2
exec "$TRITONSERVER" --model-repository="$REPO" --backend-directory="$BACKEND_DIR" \
  --http-address="$HOST" --http-port="$HTTP" --grpc-address="$HOST" --grpc-port="$GRPC" \
  --metrics-address="$HOST" --metrics-port="$METRICS" --disable-auto-complete-config \
  --allow-gpu-metrics="${ALLOW_GPU_METRICS:-false}" --allow-cpu-metrics=false --exit-timeout-secs=5
