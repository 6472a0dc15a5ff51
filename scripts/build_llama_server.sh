#!/usr/bin/env bash
# Builds llama.cpp's own server (llama-server), the CPU peer of the served benchmark
# (scripts/bench_serve.py), from the llama.cpp sources vendored in the llama-cpp-python sdist on
# PyPI. ~10 minutes on 2 cores. The build names its instruction sets instead of -march=native:
# on the Xeons here the CPU shows AMX flags but AMX instructions die with SIGILL (a native build
# crashes on batched evaluation), so AMX stays off; AVX-512 (with VNNI and BF16) and AVX-VNNI are
# turned on only where /proc/cpuinfo lists them, so the same script serves an AMD EPYC.
#
#   bash scripts/build_llama_server.sh            # -> .peers/llama-server (path printed at the end)
#   LLAMA_CPP_PYTHON_VERSION=0.3.16 bash ...      # another sdist (default: the newest pip finds)
#   PEERS_DIR=DIR bash ...                        # where the build and the binary go
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS_DIR:-.peers}
mkdir -p "$PEERS"
PEERS=$(cd "$PEERS" && pwd)
if [ -x "$PEERS/llama-server" ] && [ -z "${REBUILD:-}" ]; then
  echo "$PEERS/llama-server (already built; REBUILD=1 to build again)"
  exit 0
fi
for tool in cmake "${CXX:-g++}"; do
  command -v "$tool" >/dev/null || { echo "error: $tool is not installed (apt-get install cmake g++)" >&2; exit 2; }
done
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
SPEC=llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}
rm -rf "$PEERS/sdist" "$PEERS/src"
mkdir -p "$PEERS/sdist" "$PEERS/src"
echo "downloading the $SPEC sdist (sources only, nothing is installed)" >&2
"$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: -d "$PEERS/sdist" "$SPEC"
tar -xzf "$PEERS"/sdist/llama_cpp_python-*.tar.gz -C "$PEERS/src"
SRC=$(ls -d "$PEERS"/src/llama_cpp_python-*/vendor/llama.cpp)
has() { grep -m1 -qw "$1" /proc/cpuinfo; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=$(onoff avx) -DGGML_AVX2=$(onoff avx2) -DGGML_FMA=$(onoff fma)
       -DGGML_F16C=$(onoff f16c) -DGGML_AVX512=$(onoff avx512f) -DGGML_AVX512_VBMI=$(onoff avx512vbmi)
       -DGGML_AVX512_VNNI=$(onoff avx512_vnni) -DGGML_AVX512_BF16=$(onoff avx512_bf16)
       -DGGML_AVX_VNNI=$(onoff avx_vnni) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
echo "cmake ${FLAGS[*]}" >&2
cmake -S "$SRC" -B "$PEERS/build" -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=ON "${FLAGS[@]}" >"$PEERS/cmake.log" 2>&1 \
  || { tail -30 "$PEERS/cmake.log" >&2; exit 1; }
cmake --build "$PEERS/build" --target llama-server -j "$(nproc)" >"$PEERS/build.log" 2>&1 \
  || { tail -30 "$PEERS/build.log" >&2; exit 1; }
cp "$PEERS/build/bin/llama-server" "$PEERS/llama-server"
rm -rf "$PEERS/sdist"
echo "$PEERS/llama-server"
