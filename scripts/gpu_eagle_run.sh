#!/usr/bin/env bash
# The EAGLE-3 corpus and head for a target, built and trained on one CUDA GPU within a time
# budget (docs/eagle-training.md, section 6): the same library code as on a CPU
# (scripts/build_eagle_corpus.py, `specbuild train-eagle`) with --device cuda; the answers come
# from transformers' generate over the same weights in float32 (--hf-generate: the engine's
# CUDA step is too slow for bulk generation), BATCH prompts per padded batch; then three
# training runs side by side on one feature set (all the positions, and two seeded subsets:
# the scale curve).
#
#   OUT=DIR scripts/gpu_eagle_run.sh MODEL [SECONDS]
#
# MODEL: a preset, a .gguf file or a Hugging Face directory. SECONDS (default 1800): the whole
# run's budget; the corpus takes CORPUS_SHARE (0.4) of it, the rest trains. Everything lands in
# $OUT (default $WORK/out): eagle_run.log (with the corpus summary), corpus.tar.xz (prompts, answers, manifest), the
# reports of the three runs (reports.tar.xz) and the full run's head (head.tar, split into
# parts of at most 15 MiB: cat head.tar.part* > head.tar).
# Knobs (environment): WORK, DEVICE (cuda), BATCH (256 prompts per generate batch), SELF_INSTRUCT (600),
# LOCAL_FILES (600), TEMPERATURES (0,0.7,1.0), STEPS (6000 per run), SUBSETS ("75000 250000":
# the positions of the subset runs; "" for none), SHIP (the head to beat:
# specbuild/data/drafters/smollm2-135m-eagle), INIT (a head directory to fine-tune instead of a
# fresh initialisation: e.g. the shipped head), LR (AdamW peak learning rate; train-eagle's
# default when unset), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODEL=${1:?usage: scripts/gpu_eagle_run.sh MODEL [SECONDS]}
BUDGET=${2:-1800}
WORK=${WORK:-/tmp/specbuild-eagle-gpu}
OUTD=${OUT:-$WORK/out}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-256}
STEPS=${STEPS:-6000}
SUBSETS=${SUBSETS-75000 250000}
SHIP=${SHIP:-specbuild/data/drafters/smollm2-135m-eagle}
T0=$(date +%s)
mkdir -p "$WORK" "$OUTD"
LOG="$OUTD/eagle_run.log"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG" >&2; }
minutes() { "$PY" -c "print(round(max(0.2, $1 / 60), 2))"; }

{
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  lscpu 2>/dev/null | sed -n 's/^Model name: *//p'
} >> "$LOG" 2>&1
log "budget ${BUDGET}s; compiling $MODEL (float32)"
if [ ! -f "$WORK/bundle/bundle.json" ]; then
  "$PY" -m specbuild compile --target "$MODEL" --out "$WORK/bundle" \
    >> "$LOG" 2>&1 || { log "compile failed"; exit 1; }
fi

CORPUS_MIN=$(minutes "$(left) * ${CORPUS_SHARE:-0.4}")
log "corpus: --time-limit $CORPUS_MIN min, transformers generate in batches of $BATCH on $DEVICE"
"$PY" scripts/build_eagle_corpus.py "$WORK/bundle" --out "$WORK/corpus" --device "$DEVICE" --batch "$BATCH" \
  --hf-generate "$MODEL" --self-instruct "${SELF_INSTRUCT:-600}" --local-files "${LOCAL_FILES:-600}" \
  --temperatures "${TEMPERATURES:-0,0.7,1.0}" --max-answer-tokens 192 --time-limit "$CORPUS_MIN" --no-progress \
  > "$WORK/corpus_summary.json" 2>> "$LOG"
log "corpus exit status $? (0 complete, 3 stopped by the time limit: a partial corpus)"
cat "$WORK/corpus_summary.json" >> "$LOG"
tar -C "$WORK" -cJf "$OUTD/corpus.tar.xz" corpus
[ -f "$WORK/corpus/manifest.json" ] || { log "no corpus manifest"; exit 1; }

train() {  # name, seconds, extra args
  local name=$1 secs=$2
  shift 2
  rm -rf "$WORK/ship-$name"
  cp -r "$SHIP" "$WORK/ship-$name"
  local extra=()
  [ -n "${INIT:-}" ] && extra+=(--init "$INIT")
  [ -n "${LR:-}" ] && extra+=(--lr "$LR")
  "$PY" -m specbuild train-eagle "$WORK/bundle" --corpus "$WORK/corpus" --features-dir "$WORK/feat" \
    --out "$WORK/head-$name" --device "$DEVICE" --steps "$STEPS" --train-minutes "$(minutes "$secs")" \
    --checkpoint-minutes 1000 --ship "$WORK/ship-$name" --no-progress "${extra[@]}" "$@" \
    > "$WORK/train-$name.json" 2> "$WORK/train-$name.log"
  echo "train $name: exit status $?" >> "$WORK/train-$name.log"
}
REST=$(( $(left) - 45 - ${FEATURE_SECONDS:-60} ))  # --train-minutes counts the optimizer loop only: the
# features (written first), the evaluations and the packing come out of what is left
log "training: all positions, $STEPS steps, at most $(minutes "$REST") min of training"
train all "$REST" &
PIDS=($!)
for _ in $(seq 1 600); do  # the subset runs reuse the features the first run writes
  [ -f "$WORK/feat/heldout.json" ] && break
  kill -0 "${PIDS[0]}" 2>/dev/null || break
  sleep 1
done
for n in $SUBSETS; do
  [ -f "$WORK/feat/heldout.json" ] || break
  log "training: a subset of $n positions, $STEPS steps"
  train "$n" "$(( $(left) - 60 ))" --max-positions "$n" &
  PIDS+=($!)
done
wait "${PIDS[@]}"
log "training done"
for f in "$WORK"/train-*.log; do echo "== $f"; tail -n 40 "$f"; done >> "$LOG"
(cd "$WORK" && tar -cJf "$OUTD/reports.tar.xz" train-*.json train-*.log head-*/report.json 2>/dev/null)
if [ -f "$WORK/head-all/model.safetensors" ]; then
  tar -C "$WORK/head-all" -cf "$WORK/head.tar" config.json model.safetensors report.json
  split -b 15m -d "$WORK/head.tar" "$OUTD/head.tar.part"
fi
log "done"
