"""Weight formats measured against each other: speed (plain decoding, verify cost by width,
the memory floor) and accuracy (perplexity on a fixed text, greedy agreement with float32).

    report = run_formats_bench("smollm2-135m", threads=2)
    print(format_report(report))

Each format is a set of CompileOptions; every format is compiled from the same source and
run in this process one after another (same-run ratios; medians over repeats). llama.cpp
is a peer row when `llama_cpp` (llama-cpp-python) imports and the source is a GGUF file.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from typing import Callable

import torch

from specbuild.model.timing import copy_bandwidth, forward_costs, scratch_sequence  # noqa: F401 (forward_costs: cli/bench)

# name -> CompileOptions fields. float32 from a GGUF holds the GGUF's own values exactly.
DEFAULT_FORMATS: dict[str, dict] = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantize": "int8", "lm_head_format": "int8"},
    "int4": {"quantize": "int4", "lm_head_format": "int8"},
    "int8-a8": {"quantize": "int8", "lm_head_format": "int8", "activations": "int8"},  # per-row int8 inputs too
    "int4-a8": {"quantize": "int4", "lm_head_format": "int8", "activations": "int8"},  # int8 input blocks of 32
    # and the lm_head's inputs too (--lm-head-activations int8; AVX2 or AVX512-VNNI)
    "int4-a8-h8": {"quantize": "int4", "lm_head_format": "int8", "activations": "int8", "lm_head_activations": "int8"},
    "int4-bf16": {"dtype": "bfloat16", "quantize": "int4", "lm_head_format": "int8"},  # bfloat16 hidden states
    "int4-head4": {"quantize": "int4", "lm_head_format": "int4"},  # the lm_head in int4 too
}
COMPILED = "+compile"  # a format name with this suffix: the same bundle, its layer stack compiled
WIDTHS = (1, 2, 3, 5, 9, 17)  # a decode step, chains of 1-8 drafts, a 16-node tree


def eval_texts(n: int) -> list[str]:
    """First turns of the first n Spec-Bench eval-split questions (packaged data)."""
    from specbuild.bench.specbench import load_questions, load_split, select_questions

    chosen = select_questions(load_questions(), load_split(), "eval")
    return [q["turns"][0] for q in chosen[:n]]


def sequence_logits(model, cache, ids: list[int], chunk: int = 128) -> torch.Tensor:
    """Logits [len(ids), vocab] float32 of one sequence through the paged decoder, fed in
    chunks (so the format plan sees widths up to `chunk`), without request state."""
    from specbuild.model.decoder import ForwardBatch

    n, out, dev = len(ids), [], cache.device
    with scratch_sequence(cache, n) as slots:
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            w = end - start
            mask = torch.ones(w, end, dtype=torch.bool)
            mask[:, start:] = torch.ones(w, w, dtype=torch.bool).tril()
            batch = ForwardBatch(torch.tensor(ids[start:end], device=dev), torch.arange(start, end, device=dev),
                                 slots[start:end], slots[:end], mask.to(dev), torch.arange(w, device=dev))
            out.append(model.forward(batch, cache).logits)
    return torch.cat(out)


def perplexity(model, cache, ids: list[int]) -> float:
    """exp(mean next-token NLL) over ids[1:]."""
    logits = sequence_logits(model, cache, ids)[:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="mean")
    return float(torch.exp(nll))


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from specbuild.sampling.params import SamplingParams
    from specbuild.engine.sequence import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [engine.generate([Request(prompt_ids=p, sampling=params)])[0]["token_ids"] for p in prompts]


def agreement(engine, prompts: list[list[int]], baseline: list[list[int]], mine: list[list[int]]) -> dict:
    """Against the baseline's greedy outputs: exact matches, mean matching prefix, and
    teacher-forced top-1 agreement (this format's argmax on the baseline's text)."""
    agree = total = 0
    prefix = []
    for p, base, out in zip(prompts, baseline, mine):
        logits = sequence_logits(engine.model, engine.cache, p + base)[len(p) - 1:-1]
        agree += int((logits.argmax(-1) == torch.tensor(base)).sum())
        total += len(base)
        prefix.append(next((i for i, (a, b) in enumerate(zip(base, out)) if a != b), min(len(base), len(out))))
    return {"top1_agreement": agree / max(total, 1), "exact_outputs": sum(a == b for a, b in zip(baseline, mine)),
            "outputs": len(baseline), "mean_matching_prefix": statistics.mean(prefix) if prefix else 0.0}


def decode_step_ms(engine, prompt: list[int], tokens: int, repeats: int) -> list[float]:
    """Per-token milliseconds of plain greedy decoding at batch 1 (prefill excluded)."""
    from specbuild.engine.sequence import Request
    from specbuild.sampling.params import SamplingParams
    from specbuild.speculation.config import SpeculationConfig

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    plain = SpeculationConfig.make(None, method="none")  # whatever the bundle's default speculation is
    return [engine.generate([Request(prompt_ids=prompt, sampling=params, speculation=plain)])[0]["stats"]["tpot_ms"]
            for _ in range(repeats)]


def measure_format(name: str, bundle: str, threads: int, texts: dict, widths, decode_tokens: int,
                   repeats: int, baseline: dict | None) -> dict:
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.model.decoder import weight_bytes

    t0 = time.perf_counter()
    engine = Engine(bundle, EngineConfig(threads=threads, max_batch_size=1, compile=name.endswith(COMPILED)))
    load_s = time.perf_counter() - t0
    row: dict = {"format": name, "load_s": round(load_s, 2), "compile_s": engine.compile_seconds,
                 "plans": {g: p.describe() for g, p in engine.model.plans.items()}}
    steps = decode_step_ms(engine, texts["prompts"][0], decode_tokens, repeats)
    costs = forward_costs(engine.model, engine.cache, sorted(set(widths)), repeats=max(7, repeats))
    gbps = copy_bandwidth(128 << 20, repeats=7)["gb_per_s"]
    wb = weight_bytes(engine.model.w, engine.target_config.tie_word_embeddings)
    floor = wb / (gbps * 1e9) * 1e3
    one = costs[min(costs)]
    row.update({"weight_bytes": wb, "weight_mb": round(wb / 1e6, 1), "copy_gb_per_s": round(gbps, 2), "floor_ms": round(floor, 2),
                "decode_ms": round(statistics.median(steps), 2), "decode_ms_samples": steps,
                "tokens_per_s": round(1e3 / statistics.median(steps), 1),
                "step_ms": round(one["wall_ms"], 2), "step_min_ms": round(one["min_ms"], 2),
                "step_cpu_ms": round(one["cpu_ms"], 2), "step_over_floor": round(one["min_ms"] / floor, 2),
                "cpu_over_floor": round(one["cpu_ms"] / floor, 2)})
    row["verify_ms"] = {w: round(c["min_ms"], 2) for w, c in costs.items()}
    row["verify_cpu_ms"] = {w: round(c["cpu_ms"], 2) for w, c in costs.items()}
    # one thread: CPU time is the step's own cost, whatever else runs; more threads: best wall
    key = "cpu_ms" if threads == 1 else "min_ms"
    row["verify_basis"] = key
    row["verify_w5_over_w1"] = round(costs[5][key] / costs[1][key], 2) if {1, 5} <= set(costs) else None
    row["verify_w17_over_w1"] = round(costs[17][key] / costs[1][key], 2) if {1, 17} <= set(costs) else None
    row["perplexity"] = round(perplexity(engine.model, engine.cache, texts["ppl_ids"]), 4)
    mine = greedy(engine, texts["prompts"], texts["gen_tokens"])
    row["greedy"] = mine
    if baseline is not None:
        row["agreement"] = agreement(engine, texts["prompts"], baseline["greedy"], mine)
    del engine
    gc.collect()
    return row


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot be a peer row here (None: it can). llama-cpp-python is optional:
    it builds llama.cpp from source at install (~7-10 min on 2 cores), so it is not part of
    scripts/setup.sh; docs/cpu-kernels.md says how to install it."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (optional: pip install llama-cpp-python, see docs/cpu-kernels.md)"
    return None


def gguf_tensor_bytes(path: str) -> int:
    """Bytes of a GGUF file's tensors (its weights as llama.cpp reads them; a tied output
    layer is the token embedding, counted once)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


class LlamaCppPeer:
    """llama.cpp (llama-cpp-python) on a GGUF file as it is, measured like specbuild's rows:
    plain greedy decoding ms/token (llama.cpp's eval of one token after another, the argmax of
    its logits in between: no sampler chain or detokenizer in the timing) and one batched eval
    of w tokens after `context` cached ones (best of `repeats`; llama.cpp's KV cache is cut
    back to the context between tries). n_batch: as given, else 64 when a child process
    survives a batched eval (its native build crashes there on some CPUs), else 1 (then a
    width-w eval is w one-token evals)."""

    def __init__(self, gguf: str, threads: int, n_batch: int | None = None, n_ctx: int = 1024) -> None:
        import llama_cpp

        from specbuild.bench.specbench import llama_cpp_batch_ok

        self.n_batch = n_batch or (64 if llama_cpp_batch_ok(gguf, threads) else 1)
        self.llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   n_batch=self.n_batch, logits_all=True, verbose=False)
        self.version = getattr(llama_cpp, "__version__", "")
        self.weight_bytes = gguf_tensor_bytes(gguf)

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def decode_ms(self, prompt: list[int], tokens: int) -> float:
        """Per-token ms of plain greedy decoding after `prompt` (its evaluation excluded)."""
        import numpy as np

        self.llm.reset()
        self.llm.eval(prompt)
        t0 = time.perf_counter()
        for _ in range(tokens):
            self.llm.eval([int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))])
        return (time.perf_counter() - t0) / tokens * 1e3

    def width_costs(self, context: list[int], widths, repeats: int = 7) -> dict[int, float]:
        """Width -> best ms of one eval of that many tokens after `context` cached tokens."""
        self.llm.reset()
        self.llm.eval(context)
        n = self.llm.n_tokens
        out = {}
        for w in widths:
            best = float("inf")
            for _ in range(repeats):
                self.llm.n_tokens = n  # the next eval removes the KV entries past n first
                t0 = time.perf_counter()
                self.llm.eval([100 + i for i in range(w)])
                best = min(best, time.perf_counter() - t0)
            out[w] = best * 1e3
        self.llm.n_tokens = n
        return out


def llama_cpp_row(gguf: str, threads: int, prompt_text: str, decode_tokens: int, repeats: int) -> dict | None:
    """llama.cpp on the same GGUF (greedy, batch 1), when llama-cpp-python imports, else None."""
    if llama_cpp_missing():
        return None
    peer = LlamaCppPeer(gguf, threads)
    prompt = peer.tokenize(prompt_text)
    steps = [peer.decode_ms(prompt, decode_tokens) for _ in range(repeats)]
    step = statistics.median(steps)
    return {"format": "llama.cpp (GGUF as is)", "step_ms": round(step, 2), "tokens_per_s": round(1e3 / step, 1),
            "step_ms_samples": steps, "version": peer.version, "n_batch": peer.n_batch,
            "weight_bytes": peer.weight_bytes}


def run_formats_bench(source: str, formats: dict[str, dict] | None = None, threads: int = 2,
                      work_dir: str | None = None, ppl_texts: int = 12, ppl_tokens: int = 512, prompts: int = 6,
                      gen_tokens: int = 32, decode_tokens: int = 64, repeats: int = 3, widths=WIDTHS,
                      peers: bool = True, progress: Callable[[str], None] | None = None) -> dict:
    """Compile `source` in each format (name -> CompileOptions fields; the first is the
    agreement baseline), measure each, and return the report (see format_report)."""
    from specbuild.formats.checkpoints import resolve_source
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from specbuild.engine.engine import Engine, EngineConfig

    say = progress or (lambda msg: None)
    formats = formats or DEFAULT_FORMATS
    work = work_dir or tempfile.mkdtemp(prefix="specbuild-formats-")
    path = resolve_source(source)
    bundles = {}
    for name, opts in formats.items():
        base = name.removesuffix(COMPILED)
        if base != name and base in bundles:  # "int4" and "int4+compile": one bundle
            bundles[name] = bundles[base]
            continue
        say(f"compiling {name} {opts}")
        bundles[name] = bundles[base] = compile_bundle(path, os.path.join(work, base),
                                                       CompileOptions(**{"max_seq_len": 1024, **opts}))
    probe = Engine(bundles[next(iter(bundles))], EngineConfig(max_batch_size=1))
    texts_raw = eval_texts(max(ppl_texts, prompts))
    ppl_ids = probe.encode("\n\n".join(texts_raw[:ppl_texts]))[:ppl_tokens]
    chat = [probe.encode(probe.render_chat([{"role": "user", "content": t}]), add_special_tokens=False)
            for t in texts_raw[:prompts]]
    texts = {"ppl_ids": ppl_ids, "prompts": chat, "gen_tokens": gen_tokens}
    del probe
    rows, baseline = [], None
    for name in formats:
        say(f"measuring {name}")
        row = measure_format(name, bundles[name], threads, texts, widths, decode_tokens, repeats, baseline)
        quant = read_quant(os.path.join(bundles[name], "target"))
        row["bytes_by_format"] = quant["bytes_by_format"] if quant else None
        row["conversions"] = quant["conversions"] if quant else None
        baseline = baseline or row
        rows.append(row)
        say(f"  {name}: step {row['step_min_ms']} ms (cpu {row['step_cpu_ms']}), decode {row['decode_ms']} ms/token, "
            f"ppl {row['perplexity']}")
    base_ppl = rows[0]["perplexity"]
    best_gbps = max(r["copy_gb_per_s"] for r in rows)  # the machine's, not a contended moment's
    for row in rows:
        row["perplexity_change_pct"] = round((row["perplexity"] / base_ppl - 1) * 100, 3)
        floor_ms = row["weight_bytes"] / (best_gbps * 1e6)  # unrounded: a tiny model's floor is ~0.001 ms
        row["floor_ms"] = float(f"{floor_ms:.4g}")
        row["step_over_floor"] = round(row["step_min_ms"] / floor_ms, 2)
        row["cpu_over_floor"] = round(row["step_cpu_ms"] / floor_ms, 2)
    peer = None
    if peers and path.endswith(".gguf"):
        from tokenizers import Tokenizer

        say("llama.cpp peer row (if llama-cpp-python imports)")
        prompt_text = Tokenizer.from_file(os.path.join(bundles[next(iter(bundles))], "tokenizer.json")).decode(
            chat[0], skip_special_tokens=False)
        peer = llama_cpp_row(path, threads, prompt_text, decode_tokens, repeats)
    return {"source": path, "threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "load_average": os.getloadavg(), "torch": torch.__version__, "widths": list(widths),
            "ppl_tokens": len(ppl_ids), "prompts": len(chat), "gen_tokens": gen_tokens,
            "rows": rows, "llama_cpp": peer, "work_dir": work}


def read_quant(role_dir: str) -> dict | None:
    """A role's quant.json, or None for a bundle of plain weights."""
    path = os.path.join(role_dir, "quant.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def format_report(report: dict) -> str:
    """The table: per format, bytes read per step and their floor, the width-1 step (best
    wall time, median CPU time), plain decoding through the engine, verify cost by width
    (best wall time), perplexity and agreement with the first format."""
    widths = report["widths"]
    head = (f"{'format':9s} {'MB/step':>7s} {'floor':>6s} {'step':>6s} {'cpu':>6s} {'xfloor':>6s} {'cpu/fl':>6s} {'decode':>6s} "
            f"{'tok/s':>6s} " + " ".join(f"{'w' + str(w):>6s}" for w in widths)
            + f" {'w5/w1':>5s} {'w17/1':>5s} {'ppl':>7s} {'dppl%':>6s} {'top1':>5s} {'exact':>5s}")
    lines = [f"weight formats on {os.path.basename(report['source'])}: {report['threads']} thread(s), torch "
             f"{report['torch']}, load average {report['load_average'][0]:.1f}; ms; step = best wall time of repeats, "
             "cpu = median CPU time, decode = engine's plain greedy ms/token (median), wN = forward of N rows "
             + ("(CPU time)" if report["threads"] == 1 else "(best wall time)"), head]
    for r in report["rows"]:
        ag = r.get("agreement")
        acc = f"{ag['top1_agreement']:5.3f} {ag['exact_outputs']:>2d}/{ag['outputs']:<2d}" if ag else f"{'-':>5s} {'-':>5s}"
        lines.append(
            f"{r['format']:9s} {r['weight_mb']:7.1f} {r['floor_ms']:6.2f} {r['step_min_ms']:6.2f} {r['step_cpu_ms']:6.2f} "
            f"{r['step_over_floor']:6.2f} {r['cpu_over_floor']:6.2f} {r['decode_ms']:6.2f} {r['tokens_per_s']:6.1f} "
            + " ".join(f"{r['verify_cpu_ms' if r['verify_basis'] == 'cpu_ms' else 'verify_ms'].get(w, float('nan')):6.2f}"
                       for w in widths)
            + f" {r['verify_w5_over_w1'] or float('nan'):5.2f} {r.get('verify_w17_over_w1') or float('nan'):5.2f}"
            + f" {r['perplexity']:7.3f} {r['perplexity_change_pct']:6.2f} {acc}")
    peer = report.get("llama_cpp")
    if peer:
        lines.append(f"{'llama.cpp':9s} {'':7s} {'':6s} {'':6s} {'':6s} {'':6s} {'':6s} {peer['step_ms']:6.2f} "
                     f"{peer['tokens_per_s']:6.1f}")
    else:
        lines.append("llama.cpp: llama-cpp-python is not installed here (no peer row)")
    lines.append(f"floor = bytes read per step / copy bandwidth ({max(r['copy_gb_per_s'] for r in report['rows'])} GB/s, "
                 "best copy of the run); "
                 f"perplexity over {report['ppl_tokens']} tokens of Spec-Bench eval questions; agreement with "
                 f"{report['rows'][0]['format']} over {report['prompts']} chat prompts x {report['gen_tokens']} greedy tokens")
    for r in report["rows"]:
        if r["plans"]:
            lines.append(f"  {r['format']}: " + "; ".join(f"{g}: {d}" for g, d in r["plans"].items()))
    return "\n".join(lines)


# ---- the linear kernels alone, interleaved -----------------------------------------------------
# SmolLM2-135M's 30 layers (qkv as q/k/v, o, gate, up, down) and its lm_head
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LM_HEAD_SHAPE = (49152, 576)


def kernel_candidates(act_dtype: torch.dtype = torch.bfloat16, layers: int = 30, group: int = 32) -> dict:
    """(group, name) -> items (in_features, bytes, fn(x), input dtype), one per weight of a
    pass: torch's int4 and int8 weight-only kernels and specbuild's at each ISA level this
    CPU runs, over random weights of SmolLM2-135M's shapes (int4 for the layers, int8 for the
    lm_head), and for the layers specbuild's int4 x int8 kernel (int4-a8: float32 inputs,
    quantised inside the op to int8 blocks of 32) on each of its paths."""
    from specbuild.model import cpu_kernels

    gen = torch.Generator().manual_seed(0)
    levels = [lv for lv in (2, 1) if lv <= cpu_kernels.isa()] if cpu_kernels.status()["available"] else []
    # int4 with bfloat16 inputs also has level 3 (level 2's bits, prefetch further ahead) and 4
    # (fp32 multiply-adds); int8 has one AVX-512 path
    int4_levels = levels + ([3] if 2 in levels and act_dtype == torch.bfloat16 else []) + (
        [4] if levels and act_dtype == torch.bfloat16 and cpu_kernels.has_isa4() else [])
    q8 = [p for p in (2, 5, 3, 1) if p in cpu_kernels.q8_paths()]
    if cpu_kernels.mode() == "avx2":
        q8 = [p for p in q8 if p == 1]
    int8_levels = levels + ([3] if 2 in levels else [])  # 3: one-row tiles in AVX-512 (the same bits)
    int4 = {"torch": [], **{f"specbuild {cpu_kernels.level_name('int4', lv)}": [] for lv in int4_levels},
            **{f"int4 x int8 {cpu_kernels.Q8_PATHS[p]}": [] for p in q8}}
    f32 = act_dtype != torch.bfloat16
    for n, k in LAYER_SHAPES * layers:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        s = (torch.rand(n, k // group, generator=gen) * 0.02).to(act_dtype)
        z = (torch.randn(n, k // group, generator=gen) * 0.01).to(act_dtype)
        tp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = torch.stack([s, z], -1).transpose(0, 1).contiguous()
        int4["torch"].append((k, tp.numel() + sz.numel() * sz.element_size(),
                              lambda x, tp=tp, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, tp, group, sz),
                              act_dtype))
        if levels:
            packed = cpu_kernels.repack_int4(q, s, z, group, f32)
            for lv in int4_levels:
                int4[f"specbuild {cpu_kernels.level_name('int4', lv)}"].append(
                    (k, packed.numel(), lambda x, p=packed, n=n, lv=lv: cpu_kernels.int4_mm(x, p, n, group, f32, lv),
                     act_dtype))
        if q8:  # scales as GGUF Q4_1 holds them (fp16 d, m), so the fp16 layout of a Q4_1 bundle
            s16, m16 = s.half().float(), (z.float() - 8.0 * s.half().float()).half().float()
            z16 = m16 + 8.0 * s16
            f16 = cpu_kernels.q8_fp16_exact(s16, z16)
            p8 = cpu_kernels.repack_int4_q8(q, s16, z16, group, f16)
            for path in q8:
                int4[f"int4 x int8 {cpu_kernels.Q8_PATHS[path]}"].append(
                    (k, p8.numel(), lambda x, p=p8, n=n, path=path, f=f16: cpu_kernels.int4_q8_mm(x, p, n, group, f, path),
                     torch.float32))
    n, k = LM_HEAD_SHAPE
    w8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    s8 = (torch.rand(n, generator=gen) * 0.01).to(act_dtype)
    head = {"torch": [(k, w8.numel() + s8.numel() * s8.element_size(),
                       lambda x: torch.ops.aten._weight_int8pack_mm(x, w8, s8), act_dtype)]}
    if levels:
        p8 = cpu_kernels.repack_int8(w8, s8)
        for lv in int8_levels:
            head[f"specbuild {cpu_kernels.level_name('int8', lv)}"] = [
                (k, p8.numel(), lambda x, lv=lv: cpu_kernels.int8_mm(x, p8, n, lv), act_dtype)]
    out = {}
    for group_name, cands in (("int4 layers", int4), ("int8 lm_head", head)):
        for name, items in cands.items():
            out[(group_name, name)] = items
    return out


def kernel_rounds(widths=(1, 5, 17), rounds: int = 7, act_dtype: torch.dtype = torch.bfloat16,
                  layers: int = 30) -> dict:
    """Every candidate kernel over the same weights, round-robin within each round (so all
    see the same machine state), per width: median ms, GB/s (the candidate's own bytes over
    its median time) and the ratio to torch's kernel; the load average before and after.
    One thread: CPU time of this process (what other processes' load cannot inflate by
    descheduling it); more: wall time."""
    cands = kernel_candidates(act_dtype, layers)
    gen = torch.Generator().manual_seed(1)
    load_before = os.getloadavg()
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    times: dict = {(key, w): [] for key in cands for w in widths}
    for w in widths:
        xs = {k: torch.randn(w, k, generator=gen) for k in (576, 1536)}
        xs = {(k, dt): x.to(dt) for k, x in xs.items() for dt in (act_dtype, torch.float32)}
        for r in range(rounds + 1):
            for key, items in cands.items():
                t0 = clock()
                for k, _, fn, dt in items:
                    fn(xs[(k, dt)])
                if r:  # the first round warms up
                    times[(key, w)].append((clock() - t0) * 1e3)
    rows = []
    for (group, name), items in cands.items():
        nbytes = sum(item[1] for item in items)
        row = {"weights": group, "kernel": name, "mb": round(nbytes / 1e6, 1)}
        for w in widths:
            ms = statistics.median(times[((group, name), w)])
            base = statistics.median(times[((group, "torch"), w)])
            row[f"w{w}_ms"] = round(ms, 3)
            row[f"w{w}_gb_per_s"] = round(nbytes / ms / 1e6, 1)
            row[f"w{w}_vs_torch"] = round(base / ms, 2)
        rows.append(row)
    return {"rows": rows, "widths": list(widths), "rounds": rounds, "threads": torch.get_num_threads(),
            "clock": "process CPU time" if clock is time.process_time else "wall",
            "act": str(act_dtype).removeprefix("torch."), "load_before": load_before, "load_after": os.getloadavg()}


def format_kernel_report(report: dict) -> str:
    ws = report["widths"]
    lines = [f"{report['threads']} thread(s), {report['act']} inputs, {report['rounds']} interleaved rounds, medians of "
             f"{report['clock']}; "
             f"load average {report['load_before'][0]:.2f} before, {report['load_after'][0]:.2f} after",
             f"{'weights':13s} {'kernel':30s} {'MB':>6s} " + " ".join(f"{'w' + str(w) + ' ms':>9s} {'GB/s':>6s} {'x':>5s}"
                                                                      for w in ws) + "  w5/w1  w17/w1"]
    for r in report["rows"]:
        line = f"{r['weights']:13s} {r['kernel']:30s} {r['mb']:6.1f} " + " ".join(
            f"{r[f'w{w}_ms']:9.2f} {r[f'w{w}_gb_per_s']:6.1f} {r[f'w{w}_vs_torch']:5.2f}" for w in ws)
        if 1 in ws and 5 in ws and 17 in ws:
            line += f"  {r['w5_ms'] / r['w1_ms']:5.2f}  {r['w17_ms'] / r['w1_ms']:6.2f}"
        lines.append(line)
    return "\n".join(lines)
