"""Proposal cost per step of the suffix drafter (speculation/proposers/suffix.py), and, where
Arctic Inference's C++ suffix tree imports here, the same replay through it, interleaved.

Replays the repeated-work workload (bench/repeated.py) without a model: each request's prompt
is its first turn, its "output" the request's own document or slot text followed by the
prompt's tail (a copy-heavy answer, the case suffix decoding targets). At every output token
both structures propose a tree of at most --nodes nodes from the context so far, then take the
true next token. Reported per structure: median and mean microseconds per step (propose +
update), and tokens per pass the tree would give if the target's greedy continuation were the
replayed text (the longest path of the tree matching it, + 1): a drafting-quality proxy
that needs no model, not a measured speedup.

    python scripts/suffix_cost.py BUNDLE_DIR [--nodes 8] [--repeats 3]

Arctic's tree (arctic_inference.suffix_decoding) is measured only if it imports: it is built
from its source archive by hand (see docs/suffix.md), never installed by the project. Prompt
lookup (n-grams 1-3) is replayed too: the ngram drafter's index against ngram.lookup's scan of
the whole text, which it replaced (the same drafts: the same tokens per pass).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specbuild.bench.repeated import questions  # noqa: E402
from specbuild.speculation.proposers.suffix import SuffixProposer  # noqa: E402
from specbuild.speculation.state import SpecState  # noqa: E402


class Seq:
    def __init__(self, seq_id, prompt):
        self.seq_id, self.prompt_ids, self.output_ids = seq_id, list(prompt), []
        self.content_type, self.finish_reason, self.spec = None, "stop", None
        self.spec_state = SpecState(uses=frozenset({"suffix"}))  # release() stores only its users' text


def path_len(tokens, parents, truth) -> int:
    """Longest root path of the tree (nodes 1..n, parents[i] for node i+1, root 0) matching truth."""
    best, depth = 0, {0: 0}
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        d = depth.get(par)
        if d is not None and d < len(truth) and truth[d] == tok:
            depth[i + 1] = d + 1
            best = max(best, d + 1)
    return best


def replay(streams, make_seq, draft, release):
    """Each stream step by step: draft(seq) is timed and returns how far its guess follows a
    given continuation; then that many true tokens and one more join the output. Returns the
    step times and tokens per pass."""
    times, passes, emitted = [], 0, 0
    for n, (prompt, output) in enumerate(streams):
        seq = make_seq(n, prompt)
        t = 0
        while t < len(output):
            t0 = time.perf_counter()
            follows = draft(seq)
            times.append(time.perf_counter() - t0)
            step = min(follows(output[t:]) + 1, len(output) - t)
            seq.output_ids.extend(output[t:t + step])
            t += step
            passes += 1
            emitted += step
        release(seq)
    return times, emitted / passes


def replay_ours(streams, nodes):
    prop = SuffixProposer(max_nodes=nodes)

    def make_seq(n, prompt):
        seq = Seq(n, prompt)
        seq.spec = type("S", (), {"method": "suffix", "dynamic": False})()  # a fixed depth: the tree's nodes
        return seq

    def draft(seq):
        d = prop.draft_for(seq, nodes)
        return lambda truth: path_len(d.tokens, d.parents[1:], truth) if d is not None else 0

    return replay(streams, make_seq, draft, prop.release)


def replay_arctic(streams, nodes):
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=100000)
    times, passes, emitted = [], 0, 0
    for n, (prompt, output) in enumerate(streams):
        t0 = time.perf_counter()
        cache.start_request(n, prompt)  # counted in the first step, as specbuild's prompt indexing is
        start = time.perf_counter() - t0
        ctx = list(prompt)
        t = 0
        while t < len(output):
            t0 = time.perf_counter()
            d = cache.speculate(n, ctx[-64:], max_spec_tokens=nodes, use_tree_spec=True)
            times.append(time.perf_counter() - t0 + start)
            start = 0.0
            parents = [p + 1 for p in d.parents]  # Arctic: -1 = the root, else a token's index
            a = path_len(d.token_ids, parents, output[t:])
            step = min(a + 1, len(output) - t)
            t1 = time.perf_counter()
            cache.add_active_response(n, output[t:t + step])
            times[-1] += time.perf_counter() - t1
            ctx.extend(output[t:t + step])
            t += step
            passes += 1
            emitted += step
        cache.stop_request(n)
    return times, emitted / passes


def replay_lookup(streams, nodes, indexed: bool):
    """Prompt lookup over the same replay (n-grams 1-3, as a request's defaults): the ngram
    drafter's indexed lookup, or ngram.lookup's scan of the whole text (its definition)."""
    import numpy as np

    from specbuild.speculation.config import SpeculationConfig
    from specbuild.speculation.proposers.ngram import NgramProposer, lookup

    prop = NgramProposer()

    def make_seq(n, prompt):
        seq = Seq(n, prompt)
        seq.spec = SpeculationConfig.make(None, method="ngram")
        return seq

    def draft(seq):
        if indexed:
            d = prop.propose([seq], [nodes])[0]
            tokens = list(d.tokens) if d is not None else []
        else:
            tokens = lookup(np.asarray(seq.prompt_ids + seq.output_ids, dtype=np.int64), 1, 3, nodes)

        def follows(truth):
            a = 0
            while a < len(tokens) and a < len(truth) and tokens[a] == truth[a]:
                a += 1
            return a
        return follows

    return replay(streams, make_seq, draft, prop.release)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch  # noqa: F401 - imported before the timing: a draft's tree mask is a torch tensor
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.bundle, "tokenizer.json"))
    streams = []
    for q in questions():
        prompt = tok.encode(q["turns"][0]).ids
        body = prompt[len(prompt) // 4:]  # the answer quotes most of its input
        streams.append((prompt, body))
    runners = {"specbuild suffix": replay_ours,
               "prompt lookup, indexed (ngram drafter)": lambda st, n: replay_lookup(st, n, True),
               "prompt lookup, whole-text scan": lambda st, n: replay_lookup(st, n, False)}
    try:
        import arctic_inference.suffix_decoding  # noqa: F401

        runners["Arctic Inference suffix tree (C++)"] = replay_arctic
    except ImportError as e:
        print(f"Arctic Inference not importable here ({e}); measuring specbuild's only")
    results = {name: [] for name in runners}
    tpp = {}
    for _ in range(args.repeats):  # interleaved: drift hits both alike
        for name, fn in runners.items():
            times, tokens_per_pass = fn(streams, args.nodes)
            results[name].append(times)
            tpp[name] = tokens_per_pass
    print(f"{len(streams)} requests, {sum(len(o) for _, o in streams)} output tokens, trees of <= {args.nodes} "
          f"nodes, {args.repeats} interleaved repeats; load {os.getloadavg()[0]:.1f}")
    for name, reps in results.items():
        med = statistics.median(statistics.median(r) for r in reps) * 1e6
        mean = statistics.median(statistics.fmean(r) for r in reps) * 1e6
        print(f"  {name:36s} median {med:7.1f} us/step  mean {mean:7.1f} us/step  "
              f"replay tokens/pass {tpp[name]:.2f}")


if __name__ == "__main__":
    main()
