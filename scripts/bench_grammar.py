"""Mask cost per token of the grammar engines on a bundle's tokenizer, for one JSON schema,
and one correctness probe (does a string with maxLength refuse a raw control character, as
JSON requires?): the measurement behind specbuild.sampling.constraint's choice of llguidance.

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
import time

from _common import lscpu  # scripts/_common.py
from tokenizers import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PROBE = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 12}}, "required": ["s"]}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}'


def cpu() -> str:
    keep = [line for line in lscpu().splitlines() if line.startswith(("Model name", "Flags"))]
    return "\n".join(keep) or platform.processor()


def run_xgrammar(tok_json: str, vocab: int, stop: list[int], ids: list[int]) -> tuple[float, list[float], bool]:
    import xgrammar as xgr

    model = json.loads(tok_json)
    encoded = [""] * vocab
    for token, i in model["model"]["vocab"].items():
        if i < vocab:
            encoded[i] = token
    for added in model.get("added_tokens", []):
        if added["id"] < vocab:
            encoded[added["id"]] = "" if added.get("special") else added["content"]
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=stop)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # once per engine, not counted
    t0 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        a = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - a)
        assert matcher.accept_token(t)
    probe = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(PROBE)))
    probe.accept_string('{"s": "a')
    return compile_s, times, not probe.accept_string("\x00")


def run_llguidance(tok_json: str, vocab: int, stop: list[int], ids: list[int]) -> tuple[float, list[float], bool]:
    from specbuild.sampling.constraint import GrammarBackend, ResponseFormat

    backend = GrammarBackend(tok_json, vocab, stop)  # once per engine: the tokenizer, not counted
    t0 = time.perf_counter()
    c = backend.constraint(ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMA}}))
    compile_s = time.perf_counter() - t0
    mask = c.bitmask()
    times = []
    for t in ids:
        a = time.perf_counter()
        c._fill(c.matcher, mask, 0)
        times.append(time.perf_counter() - a)
        c.advance(t)
    probe = backend.constraint(ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "p",
                                                                                             "schema": PROBE}}))
    prefix = backend.tokenizer.tokenize_str('{"s": "a')
    nul = backend.tokenizer.tokenize_bytes(b"\x00")
    return compile_s, times, probe.matcher.try_consume_tokens(prefix + nul) == len(prefix)


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
        valid = "refuses" if runs[0][2] else "ACCEPTS (invalid JSON)"
        print(f"{name:11s} grammar compile {comp:7.1f} ms   mask per token: median {med:.4f} ms, max {mx:.3f} ms   "
              f"raw NUL in a maxLength string: {valid}")


if __name__ == "__main__":
    main()
