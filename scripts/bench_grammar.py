"""Mask cost per token of the grammar engines on a bundle's tokenizer, for one JSON schema:
the measurement behind specbuild.sampling.constraint's choice of xgrammar.

    python scripts/bench_grammar.py BUNDLE [--repeats 5]

Prints the CPU model and flags, each engine's compile time and its per-token mask time
(median and max over the tokens of one schema-valid answer, median over repeats). Engines
that are not installed are skipped with the reason (pip install xgrammar llguidance).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

from tokenizers import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}'


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        keep = [line for line in out.splitlines() if line.startswith(("Model name", "Flags"))]
        return "\n".join(keep) or platform.processor()
    except OSError:
        return platform.processor()


def run_xgrammar(tok_json: str, vocab: int, stop: list[int], ids: list[int]) -> tuple[float, list[float]]:
    from specbuild.sampling.constraint import GrammarBackend, ResponseFormat

    t0 = time.perf_counter()
    c = GrammarBackend(tok_json, vocab, stop).constraint(ResponseFormat.parse(
        {"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}}))
    compile_s = time.perf_counter() - t0
    mask = c.bitmask()
    times = []
    for t in ids:
        a = time.perf_counter()
        c.matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - a)
        c.advance(t)
    return compile_s, times


def run_llguidance(tok_json: str, vocab: int, stop: list[int], ids: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_HfShim(tok_json, stop[0], vocab)))
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t0
    mask = lln.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        a = time.perf_counter()
        lln.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - a)
        if not matcher.consume_token(t):
            raise RuntimeError(matcher.get_error())
    return compile_s, times


class _HfShim:
    """The minimal tokenizer object llguidance's TokenizerWrapper reads (bytes per token id)."""

    def __init__(self, tok_json: str, eos: int, vocab: int) -> None:
        tok = Tokenizer.from_str(tok_json)
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = [bytes(tok.decode([i], skip_special_tokens=False), "utf-8") for i in range(vocab)]
        self._tok = tok

    def __call__(self, text, **kw):
        return self._tok.encode(text if isinstance(text, str) else text.decode("utf-8", "replace"),
                                add_special_tokens=False).ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    meta = json.load(open(os.path.join(args.bundle, "bundle.json")))
    tok_json = open(os.path.join(args.bundle, "tokenizer.json")).read()
    tok = Tokenizer.from_str(tok_json)
    vocab = json.load(open(os.path.join(args.bundle, "target", "model.json")))["vocab_size"]
    stop = [tok.token_to_id(s) for s in ("<|im_end|>", "<|endoftext|>", "</s>") if tok.token_to_id(s) is not None]
    ids = tok.encode(ANSWER, add_special_tokens=False).ids
    print(cpu())
    print(f"bundle {args.bundle} ({meta.get('name', '')}), vocabulary {vocab}, answer {len(ids)} tokens, "
          f"{args.repeats} repeats")
    for name, fn in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
        try:
            runs = [fn(tok_json, vocab, stop, ids) for _ in range(args.repeats)]
        except Exception as e:  # an engine missing or refusing is reported, not fatal
            print(f"{name:11s} skipped: {type(e).__name__}: {str(e)[:200]}")
            continue
        comp = statistics.median(r[0] for r in runs) * 1e3
        med = statistics.median(statistics.median(r[1]) for r in runs) * 1e3
        mx = statistics.median(max(r[1]) for r in runs) * 1e3
        print(f"{name:11s} compile {comp:8.1f} ms   mask per token: median {med:.4f} ms, max {mx:.3f} ms")


if __name__ == "__main__":
    main()
