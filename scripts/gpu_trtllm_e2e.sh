#!/usr/bin/env bash
# End to end on a machine with an NVIDIA GPU and TensorRT-LLM (nothing here runs elsewhere).
# NOT RUN YET: no machine this project has used had TensorRT-LLM; every rule it relies on was
# checked by reading NVIDIA/TensorRT-LLM's sources (specbuild/formats/trtllm_support.py).
#
# The path is the installed release's: the engine path (trtllm-build + executor) on
# tensorrt_llm>=0.19,<1.3, the LLM API on the PyTorch backend on tensorrt_llm>=1.0 (1.0-1.2 run
# both). Every engine is bfloat16 (Medusa and draft/target have no float32 kernels), of a model
# whose head size (64) and query group (2) the XQA kernels take.
#
#   engine path
#   plain    compile TARGET with --backend tensorrt-llm (bf16 engines, built by compile), greedy
#            ids on the tensorrt-llm backend vs the torch backend on the same checkpoint
#   draft    the same with a draft engine (TARGET drafting for itself): methods none, ngram,
#            draft; greedy ids equal, drafts proposed and accepted
#   medusa   TARGET with 3 Medusa heads (near-zero random linears, lm_head shared) and a small
#            tree; greedy ids equal (lossless whatever the heads); a sampled request refused
#   mpi      with >= 2 GPUs and mpirun: --tp 2 engines under `mpirun -n 2` (leader mode)
#   LLM API path
#   api      LLM(model=trtllm/hf/target): plain, draft (DraftTargetDecodingConfig), ngram twice:
#            TensorRT-LLM's NGramDecodingConfig (ngram_impl="trtllm") and specbuild's own prompt
#            lookup through UserProvidedDecodingConfig (ngram_impl="specbuild"), each greedy-equal
#            to torch with drafts accepted
#   eagle3   `compile --eagle HEAD --backend tensorrt-llm` (HEAD: EAGLE3_DIR, or for TARGET=tiny a
#            random head written here): the head in trtllm/hf/eagle3, served by `generate --backend
#            tensorrt-llm` (Eagle3DecodingConfig, or EagleDecodingConfig(eagle3_one_model) before
#            1.3), greedy ids equal to torch (lossless whatever the head's quality)
#   smollm2  probes on SmolLM2-135M (9 query / 3 KV heads: a query group of 3), compared with the
#            torch backend and reported as PROBE lines, not failures: `--backend auto` on the
#            README's draft bundle (which backend, and the line saying why); that bundle on the
#            LLM API with specbuild's kernel refusal lifted (does a group of 3 fail on this
#            release's TRTLLM attention?) and with FLASHINFER attention; on the engine path, the
#            shipped smollm2-135m-medusa heads built with the group rule lifted (do the speculative
#            XQA kernels take group 3 at head size 64?)
#   pytest   the backend contract and the real engine build tests (-m "tensorrt_llm")
#
# TARGET: a Hugging Face directory (a power-of-two query group, head size in 32..256), or
# "tiny" (default): a random 4-layer Llama written here (head size 64, 4 query / 2 KV heads,
# peaked weights), which needs no download. A divergence is accepted only at a measured near-tie
# of the torch float32 logits (top-2 gap < TIE, default 5e-2 for bf16 engines); anything else
# fails. Exit status 0: every stage that could run passed; 77: no TensorRT-LLM or no GPU here
# (nothing run). A summary goes to $OUT/summary.txt (or $WORK).
#
#   STAGES=plain,draft,medusa,mpi,api,eagle3,smollm2,pytest  TOKENS=48  TARGET=tiny  EAGLE3_DIR=  scripts/gpu_trtllm_e2e.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
STAGES=${STAGES:-plain,draft,medusa,mpi,api,eagle3,smollm2,pytest}
TOKENS=${TOKENS:-48}
TARGET=${TARGET:-tiny}
TIE=${TIE:-5e-2}
EAGLE3_DIR=${EAGLE3_DIR:-}
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
# which paths this release has (formats/trtllm_support.py: engine 0.19 <= v < 1.3, LLM API v >= 1.0)
read -r ENGINE_PATH API_PATH < <("$PY" -c "
from specbuild.formats.trtllm_support import engine_path_problem, installed_version, llmapi_path_problem
v, _ = installed_version()
print(int(engine_path_problem(v) is None), int(llmapi_path_problem(v) is None))")
say "TensorRT-LLM paths here: engine=$ENGINE_PATH llmapi=$API_PATH"
if [ "$ENGINE_PATH" = 0 ]; then
    for st in plain draft medusa mpi; do if has $st; then say "$st: skipped (this release has no engine path)"; fi; done
    STAGES=$(echo ",$STAGES," | sed -e 's/,plain,/,/; s/,draft,/,/; s/,medusa,/,/; s/,mpi,/,/; s/^,//; s/,$//')
fi
if [ "$API_PATH" = 0 ]; then
    for st in api eagle3; do if has $st; then say "$st: skipped (the LLM API on the PyTorch backend needs tensorrt_llm>=1.0)"; fi; done
fi
if [ "$TARGET" = tiny ]; then
    TARGET="$WORK/tiny-llama"
    "$PY" -c "
import sys
sys.path.insert(0, 'tests/helpers')
from tiny import make_tiny_hf
make_tiny_hf(sys.argv[1], hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, inter=512, scale=4.0, seed=7)" "$TARGET"
    say "TARGET: a random Llama (head size 64, 4 query / 2 KV heads) at $TARGET"
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
        from specbuild.engine.engine import Engine

        _enc[bundle] = Engine(bundle)
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
    say "compile $TARGET --backend tensorrt-llm (bfloat16 engines)"
    specbuild compile --target "$TARGET" --out "$WORK/plain" --backend tensorrt-llm --trtllm-dtype bfloat16 \
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
        --trtllm-dtype bfloat16 --max-seq-len 512 --max-batch-size 4 --max-draft-len 4
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
write_trtllm_bundle_part(bundle, ckpt, medusa=heads, tree_paths=[[0], [1], [0, 0], [0, 0, 0]], dtype="bfloat16",
                         max_batch_size=4, max_seq_len=512, llmapi=False)
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
    if ! "$PY" -m pytest -q -m tensorrt_llm tests/backends/test_backend.py tests/compiler/test_trtllm_build.py \
        > "$WORK/pytest.log" 2>&1
    then
        tail -30 "$WORK/pytest.log" | tee -a "$SUMMARY"; say "FAIL: pytest"; exit 1
    fi
    tail -3 "$WORK/pytest.log" | tee -a "$SUMMARY"
fi

if has mpi; then
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    if [ "$gpus" -ge 2 ] && command -v mpirun > /dev/null; then
        say "mpi: --tp 2 engines under mpirun -n 2 (leader mode: rank 0 serves, rank 1 waits) vs torch"
        specbuild compile --target "$TARGET" --out "$WORK/tp2" --backend tensorrt-llm --trtllm-dtype bfloat16 \
            --max-seq-len 512 --max-batch-size 4 --tp 2
        engines_built "$WORK/tp2"
        [ -f "$WORK/torch.jsonl" ] || gen "$WORK/tp2" torch "$WORK/torch.jsonl" --speculation none
        : > "$WORK/tp2.jsonl"
        for p in "${PROMPTS[@]}"; do
            mpirun --allow-run-as-root -n 2 "$PY" -m specbuild.cli generate "$WORK/tp2" --backend tensorrt-llm \
                --prompt "$p" --max-tokens "$TOKENS" --temperature 0 --ignore-eos --json --speculation none \
                >> "$WORK/tp2.jsonl"
        done
        compare "$WORK/tp2.jsonl" "$WORK/torch.jsonl" "$WORK/tp2" "tp2" || { say "FAIL: tp2"; exit 1; }
        if specbuild generate "$WORK/tp2" --backend tensorrt-llm --prompt hi --max-tokens 2 2> "$WORK/tp2-alone.err"; then
            say "FAIL: tp 2 engines ran without mpirun"; exit 1
        fi
        grep -q "mpirun -n 2" "$WORK/tp2-alone.err" || { say "FAIL: no world-size error"; cat "$WORK/tp2-alone.err"; exit 1; }
        say "mpi: a single process is refused with the mpirun hint"
    else
        say "mpi: skipped ($gpus GPU(s); needs 2 and mpirun)"
    fi
fi

# api_gen BUNDLE METHOD OUTFILE [NGRAM_IMPL]: greedy ids through TrtllmApiEngine (the LLM API) in the
# form `specbuild generate --json` writes them (where engines are built the CLI would pick the engine path)
api_gen() {
    "$PY" - "$1" "$2" "$3" "$TOKENS" "${4:-trtllm}" "${PROMPTS[@]}" <<'EOF'
import json, sys
from specbuild.backends.tensorrt_llm_api import TrtllmApiEngine
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams

bundle, method, out, tokens, ngram_impl, *prompts = sys.argv[1:]
engine = TrtllmApiEngine(bundle, method=method, ngram_impl=ngram_impl)
with open(out, "w") as f:
    for p in prompts:  # one at a time, as the engine-path stages generate them
        r = engine.generate([Request(prompt=p, sampling=SamplingParams(temperature=0.0, max_tokens=int(tokens),
                                                                       ignore_eos=True))])[0]
        f.write(json.dumps({"token_ids": r["token_ids"], "stats": r["stats"]}) + "\n")
engine.close()
EOF
}

if has api && [ "$API_PATH" = 1 ]; then
    say "api: compile $TARGET with a draft for the LLM API (bf16 Hugging Face roles under trtllm/hf)"
    rm -rf "$WORK/api"
    specbuild compile --target "$TARGET" --draft "$TARGET" --out "$WORK/api" --backend tensorrt-llm \
        --trtllm-dtype bfloat16 --max-seq-len 512 --max-batch-size 4 --max-draft-len 4
    [ -f "$WORK/torch.jsonl" ] || gen "$WORK/api" torch "$WORK/torch.jsonl" --speculation none
    for m in none draft ngram-trtllm ngram-specbuild; do
        method=${m%%-*} impl=${m#*-}
        [ "$impl" = "$m" ] && impl=trtllm
        say "api, method $method (ngram_impl $impl): LLM API vs torch plain greedy"
        api_gen "$WORK/api" "$method" "$WORK/api-$m.jsonl" "$impl"
        compare "$WORK/api-$m.jsonl" "$WORK/torch.jsonl" "$WORK/api" "api/$m" || { say "FAIL: api/$m"; exit 1; }
    done
    "$PY" - "$WORK/api-draft.jsonl" "$WORK/api-ngram-trtllm.jsonl" "$WORK/api-ngram-specbuild.jsonl" <<'EOF' | tee -a "$SUMMARY"
import json, sys
for path in sys.argv[1:]:
    stats = [json.loads(line)["stats"] for line in open(path)]
    drafted, accepted = sum(s["drafted"] for s in stats), sum(s["accepted"] for s in stats)
    print(f"{path}: drafted (upper bound) {drafted}, accepted {accepted}")
    assert accepted > 0, "speculation accepted nothing"
EOF
fi

if has eagle3 && [ "$API_PATH" = 1 ]; then
    head=$EAGLE3_DIR
    if [ -z "$head" ] && [ "$TARGET" = "$WORK/tiny-llama" ]; then
        head="$WORK/tiny-eagle3"
        "$PY" -c "
import sys
sys.path.insert(0, 'tests/helpers')
from tiny import make_tiny_eagle3
make_tiny_eagle3(sys.argv[1], sys.argv[2])" "$head" "$TARGET"
        say "eagle3: a random EAGLE-3 head for the tiny target at $head"
    fi
    if [ -z "$head" ]; then
        say "eagle3: skipped (set EAGLE3_DIR to an EAGLE-3 head for $TARGET)"
    else
        say "eagle3: compile --eagle $head --backend tensorrt-llm; generate --backend tensorrt-llm vs torch"
        rm -rf "$WORK/eagle3"
        specbuild compile --target "$TARGET" --eagle "$head" --out "$WORK/eagle3" --backend tensorrt-llm \
            --trtllm-dtype bfloat16 --max-seq-len 512 --max-batch-size 4 --max-draft-len 4
        [ -f "$WORK/eagle3/trtllm/hf/eagle3/model.safetensors" ] || { say "FAIL: no trtllm/hf/eagle3"; exit 1; }
        [ -f "$WORK/torch.jsonl" ] || gen "$WORK/eagle3" torch "$WORK/torch.jsonl" --speculation none
        gen "$WORK/eagle3" tensorrt-llm "$WORK/eagle3.jsonl"
        compare "$WORK/eagle3.jsonl" "$WORK/torch.jsonl" "$WORK/eagle3" eagle3 || { say "FAIL: eagle3"; exit 1; }
    fi
fi

# probe LABEL OUT BUNDLE SETUP: the prompts through the engine SETUP (Python) opens as `engine`, compared with
# torch; reported as "PROBE LABEL: ..." (ran and equal / ran and differs / failed with the error's last line)
probe() {
    local label=$1 out=$2 bundle=$3 setup=$4
    if SETUP="$setup" "$PY" - "$bundle" "$out.jsonl" "$TOKENS" "${PROMPTS[@]}" > "$out.log" 2>&1 <<'EOF'
import json, os, sys
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
bundle, out, tokens, *prompts = sys.argv[1:]
scope = {"bundle": bundle}
exec(os.environ["SETUP"], scope)
engine = scope["engine"]
with open(out, "w") as f:
    for p in prompts:
        r = engine.generate([Request(prompt=p, sampling=SamplingParams(temperature=0.0, max_tokens=int(tokens),
                                                                       ignore_eos=True),
                                     speculation=scope.get("speculation"))])[0]
        f.write(json.dumps({"token_ids": r["token_ids"], "stats": r["stats"]}) + "\n")
engine.close()
EOF
    then
        if compare "$out.jsonl" "$WORK/smol-torch.jsonl" "$bundle" "$label" > "$out.cmp"; then
            say "PROBE $label: ran, greedy ids equal to torch ($(tail -1 "$out.cmp"))"
        else
            say "PROBE $label: ran, ids differ from torch"; tee -a "$SUMMARY" < "$out.cmp"
        fi
    else
        say "PROBE $label: failed: $(grep -v '^[[:space:]]*$' "$out.log" | tail -1)"
    fi
}

if has smollm2; then
    say "smollm2: the README's draft bundle (compile --target smollm2-135m --draft smollm2-135m --backend tensorrt-llm)"
    rm -rf "$WORK/smol"
    specbuild compile --target smollm2-135m --draft smollm2-135m --out "$WORK/smol" --backend tensorrt-llm \
        --trtllm-dtype bfloat16 --max-seq-len 512 --max-batch-size 4 --max-draft-len 4 || true
    if [ -f "$WORK/smol/bundle.json" ]; then
        gen "$WORK/smol" torch "$WORK/smol-torch.jsonl" --speculation none
        specbuild generate "$WORK/smol" --backend auto --prompt "Hello" --max-tokens 8 --json \
            > "$WORK/smol-auto.json" 2> "$WORK/smol-auto.err" || true
        say "PROBE smollm2 --backend auto: $(grep -c . "$WORK/smol-auto.err") stderr line(s): $(head -c 400 "$WORK/smol-auto.err")"
        if [ "$API_PATH" = 1 ]; then
            probe smollm2/api-draft-unrefused "$WORK/smol-api" "$WORK/smol" "
import specbuild.backends.tensorrt_llm_api as api
api.kernel_refusal = lambda *a, **k: None  # specbuild's group rule lifted: does this release take group 3?
engine = api.TrtllmApiEngine(bundle, method='draft')"
            probe smollm2/api-draft-flashinfer "$WORK/smol-fi" "$WORK/smol" "
import specbuild.backends.tensorrt_llm_api as api
engine = api.TrtllmApiEngine(bundle, method='draft', attn_backend='FLASHINFER')"
        fi
        if [ "$ENGINE_PATH" = 1 ]; then
            rm -rf "$WORK/smol-medusa"
            cp -r "$WORK/smol" "$WORK/smol-medusa"
            rm -rf "$WORK/smol-medusa/trtllm"
            if "$PY" - "$WORK/smol-medusa" > "$WORK/smol-medusa-build.log" 2>&1 <<'EOF'
import sys
import specbuild.compiler.trtllm_build as tb
from specbuild.compiler.medusa_role import read_medusa
from specbuild.formats.checkpoints import read_checkpoint, resolve_source

bundle = sys.argv[1]
ckpt = read_checkpoint(resolve_source("smollm2-135m"))
lm = ckpt.tensors.get("lm_head.weight", ckpt.tensors["model.embed_tokens.weight"])
heads = read_medusa(resolve_source("smollm2-135m-medusa")).tensors(lm)
tb.kernel_problems = lambda *a, **k: []  # specbuild's group rule lifted: do the Medusa XQA kernels take group 3?
tb.write_trtllm_bundle_part(bundle, ckpt, medusa=heads, tree_paths=[[0], [1], [0, 0], [0, 0, 0]], dtype="bfloat16",
                            max_batch_size=4, max_seq_len=512, llmapi=False)
assert tb.build_engines(f"{bundle}/trtllm"), "the engine build did not run"
EOF
            then
                probe smollm2/medusa-engine-unrefused "$WORK/smol-medusa" "$WORK/smol-medusa" "
import specbuild.backends.tensorrt_llm as trt
trt.engine_kernel_problems = lambda *a, **k: []
speculation = {'method': 'medusa'}
engine = trt.TrtllmEngine(bundle)"
            else
                say "PROBE smollm2/medusa-engine-unrefused: build failed: $(tail -1 "$WORK/smol-medusa-build.log")"
            fi
        fi
    else
        say "PROBE smollm2: compile refused or failed (its output is above)"
    fi
fi

say "all requested stages passed ($STAGES); work dir $WORK"
