"""Suffix decoding: a training-free tree drafter over text the system has already seen.

After SuffixDecoding (Oliaro et al., NeurIPS 2025; Snowflake's Arctic Inference; vLLM's
`suffix` method): the end of the request's text is matched against (1) the request's own
prompt and output so far and (2) a global store of earlier requests' outputs (optionally
their prompts), scoped by a key (the request's content type, the telemetry policy's key,
when asked). Every earlier occurrence of the longest match votes for what followed it; the
draft is a token TREE of the most frequent continuations, best-first by empirical
probability (the share of occurrences that continue along the path), with a node budget
that grows with the match length (`factor * match + offset`, at most the bundle's verify
width) and a depth of at most the controller's gamma.

Drafts are a deterministic function of the text and the store (one-hot, `probs` None), so
the tree verifier's greedy argmax walk and its recursive rejection over siblings
(sampling/acceptance.py) keep the output lossless, as for token recycling. Because the
store is shared, a seeded sampled request's exact tokens may depend on earlier requests
(its distribution does not).

The structure (written here, not taken from a library): Arctic Inference's suffix tree is
C++ inside a vLLM plugin, shipped on PyPI as a source archive only; `pip install` builds it
in isolation against its own pinned torch, protobuf and gRPC tools (a multi-GB build
environment on a CPU machine), and its store is capped by request count, not size. Here a
store is an append-only arena of token ids (documents separated by negative ids) with two
position indexes, by last token and by last 4-gram; that is an implicit suffix trie of
unbounded depth: the occurrences of a suffix are the index's hits whose backward match (at
most MATCH_WINDOW tokens; in Python over a few hits, one vectorised numpy compare over many)
reaches its length, and the subtree below the match is built from the hits' continuations
only when drafting.
Appending a token costs two dict appends; a draft costs one index read, one compare over
at most MAX_SCAN hits and a small trie over at most MAX_HITS continuations (docs/suffix.md
has the measured cost per step, against Arctic's C++ tree built by hand).

Memory: the global store keeps at most `max_tokens` live tokens; adding a request evicts
whole earlier requests, least recently used first (a request is used when its text
contributes to a draft). Evicted text is blanked in the arena (its stale index entries then
never match) and the arena is rebuilt once dead slots outnumber live ones, so it holds at
most ~2x `max_tokens` slots. `stats()` reports the sizes (served in `/metrics`).
"""

from __future__ import annotations

import bisect
import heapq
import threading
from collections import Counter, OrderedDict

import numpy as np

from dataclasses import dataclass, field

from specbuild.speculation.proposers.base import Draft, DrafterBase, DrafterOptions, Needs

SEP = -1  # between documents, and past the arena's end
DEAD = -2  # an evicted document's slots
KEY = 4  # the longer index's n-gram length
MATCH_WINDOW = 32  # longest match measured (tokens)
MAX_SCAN = 1024  # most recent index hits compared per draft
MAX_HITS = 64  # most recent occurrences of the longest match whose continuations vote
SCAN_IN_PYTHON = 48  # up to this many hits a match compares them in Python, past it in numpy
SCOPES = ("global", "content_type")
ANSWER_KEY = 32  # a prompt's last tokens, under which the store keeps its request's answer


def prompt_key(prompt_ids) -> tuple:
    """What a prompt's stored answer is found by: its last ANSWER_KEY tokens (the question and
    the chat template's turn marker, whatever history came before them)."""
    return tuple(int(t) for t in prompt_ids[-ANSWER_KEY:])


class TokenIndex:
    """Token ids in one arena (documents separated by SEP) with hit lists by last token and
    by last KEY-gram: `by1[t]` / `by4[(a, b, c, d)]` hold end positions e (arena[e-1] is the
    last token of the occurrence; its continuation starts at e).

    The arena is kept twice: as a numpy array (`buf`, past its end SEP), which a match over
    many hits compares in one vectorised pass, and as a list of Python ints (`toks`, exactly
    buf[:n]), which a match over a few hits and the continuations read. A draft usually
    finds a handful of hits, and there numpy's fixed cost per call (~2 us an operation,
    ~35 us a match) was most of the drafter's step; the list reads cost ~0.1 us a token.
    The list costs ~36 bytes a slot beside the array's 8: ~14 MB for the default store's cap
    of 200,000 tokens at its most (twice the cap in slots before compaction)."""

    def __init__(self, capacity: int = 256) -> None:
        self.buf = np.full(max(16, capacity), SEP, dtype=np.int64)
        self.toks: list[int] = []
        self.n = 0  # slots used (tokens and separators)
        self.by1: dict[int, list[int]] = {}
        self.by4: dict[tuple[int, ...], list[int]] = {}
        self._tail: list[int] = []  # the current document's last (at most) KEY - 1 tokens

    def _grow(self, need: int) -> None:
        if need + MATCH_WINDOW + 1 > self.buf.shape[0]:
            new = np.full(max(2 * self.buf.shape[0], need + MATCH_WINDOW + 1), SEP, dtype=np.int64)
            new[:self.n] = self.buf[:self.n]
            self.buf = new

    def extend(self, tokens: list[int]) -> None:
        """Append tokens (Python ints) to the current (last) document."""
        if not tokens:
            return
        self._grow(self.n + len(tokens))
        self.buf[self.n:self.n + len(tokens)] = tokens
        self.toks.extend(tokens)
        start = self.n
        by1, by4 = self.by1, self.by4
        for e, t in enumerate(tokens, start + 1):
            hits = by1.get(t)
            if hits is None:
                by1[t] = [e]
            else:
                hits.append(e)
        # the KEY-grams that end at each new token, within this document
        run = self._tail + tokens
        e = start + KEY - len(self._tail)  # where the first of them ends
        for key in zip(*(run[i:] for i in range(KEY))):
            hits = by4.get(key)
            if hits is None:
                by4[key] = [e]
            else:
                hits.append(e)
            e += 1
        self._tail = run[-(KEY - 1):]
        self.n = start + len(tokens)

    def end_document(self) -> None:
        """Close the current document (a separator follows it)."""
        self._grow(self.n + 1)
        self.buf[self.n] = SEP
        self.toks.append(SEP)
        self.n += 1
        self._tail = []

    def kill(self, start: int, end: int) -> None:
        """Blank slots start..end-1 (an evicted document): stale hits there never match again."""
        self.buf[start:end] = DEAD
        self.toks[start:end] = [DEAD] * (end - start)

    def tail(self, width: int = MATCH_WINDOW) -> list[int]:
        """The arena's last `width` slots (a request's own text: the context a match reads)."""
        return self.toks[-width:]

    def match(self, ctx) -> tuple[int, np.ndarray]:
        """The longest suffix of ctx (a sequence of token ids, length L >= 1) that occurs here
        followed by at least one token: (its length, the end positions of its most recent
        occurrences, at most MAX_HITS, oldest first); (0, []) when even the last token never
        occurred."""
        length = len(ctx)
        tail = [int(t) for t in ctx[max(0, length - MATCH_WINDOW):]]
        m, ends = self.match_tail(tail, length)
        return m, np.asarray(ends, dtype=np.int64)

    def match_tail(self, tail: list[int], length: int) -> tuple[int, list[int]]:
        """`match` for a context of `length` tokens given its last min(length, MATCH_WINDOW)
        as a list; the end positions as a list. The last KEY-gram's hits first; where none of
        them is a live occurrence with a token after it, every match is shorter than KEY and
        the last token's hits are compared over KEY - 1 tokens."""
        n = self.n
        if length >= KEY and len(tail) >= KEY:
            hits = self.by4.get(tuple(tail[-KEY:]))
            if hits and hits[-1] >= n:  # the text's own end (a request's local text) is no occurrence
                hits = hits[-MAX_SCAN - 1:-1]
            if hits:
                m, ends = self._scan(tail, hits, len(tail))
                if m:
                    return m, ends
        hits = self.by1.get(tail[-1])
        if hits and hits[-1] >= n:
            hits = hits[-MAX_SCAN - 1:-1]
        if not hits:
            return 0, []
        return self._scan(tail, hits, min(len(tail), KEY - 1))

    def follow(self, n_min: int, n_max: int, k: int) -> list[int]:
        """Prompt lookup over this arena as one text (a request's own, LocalText): up to k
        tokens that followed the most recent earlier occurrence of the text's longest suffix of
        n_min..n_max tokens; [] when none occurs. What ngram.lookup gives, from the index: the
        backward match is capped at n_max, so the latest hit reaching the cap (or the longest
        match) is the occurrence lookup picks (only the last MAX_SCAN hits of a last token are
        compared, where lookup reads the whole text)."""
        length = self.n
        n_max = min(n_max, length - 1, MATCH_WINDOW)
        if k <= 0 or n_max < max(1, n_min):
            return []
        m, ends = self.match_tail(self.toks[length - n_max:], length)
        if m < n_min or not ends:
            return []
        return self.toks[ends[-1]:ends[-1] + k]

    def _scan(self, tail: list[int], hits: list[int], w: int) -> tuple[int, list[int]]:
        """The longest backward match (at most w tokens) of tail's end before each of the most
        recent MAX_SCAN hits that has a continuation, and the most recent MAX_HITS hits that
        reach it (oldest first)."""
        if len(hits) > MAX_SCAN:
            hits = hits[-MAX_SCAN:]
        if len(hits) > SCAN_IN_PYTHON:
            return self._match_numpy(tail, hits, w)
        toks = self.toks
        last = len(toks)
        want = tail[len(tail) - w:]
        rev = want[::-1]  # rev[j]: the context's token j back from its end
        head = min(w, KEY)
        best, ends = 0, []
        for e in hits:
            if e >= last or toks[e] < 0:  # no continuation: the arena's end, a separator, evicted text
                continue
            k = 0
            while k < head and k < e and toks[e - 1 - k] == rev[k]:
                k += 1
            if k == head < w:  # the whole window at once (a copy), else on token by token
                if e >= w and toks[e - w:e] == want:
                    k = w
                else:
                    while k < w and k < e and toks[e - 1 - k] == rev[k]:
                        k += 1
            if k > best:
                best, ends = k, [e]
            elif k == best and k:
                ends.append(e)
        return best, ends[-MAX_HITS:]

    def _match_numpy(self, tail: list[int], hits: list[int], w: int) -> tuple[int, list[int]]:
        """match_tail over many hits: one vectorised compare of the window before each."""
        cand = np.asarray(hits, dtype=np.int64)
        back = np.arange(w)
        want = np.asarray(tail[len(tail) - w:][::-1], dtype=np.int64)
        idx = cand[:, None] - 1 - back[None, :]  # [h, w] arena slots, backwards from each hit
        eq = (self.buf[np.maximum(idx, 0)] == want[None, :]) & (idx >= 0)
        mlen = np.cumprod(eq, axis=1).sum(axis=1)
        # a continuation must exist: not the arena's end, a separator or an evicted slot
        mlen[self.buf[np.minimum(cand, self.buf.shape[0] - 1)] < 0] = 0
        m = int(mlen.max())
        if m == 0:
            return 0, []
        return m, cand[mlen == m][-MAX_HITS:].tolist()

    def continuations(self, ends, depth: int) -> np.ndarray:
        """[h, depth] tokens that followed each end position (negative past a document's end)."""
        return np.asarray(self.rows(ends, depth), dtype=np.int64).reshape(len(ends), depth)

    def rows(self, ends, depth: int) -> list[tuple[int, ...]]:
        """`continuations` as a list of tuples (what build_tree reads)."""
        toks = self.toks
        out = []
        for e in ends:
            row = toks[e:e + depth]
            if len(row) < depth:
                row = row + [SEP] * (depth - len(row))
            out.append(tuple(row))
        return out


class LocalText:
    """One request's prompt and output so far, indexed as it grows."""

    def __init__(self) -> None:
        self.index = TokenIndex()
        self.seen_prompt = 0
        self.seen_output = 0
        # the suffix drafter's answer anchor: the stored request whose prompt ended as this one's
        # (None: none, or its output and this one's parted), how many output tokens agree so
        # far, and whether it was looked up
        self.answer: int | None = None
        self.answer_agrees = 0
        self.answer_looked = False

    @classmethod
    def synced(cls, table: dict, seq) -> "LocalText":
        """seq's entry of a drafter's table (seq_id -> LocalText; made on first use), caught up
        with its text. The suffix and ngram drafters and token recycling's lookup keep one each
        and drop it on release."""
        local = table.get(seq.seq_id)
        if local is None:
            local = table[seq.seq_id] = cls()
        local.sync(seq)
        return local

    def sync(self, seq) -> int:
        """Catch up with seq's text (appends only: committed tokens never change); returns its
        length (the text is the index's arena: `index.toks`)."""
        if self.seen_prompt < len(seq.prompt_ids):
            self.index.extend([int(t) for t in seq.prompt_ids[self.seen_prompt:]])
            self.seen_prompt = len(seq.prompt_ids)
        out = seq.output_ids
        if self.seen_output < len(out):
            self.index.extend([int(t) for t in out[self.seen_output:]])
            self.seen_output = len(out)
        return self.index.n


class _Doc:
    """A stored request: its slots [start, end) in its scope's arena; `key` the end of its prompt
    (GlobalStore.answers) or None; its output begins `lead` slots after start."""

    __slots__ = ("scope", "start", "end", "key", "lead")

    def __init__(self, scope: str, start: int, end: int, key: tuple | None = None, lead: int = 0) -> None:
        self.scope, self.start, self.end, self.key, self.lead = scope, start, end, key, lead


class GlobalStore:
    """Earlier requests' text by scope, at most `max_tokens` live tokens, LRU by request."""

    def __init__(self, max_tokens: int) -> None:
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"suffix store max_tokens={max_tokens!r} must be an integer >= 0")
        self.max_tokens = max_tokens
        self.indexes: dict[str, TokenIndex] = {}
        self.docs: OrderedDict[int, _Doc] = OrderedDict()  # LRU order, oldest first
        self._starts: dict[str, list[int]] = {}  # scope -> sorted doc starts
        self._by_start: dict[tuple[str, int], int] = {}  # (scope, start) -> doc id
        # (scope, the last ANSWER_KEY tokens of a prompt) -> the latest stored request that ended
        # its prompt so: the answer a prompt asked again is drafted from its first token
        self.answers: dict[tuple[str, tuple], int] = {}
        self.live_tokens = 0
        self.dead_slots: dict[str, int] = {}
        self.evictions = 0
        self.compactions = 0
        self._next = 0
        self.lock = threading.Lock()  # stats() may be read from a metrics thread

    def add(self, tokens: list[int], scope: str = "", key: tuple | None = None, lead: int = 0) -> int | None:
        """Store one request's text; returns its id (None when empty or over the whole cap:
        then only its last max_tokens tokens would fit, and a cut request is kept whole or not at all).
        `key`: the end of its prompt (prompt_key), under which `answer` finds its output, which
        begins `lead` tokens into `tokens`."""
        n = len(tokens)
        if n == 0 or n > self.max_tokens:
            return None
        with self.lock:
            while self.live_tokens + n > self.max_tokens and self.docs:
                self._evict(next(iter(self.docs)))
            index = self.indexes.get(scope)
            if index is None:
                index = self.indexes[scope] = TokenIndex()
                self._starts[scope] = []
                self.dead_slots[scope] = 0
            doc_id, self._next = self._next, self._next + 1
            start = index.n
            index.extend([int(t) for t in tokens])
            index.end_document()
            self.docs[doc_id] = _Doc(scope, start, start + n, key, lead)
            self._starts[scope].append(start)
            self._by_start[(scope, start)] = doc_id
            if key is not None and lead < n:
                self.answers[(scope, key)] = doc_id
            self.live_tokens += n
            return doc_id

    def _evict(self, doc_id: int) -> None:
        doc = self.docs.pop(doc_id)
        index = self.indexes[doc.scope]
        index.kill(doc.start, doc.end)  # stale hits there never match again
        starts = self._starts[doc.scope]
        del starts[bisect.bisect_left(starts, doc.start)]
        del self._by_start[(doc.scope, doc.start)]
        if doc.key is not None and self.answers.get((doc.scope, doc.key)) == doc_id:
            del self.answers[(doc.scope, doc.key)]
        self.live_tokens -= doc.end - doc.start
        self.dead_slots[doc.scope] += doc.end - doc.start + 1
        self.evictions += 1
        live = index.n - self.dead_slots[doc.scope]
        if self.dead_slots[doc.scope] > max(live, 1024):
            self._compact(doc.scope)

    def _compact(self, scope: str) -> None:
        """Rebuild a scope's arena and indexes from its live documents (order kept)."""
        old = self.indexes[scope]
        fresh = TokenIndex(2 * (old.n - self.dead_slots[scope]) + 16)
        ids = [i for i, d in self.docs.items() if d.scope == scope]
        for doc_id in sorted(ids, key=lambda i: self.docs[i].start):
            doc = self.docs[doc_id]
            del self._by_start[(scope, doc.start)]
            start = fresh.n
            fresh.extend(old.toks[doc.start:doc.end])
            fresh.end_document()
            doc.start, doc.end = start, start + (doc.end - doc.start)
            self._by_start[(scope, start)] = doc_id
        self._starts[scope] = sorted(self.docs[i].start for i in ids)
        self.indexes[scope] = fresh
        self.dead_slots[scope] = 0
        self.compactions += 1

    def answer(self, scope: str, key: tuple) -> int | None:
        """The latest stored request in `scope` whose prompt ended with `key` (its doc id)."""
        return self.answers.get((scope, key))

    def touch(self, scope: str, ends) -> None:
        """The documents holding these end positions were used: most recently used now."""
        starts = self._starts.get(scope)
        if not starts:
            return
        for e in set(ends.tolist() if isinstance(ends, np.ndarray) else ends):
            i = bisect.bisect_right(starts, e - 1) - 1
            if i >= 0:
                doc_id = self._by_start.get((scope, starts[i]))
                if doc_id is not None:
                    self.docs.move_to_end(doc_id)

    def copy(self) -> "GlobalStore":
        with self.lock:
            out = GlobalStore(self.max_tokens)
            for scope, ix in self.indexes.items():
                c = out.indexes[scope] = TokenIndex(1)
                c.buf, c.toks, c.n, c._tail = ix.buf.copy(), list(ix.toks), ix.n, list(ix._tail)
                c.by1 = {k: v[:] for k, v in ix.by1.items()}
                c.by4 = {k: v[:] for k, v in ix.by4.items()}
            out.docs = OrderedDict((i, _Doc(d.scope, d.start, d.end, d.key, d.lead)) for i, d in self.docs.items())
            out.answers = dict(self.answers)
            out._starts = {k: v[:] for k, v in self._starts.items()}
            out._by_start = dict(self._by_start)
            out.live_tokens, out.dead_slots = self.live_tokens, dict(self.dead_slots)
            out.evictions, out.compactions, out._next = self.evictions, self.compactions, self._next
            return out

    def stats(self) -> dict[str, int]:
        with self.lock:
            slots = sum(ix.n for ix in self.indexes.values())
            return {"requests": len(self.docs), "tokens": self.live_tokens, "max_tokens": self.max_tokens,
                    "arena_slots": slots, "scopes": len(self.indexes),
                    "evictions": self.evictions, "compactions": self.compactions}


def build_tree(parts: list[tuple], budget: int, min_prob: float,
               rate: float = 1.0) -> tuple[list[int], list[int], list[int], list[str], list[float]]:
    """The best-first tree over continuation rows (each part: rows [h, d], an array or a list
    of tuples as TokenIndex.rows gives, and the name of where they came from; negative ids end
    a row): at most `budget` nodes, each with path
    probability (the share of all rows through it) >= min_prob, parents before children.
    Nodes are taken best-first by score = path probability * rate ** depth (rate: the
    measured chance that the target follows the match one more token, so a node deep on a
    sure path can outrank a shallow guess). Returns tokens, parents ([0] = -1 for the root,
    then the parent's node index, root 0), depths, sources (a part's name, or "both" where
    rows of several parts agree) and scores of nodes 1..n."""
    kids: dict[int, dict[int, int]] = {0: {}}  # trie over the distinct rows: node -> {token: node}
    tok_of, cnt, dep, src = [0], [0], [0], [""]
    total = 0.0
    for rows, name in parts:
        if isinstance(rows, np.ndarray):
            rows = rows.tolist()
        distinct = Counter(map(tuple, rows))  # copies of one passage collapse here
        total += float(len(rows))
        for row, c in distinct.items():
            node = 0
            for t in row:
                if t < 0:
                    break
                nxt = kids[node].get(t)
                if nxt is None:
                    nxt = len(tok_of)
                    kids[node][t] = nxt
                    kids[nxt] = {}
                    tok_of.append(t)
                    cnt.append(0)
                    dep.append(dep[node] + 1)
                    src.append(name)
                elif src[nxt] != name:
                    src[nxt] = "both"
                cnt[nxt] += c
                node = nxt
    tokens: list[int] = []
    parents: list[int] = [-1]
    depths: list[int] = []
    sources: list[str] = []
    scores: list[float] = []
    out_of = {0: 0}  # trie node -> draft node
    # (a child's score never exceeds its parent's, so parents still come before children)
    heap = [(-cnt[k] / total * rate, k, 0) for k in kids[0].values() if cnt[k] / total >= min_prob]
    heapq.heapify(heap)
    while heap and len(tokens) < budget:
        negs, k, parent_trie = heapq.heappop(heap)
        out_of[k] = len(tokens) + 1
        tokens.append(tok_of[k])
        parents.append(out_of[parent_trie])
        depths.append(dep[k])
        sources.append(src[k])
        scores.append(-negs)
        for kid in kids[k].values():
            if cnt[kid] / total >= min_prob:
                heapq.heappush(heap, (-cnt[kid] / total * rate ** dep[kid], kid, k))
    return tokens, parents, depths, sources, scores


class MatchRates:
    """The measured chance that the target follows a match one more token, by match length.

    Each verified draft of a match of length m counts its accepted tokens and, when the
    target left the draft before its end, one rejection (the geometric model's estimate:
    accepted / (accepted + rejections)); counts decay so the estimate follows the workload.
    Before anything is measured, a prior of m / (m + PRIOR_OFFSET) weighs PRIOR_WEIGHT
    observations: one-token matches are guesses, 32-token matches mostly copies."""

    BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # lower bounds of the match-length buckets
    PRIOR_OFFSET = 1.5
    PRIOR_WEIGHT = 4.0
    DECAY = 0.995

    def __init__(self) -> None:
        self.acc = [0.0] * len(self.BUCKETS)
        self.rej = [0.0] * len(self.BUCKETS)

    def bucket(self, m: int) -> int:
        return max(0, bisect.bisect_right(self.BUCKETS, m) - 1)

    def rate(self, m: int) -> float:
        b = self.bucket(m)
        lo = self.BUCKETS[b]
        prior = lo / (lo + self.PRIOR_OFFSET)
        return (self.acc[b] + self.PRIOR_WEIGHT * prior) / (self.acc[b] + self.rej[b] + self.PRIOR_WEIGHT)

    def learn(self, m: int, accepted: int, depth: int) -> None:
        b = self.bucket(m)
        self.acc[b] = self.acc[b] * self.DECAY + accepted
        self.rej[b] = self.rej[b] * self.DECAY + float(accepted < depth)

    def copy(self) -> "MatchRates":
        out = MatchRates()
        out.acc, out.rej = self.acc[:], self.rej[:]
        return out


CORPUS_MAX_BYTES = 64 << 20  # most bytes of a warm corpus file (the suffix_corpus setting)
GUARANTEE = ("lossless", "lossless", "specbuild verify: tree argmax walk (greedy), recursive rejection sampling "
                                     "over siblings with deterministic candidates from text already seen (sampled)")


def check_corpus_file(path: str, max_bytes: int = CORPUS_MAX_BYTES) -> None:
    """ValueError unless `path` is a file of at most max_bytes (the warm corpus)."""
    import os

    if not isinstance(path, str) or not os.path.isfile(path):
        raise ValueError(f"suffix_corpus={path!r} is not a file")
    size = os.path.getsize(path)
    if size > max_bytes:
        raise ValueError(f"suffix_corpus={path!r} is {size} bytes, over the limit of {max_bytes} bytes")


@dataclass(frozen=True)
class Options(DrafterOptions):
    """The suffix drafter's store of earlier requests: its cap in tokens (whole requests evicted,
    least recently used first), its scope (global: one store; content_type: one per request
    content type), whether prompts join it beside outputs, and a server-side jsonl of the
    target's earlier outputs that pre-fills it at load (a warm start; drafts only, so lossless:
    read_corpus's format and size limit). Server-side settings only, never a request's."""

    store_tokens: int = field(default=200_000, metadata={
        "help": "Cap of the suffix drafter's store of earlier requests, in tokens (LRU by whole request)."})
    scope: str = field(default="global", metadata={
        "choices": SCOPES, "help": "One suffix store for all requests, or one per request content type."})
    prompts: bool = field(default=False, metadata={"help": "Prompts join the suffix store beside outputs."})
    answers: bool = field(default=True, metadata={
        "help": "A prompt ending as an earlier request's did (its last 32 tokens) drafts that request's "
                "answer from its first token, while the new answer follows it."})
    corpus: str | None = field(default=None, metadata={
        "path": True, "metavar": "FILE.jsonl",
        "help": "Pre-fill the suffix store at start from this jsonl of the target's earlier outputs "
                "({\"text\": ...} or {\"token_ids\": [...]} a line, at most 64 MiB; within the store's cap, "
                "evictable like any request). Drafts only: lossless."})

    def __post_init__(self) -> None:
        if not isinstance(self.store_tokens, int) or not 0 <= self.store_tokens <= 1 << 26:
            raise ValueError(f"suffix_store_tokens={self.store_tokens!r} is out of range [0, {1 << 26}]")
        if self.scope not in SCOPES:
            raise ValueError(f"suffix_scope={self.scope!r} is not one of {', '.join(SCOPES)}")
        if self.corpus is not None and (not isinstance(self.corpus, str) or not self.corpus):
            raise ValueError(f"suffix_corpus={self.corpus!r} must be a file path")

    def check_files(self) -> None:
        if self.corpus is not None:
            check_corpus_file(self.corpus)


def read_corpus(path: str, max_bytes: int = CORPUS_MAX_BYTES) -> list[dict]:
    """A warm corpus: a jsonl file of the target's earlier outputs, one JSON object a line
    with "text" (a string, tokenized by the engine) or "token_ids" (a list of ints), and
    optionally "content_type" (the store's scope under --suffix-scope content_type). Read
    only from server-side configuration (Options.corpus, the suffix_corpus setting), never
    from a request; refused over max_bytes."""
    import json

    check_corpus_file(path, max_bytes)
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            text, ids = (row.get("text"), row.get("token_ids")) if isinstance(row, dict) else (None, None)
            ct = row.get("content_type") if isinstance(row, dict) else None
            ok = (isinstance(text, str)) != (ids is not None) and (ids is None or (
                isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids))) \
                and (ct is None or (isinstance(ct, str) and len(ct) <= 64))
            if not ok:
                raise ValueError(f"suffix_corpus {path}:{n}: expected a JSON object with a string \"text\" or a "
                                 "list of int \"token_ids\" (one of the two), and optionally a \"content_type\" "
                                 "string of at most 64 characters")
            out.append(row)
    return out


class SuffixProposer(DrafterBase):
    """Proposer protocol (base.py). Per-sequence text in `self.local`; earlier requests in
    `self.store` (added when a request that uses it is released with output; a warm corpus
    fills it at start, `warm`)."""

    name = "suffix"
    needs = Needs(tree=True)
    covers = ("ngram",)  # its local matches are prompt lookup's (the request's own text), as trees

    def __init__(self, max_nodes: int = 8, max_tokens: int = 200_000, scope: str = "global",
                 include_prompts: bool = False, factor: float = 2.0, offset: float = 0.0,
                 min_prob: float = 0.1, answers: bool = True) -> None:
        if scope not in SCOPES:
            raise ValueError(f"suffix scope={scope!r} is not one of {', '.join(SCOPES)}")
        if not 1 <= max_nodes <= 64:
            raise ValueError(f"suffix max_nodes={max_nodes} is out of range [1, 64]")
        if not (factor > 0 and offset >= 0 and 0.0 <= min_prob < 1.0):
            raise ValueError(f"suffix factor={factor} (> 0), offset={offset} (>= 0), min_prob={min_prob} "
                             "([0, 1)) out of range")
        self.max_nodes = max_nodes
        self.store = GlobalStore(max_tokens)
        self.scope = scope
        self.include_prompts = include_prompts
        self.answers = answers  # a prompt asked again drafts its stored answer (answer_match)
        self.factor, self.offset, self.min_prob = factor, offset, min_prob
        self.local: dict[int, LocalText] = {}
        self.rates = MatchRates()
        self.verify_cost = None  # callable width -> seconds (the speculator's calibration); None: no cut
        self.pending: dict[int, int] = {}  # seq_id -> match length of its last draft (learned in observe)
        self.unanswered: set[int] = set()  # seq_ids holding no stored answer (holds_continuation)
        self.warm_state: tuple[GlobalStore, dict] | None = None  # the store as the warm corpus left it
        self.drafts = 0  # drafts proposed; and by where their longest match was
        self.from_local = 0
        self.from_global = 0
        self.last_match = 0  # the last draft's match length (diagnostics)

    def scope_of(self, seq) -> str:
        """The store a sequence reads and feeds: one for all (or its content type's), and one of
        its own per `cache_salt` (a salted request drafts only from requests with its salt, as
        its KV is shared only with them: the time to an answer asked again would otherwise tell
        a tenant whether another asked it first; the warm corpus is the unsalted store's)."""
        base = (getattr(seq, "content_type", None) or "") if self.scope == "content_type" else ""
        salt = getattr(getattr(seq, "request", None), "cache_salt", None)
        return base if not salt else f"{base}\x1fsalt:{salt}"

    def cut(self, scores: list[float]) -> int:
        """How many of the best-first nodes to send: n >= 1 maximising (1 + the n scores' sum) /
        verify_cost(n + 1) on the measured verify costs by width (whether to draft at all is the
        depth controller's choice, as for every drafter: it asked for a draft); all of them
        before costs are measured."""
        if self.verify_cost is None or not scores:
            return len(scores)
        best_n, best, total = 1, -1.0, 0.0
        for n, s in enumerate(scores, start=1):
            total += s
            rate = (1.0 + total) / self.verify_cost(n + 1)
            if rate > best:
                best_n, best = n, rate
        return best_n

    def depth_limit(self, seq, gamma: int) -> int:
        """The deepest draft: the fixed gamma when the request fixed one; otherwise the request's
        gamma_max, whatever depth the controller chose from the sequence's average acceptance
        (the match's budget and the measured costs choose the draft within it), within the
        node cap and the sequence's room."""
        spec = getattr(seq, "spec", None)
        limit = gamma if spec is None or not spec.dynamic else max(gamma, min(spec.gamma_max, self.max_nodes))
        room = getattr(seq, "remaining", None)
        return max(1, min(limit, room - 1 if isinstance(room, int) else limit))

    def draft_for(self, seq, gamma: int) -> Draft | None:
        local = LocalText.synced(self.local, seq)
        length = local.index.n
        if gamma <= 0 or length == 0:
            return None
        tail = local.index.tail()
        m_l, ends_l = local.index.match_tail(tail, length)
        scope = self.scope_of(seq)
        gindex = self.store.indexes.get(scope)
        m_g, ends_g = gindex.match_tail(tail, length) if gindex is not None else (0, [])
        if self.answers and gindex is not None:
            anchored = self.answer_match(local, seq, scope, gindex)
            if anchored is not None and anchored[0] > m_g:
                m_g, ends_g = anchored[0], [anchored[1]]
        m = max(m_l, m_g)
        self.last_match = m
        if m == 0:
            return None
        budget = max(1, min(self.max_nodes, int(self.factor * m + self.offset)))
        depth = min(self.depth_limit(seq, gamma), budget)
        parts = []
        if m_l == m:
            parts.append((local.index.rows(ends_l, depth), "local"))
        if m_g == m:
            parts.append((gindex.rows(ends_g, depth), "global"))
            self.store.touch(scope, ends_g)
        tokens, parents, depths, sources, scores = build_tree(parts, budget, self.min_prob, self.rates.rate(m))
        if not tokens:
            return None
        n = self.cut(scores)
        self.drafts += 1
        self.from_local += int(m_l == m)
        self.from_global += int(m_g == m)
        self.pending[seq.seq_id] = m
        draft = tree_draft(tokens[:n], parents[:n + 1], depths[:n], self.name)
        draft.sources = [f"{self.name}:{s}" for s in sources[:n]]
        draft.scores = scores[:n]
        return draft

    def answer_match(self, local: LocalText, seq, scope: str, gindex: TokenIndex) -> tuple[int, int] | None:
        """The stored answer of the latest request whose prompt ended as seq's (prompt_key), while
        seq's output so far is that answer's beginning: (the match it counts as: the key and the
        output so far, at most MATCH_WINDOW; the arena position its continuation starts at).
        A prompt asked again is then drafted from its first token (an index match needs a few
        output tokens before it reaches an earlier answer). Once the outputs part, or the answer
        was evicted or is used up, it is dropped for the request. Each step compares only the
        new output tokens."""
        if not local.answer_looked:
            local.answer_looked = True
            key = prompt_key(seq.prompt_ids)
            local.answer = self.store.answer(scope, key) if key else None
        if local.answer is None:
            return None
        doc = self.store.docs.get(local.answer)
        out = seq.output_ids
        if doc is None or doc.scope != scope:
            local.answer = None
            return None
        base, n = doc.start + doc.lead, len(out)
        if base + n >= doc.end:  # its whole answer is behind: nothing left to draft from it
            local.answer = None
            return None
        k = local.answer_agrees
        if k < n:
            if gindex.toks[base + k:base + n] != [int(t) for t in out[k:]]:
                local.answer = None
                return None
            local.answer_agrees = n
        return min(MATCH_WINDOW, min(ANSWER_KEY, len(seq.prompt_ids)) + n), base + n

    def holds_continuation(self, seq) -> bool:
        """An earlier answer to seq's prompt end that its output still follows (answer_match):
        `auto` drafts it without weighing. Per-sequence acceptance could not see it: a first
        step chose prompt lookup on its prior, and a suffix estimate lowered by an early
        rejection was never tried again (on 24 prompts asked again, `auto` took 518 target
        passes against suffix's 247)."""
        if not self.answers or seq.seq_id in self.unanswered:
            return False
        scope = self.scope_of(seq)
        gindex = self.store.indexes.get(scope)
        local = self.local.get(seq.seq_id)
        if gindex is None or (local is None and self.store.answer(scope, prompt_key(seq.prompt_ids)) is None):
            self.unanswered.add(seq.seq_id)  # asked each step under `auto`: no text indexed for it
            return False
        if self.answer_match(LocalText.synced(self.local, seq), seq, scope, gindex) is None:
            self.unanswered.add(seq.seq_id)  # parted or used up: for good
            return False
        return True

    # ---- the protocol ----------------------------------------------------------------
    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        return [self.draft_for(seq, gamma) for seq, gamma in zip(seqs, gammas)]

    def observe(self, seq, obs) -> None:
        """How far the target followed this sequence's last suffix candidates (alone or inside
        hybrid's tree): the match-length rates learn it."""
        m = self.pending.pop(seq.seq_id, None)
        if m is None or obs.sources is None:
            return
        accepted, depth = 0, 0
        for name, positions in obs.sources.items():
            if name.startswith(self.name + ":"):
                accepted += sum(a for _, a in positions)
                depth = max(depth, max((i + 1 for i, (o, _) in enumerate(positions) if o), default=0))
        if depth:
            self.rates.learn(m, accepted, depth)

    def release(self, seq) -> None:
        """The request's output (and prompt, with include_prompts) joins the global store."""
        self.local.pop(seq.seq_id, None)
        self.pending.pop(seq.seq_id, None)
        self.unanswered.discard(seq.seq_id)
        if getattr(seq, "finish_reason", None) not in ("stop", "length"):
            return  # failed or aborted: keep nothing of it
        if self.name not in seq.spec_state.uses and self.name not in seq.spec_state.keeps:
            return  # like recycling's table: learns from the requests that may draft with it (or
            # could have: `auto` that settled on plain decoding, SpecState.keeps)
        lead = list(seq.prompt_ids) if self.include_prompts else []
        key = prompt_key(seq.prompt_ids) if self.answers else None
        self.store.add(lead + list(seq.output_ids), self.scope_of(seq), key or None, len(lead))

    def warm(self, rows: list[dict], encode=None, vocab_size: int | None = None) -> dict[str, int]:
        """Pre-fill the global store from a corpus (read_corpus's rows) in file order, each row
        one document, evictable like any request; a row that would take the store past its cap
        is skipped (nothing is evicted for the corpus). `restore(None)` comes back to this
        state. Returns the counts (also in stats(): warm_requests, warm_tokens, warm_skipped)."""
        added = tokens = skipped = 0
        for i, row in enumerate(rows):
            if self.store.live_tokens >= self.store.max_tokens:
                skipped += len(rows) - i  # full: the rest is not even tokenized
                break
            if row.get("token_ids") is not None:
                ids = [int(t) for t in row["token_ids"]]
            elif encode is None:
                raise ValueError("suffix_corpus rows with \"text\" need the engine's tokenizer")
            else:
                ids = list(encode(row["text"]))
            if vocab_size is not None and ids and not 0 <= min(ids) <= max(ids) < vocab_size:
                raise ValueError(f"suffix_corpus row {i + 1}: token id {min(ids) if min(ids) < 0 else max(ids)} is "
                                 f"outside the target's vocabulary [0, {vocab_size})")
            scope = (row.get("content_type") or "") if self.scope == "content_type" else ""
            if not ids or self.store.live_tokens + len(ids) > self.store.max_tokens:
                skipped += 1
                continue
            self.store.add(ids, scope)
            added, tokens = added + 1, tokens + len(ids)
        counts = {"warm_requests": added, "warm_tokens": tokens, "warm_skipped": skipped}
        self.warm_state = (self.store.copy(), counts)
        return counts

    def snapshot(self) -> tuple:
        """A copy of the global store and the match-length rates (benchmarks restore it so
        repeats start alike)."""
        return self.store.copy(), self.rates.copy()

    def restore(self, snap: tuple | None) -> None:
        """Put back a snapshot; None: a fresh start (the warm corpus's store when one was
        loaded, else an empty store; the prior rates)."""
        if snap is not None:
            self.store, self.rates = snap[0].copy(), snap[1].copy()
            return
        self.store = self.warm_state[0].copy() if self.warm_state is not None else GlobalStore(self.store.max_tokens)
        self.rates = MatchRates()

    def stats(self) -> dict[str, int]:
        warm = self.warm_state[1] if self.warm_state is not None else \
            {"warm_requests": 0, "warm_tokens": 0, "warm_skipped": 0}
        return {**self.store.stats(), **warm, "local_requests": len(self.local), "drafts": self.drafts,
                "drafts_from_local": self.from_local, "drafts_from_global": self.from_global}

    def engine_stats(self) -> dict[str, int]:
        """The global store in Engine.stats() (/metrics): suffix_store_requests / _tokens /
        _max_tokens / _evictions / _warm_tokens (what the warm corpus put in at load; those
        tokens count in _tokens too)."""
        st = self.store.stats()
        out = {f"suffix_store_{k}": st[k] for k in ("requests", "tokens", "max_tokens", "evictions")}
        warm = self.warm_state[1] if self.warm_state is not None else {}
        out["suffix_store_warm_tokens"] = warm.get("warm_tokens", 0)  # loaded from the warm corpus at start
        return out


def build(ctx) -> SuffixProposer:
    o: Options = ctx.options
    prop = SuffixProposer(max(1, ctx.max_draft_len), o.store_tokens, o.scope, o.prompts, answers=o.answers)
    if o.corpus:  # server-side configuration only (EngineConfig), never a request's field
        prop.warm(read_corpus(o.corpus), ctx.encode, ctx.vocab_size)
    return prop


_MASKS: dict = {}  # parents -> ancestor mask (read-only, shared)
_MASKS_MAX = 4096  # distinct tree shapes kept; past it the table starts again


def tree_mask(parents: tuple[int, ...]):
    """The [n + 1, n + 1] bool ancestor mask of a tree given its parents (parents[0] = -1).
    Drafters repeat a few shapes (chains, the same best-first trees), so masks are built once
    per shape and shared: nothing writes to a draft's mask (step.py and tree.py read it)."""
    mask = _MASKS.get(parents)
    if mask is None:
        import torch

        n = len(parents)
        m = np.zeros((n, n), dtype=np.bool_)
        m[0, 0] = True
        for i in range(1, n):
            m[i] = m[parents[i]]
            m[i, i] = True
        if len(_MASKS) >= _MASKS_MAX:
            _MASKS.clear()
        mask = _MASKS[parents] = torch.from_numpy(m)
    return mask


def tree_draft(tokens: list[int], parents: list[int], depths: list[int], method: str) -> Draft:
    """A Draft of nodes 1..n (parents[0] = -1 for the root; parents before children)."""
    parents = tuple(parents)
    return Draft(list(tokens), None, parents, list(depths), tree_mask(parents), method=method)
