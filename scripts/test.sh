#!/usr/bin/env bash
# The test command: set up the environment (scripts/setup.sh), then run the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k verify).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The CPU, printed after the summary too: float arithmetic (and so a random tiny model's greedy
# path) differs between CPU kinds, so a failure read from the log's tail should name the machine.
cpu() { echo "CPU: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1); $(nproc) logical CPUs; flags: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_vnni|avx512_bf16|avx512_fp16|avx_vnni|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"; }
cpu
set +e
.venv/bin/python -m pytest -q --timeout 900 "$@"
rc=$?
cpu
exit $rc
