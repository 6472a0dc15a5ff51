"""Faults injected into one request of a batch ("the culprit"), for the fault-isolation
tests: each context manager makes the engine fail on that request alone, at or after its
`after`-th generated token, in one place a real failure could come from.

    with fault(engine, "nan", CULPRIT, monkeypatch):
        results = engine.generate(requests)

Kinds: proposer (its drafter raises whenever its batch holds the culprit), verify (the
acceptance rule / the plain sampler raises), nan (the target's rows for the culprit are
NaN), grammar (the culprit's grammar engine stops with an error mid-request; the culprit
must carry a response_format). `innocents_unchanged` runs a batch clean and faulted and
returns both.
"""

from __future__ import annotations

import contextlib

from specbuild.speculation import speculator as speculator_mod
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig

CULPRIT = "culprit"


def is_culprit(seq, after: int = 0) -> bool:
    return seq.request.request_id == CULPRIT and len(seq.output_ids) >= after


class InjectedFault(RuntimeError):
    pass


@contextlib.contextmanager
def fault(engine, kind: str, monkeypatch, method: str | None = None, after: int = 3):
    with monkeypatch.context() as mp:
        if kind == "proposer":
            prop = engine.speculator.proposers[method]
            real = prop.propose

            def propose(seqs, gammas):
                if any(is_culprit(s, after) for s in seqs):
                    raise InjectedFault(f"injected drafter fault ({method})")
                return real(seqs, gammas)

            mp.setattr(prop, "propose", propose)
        elif kind == "verify":
            speculator = engine.speculator
            real_chain, real_tree = speculator.verify_chain, speculator.verify_tree
            real_plain = speculator_mod.plain_next_token

            def verify_chain(seq, draft, scores, *rest):
                if is_culprit(seq, after):
                    raise InjectedFault("injected verification fault")
                return real_chain(seq, draft, scores, *rest)

            def verify_tree(seq, draft, scores, *rest):
                if is_culprit(seq, after):
                    raise InjectedFault("injected verification fault")
                return real_tree(seq, draft, scores, *rest)

            def plain(seq, scores, *rest):
                if is_culprit(seq, after):
                    raise InjectedFault("injected sampling fault")
                return real_plain(seq, scores, *rest)

            mp.setattr(speculator, "verify_chain", verify_chain)
            mp.setattr(speculator, "verify_tree", verify_tree)
            mp.setattr(speculator_mod, "plain_next_token", plain)
        elif kind == "nan":
            runner = engine.scheduler.runner
            real_forward = runner.forward

            def forward(group, proposal):
                # the target's own output holds the NaN: one entry of the culprit's first
                # logits row, where the step reads it (its check and argmax over the group)
                out, aux0 = real_forward(group, proposal)
                r = 0
                for it in group:
                    if it.score is not None:
                        r += it.score_rows
                    if it.completes:
                        if is_culprit(it.seq, after):
                            out.logits = out.logits.clone()
                            out.logits[r, 7] = float("nan")
                        r += 1 + it.n_draft
                return out, aux0

            mp.setattr(runner, "forward", forward)
        elif kind == "grammar":
            runner = engine.scheduler.runner
            real_finish = runner.finish

            def finish(it, *rest):
                c = it.seq.constraint
                if is_culprit(it.seq, after) and c is not None and not isinstance(c.matcher, BrokenMatcher):
                    c.matcher = BrokenMatcher(c.matcher)
                return real_finish(it, *rest)

            mp.setattr(runner, "finish", finish)
        else:
            raise ValueError(kind)
        yield


class BrokenMatcher:
    """An llguidance matcher that has hit a parser limit: in its error state for good, as
    llguidance's own matchers are after 'Too many items' (is_error, get_error, stopped)."""

    def __init__(self, real) -> None:
        self.real = real

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return "parser error: Too many items (limit 50000; injected)"

    def is_stopped(self) -> bool:
        return True

    def consume_token(self, token: int) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self.real, name)


def requests(prompts, method: str, culprit: int, max_tokens: int = 20, response_format=None, gamma=None,
             **sampling) -> list[Request]:
    spec = SpeculationConfig.make(None, method=method, gamma=gamma)
    out = []
    for i, p in enumerate(prompts):
        seed = {"seed": 1000 + i} if sampling.get("temperature") else {}
        out.append(Request(prompt_ids=list(p), speculation=spec, request_id=CULPRIT if i == culprit else f"innocent-{i}",
                           response_format=response_format if i == culprit else None,
                           sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **seed, **sampling)))
    return out


def innocents_unchanged(engine, kind: str, method: str, prompts, monkeypatch, culprit: int = 1, after: int = 3,
                        clean: list | None = None, **kwargs) -> tuple[list, list]:
    """(clean results, faulted results) of the same batch; asserts what holds for every kind:
    the innocents' tokens and finish reasons are the clean run's, every KV block came back,
    and the culprit's outcome is counted."""
    if clean is None:
        clean = engine.generate(requests(prompts, method, culprit, **kwargs))
    before = engine.stats()["sequence_failures"]
    with fault(engine, kind, monkeypatch, method=method, after=after):
        faulted = engine.generate(requests(prompts, method, culprit, **kwargs))
    for i, (a, b) in enumerate(zip(clean, faulted)):
        if i != culprit:
            assert "error" not in b, (kind, method, i, b.get("error"))
            assert b["token_ids"] == a["token_ids"], (kind, method, i)
            assert b["finish_reason"] == a["finish_reason"]
    assert engine.cache.used_blocks == 0, "KV blocks leaked"
    for prop in engine.speculator.proposers.values():
        cache = getattr(prop, "cache", None)
        if cache is not None:
            assert cache.used_blocks == 0, "a drafter's KV blocks leaked"
    if kind != "proposer":
        assert engine.stats()["sequence_failures"] == before + 1
    return clean, faulted



def check_isolation(engine, method: str, prompts, monkeypatch, sampled: bool, drafts_independent: bool,
                    max_tokens: int = 20, **spec) -> None:
    """Every kind of fault in request 1 of `prompts` under `method` (greedy or seeded):
    verify and nan fail the culprit alone (500 naming the cause) after its first tokens,
    which match the clean run's; proposer costs the culprit only its drafts. The neighbours'
    tokens equal the clean run's throughout (innocents_unchanged). drafts_independent: the
    neighbours' drafts do not depend on the culprit (all but token recycling's shared table),
    so their draft counts must be the clean run's too where sampled (greedy drafts follow
    the batch: Speculator.fit_to_batch). spec: e.g. gamma (fixed depth)."""
    sampling = {"temperature": 0.9} if sampled else {}
    sampling.update(spec, max_tokens=max_tokens)
    clean = engine.generate(requests(prompts, method, 1, **sampling))
    if method != "none":  # the batch really speculates (greedy: and drafts get accepted)
        assert sum(r["stats"]["drafted"] for r in clean) > 0
        assert sampled or sum(r["stats"]["accepted"] for r in clean) > 0
    for kind, where in (("verify", "InjectedFault: injected"), ("nan", "NumericsError: the target's logits row 0")):
        _, faulted = innocents_unchanged(engine, kind, method, prompts, monkeypatch, clean=clean, **sampling)
        bad = faulted[1]
        assert bad["finish_reason"] == "error" and bad["error_status"] == 500, bad
        assert where in bad["error"] and "choosing its next tokens" in bad["error"], bad["error"]
        assert 3 <= len(bad["token_ids"]) < max_tokens  # it ran until the fault, then stopped
        assert bad["token_ids"] == clean[1]["token_ids"][:len(bad["token_ids"])]
    if method == "none":
        return
    _, faulted = innocents_unchanged(engine, "proposer", method, prompts, monkeypatch, clean=clean, **sampling)
    bad = faulted[1]
    # a drafter failing on one request costs that request its drafts, not its answer: it
    # decodes plainly from there (lossless), its neighbours keep drafting
    assert "error" not in bad and bad["finish_reason"] == "length"
    if not sampled:
        assert bad["token_ids"] == clean[1]["token_ids"]
    innocents = [(a["stats"], b["stats"]) for i, (a, b) in enumerate(zip(clean, faulted)) if i != 1]
    assert sum(b["drafted"] for _, b in innocents) > 0
    # greedy drafts are cut to what pays for the whole batch (Speculator.fit_to_batch), so
    # they follow the batch; sampled ones are left whole (their seeds must redo them)
    if drafts_independent and sampled:
        assert [(b["drafted"], b["accepted"]) for _, b in innocents] == \
            [(a["drafted"], a["accepted"]) for a, _ in innocents]
