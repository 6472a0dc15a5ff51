"""Adding a drafter is one module and one registry line: the module below is written to disk
as a user would write it, registered with proposers.registry.register (the line
proposers/registry.py holds for each built-in drafter), and served by an unchanged engine:
greedy output equals plain decoding, its drafts are proposed and some accepted, the logits
it declared it reads reach it, and its own per-sequence state is freed."""

from __future__ import annotations

import sys
import textwrap

import pytest

from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.errors import RequestError
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.proposers import registry

TOY = textwrap.dedent('''
    """A toy drafter: the target's last top token after each token, walked as a chain."""
    from specbuild.speculation.proposers.base import Draft, DrafterBase, Needs


    class BigramProposer(DrafterBase):
        name = "toy_bigram"
        needs = Needs(logits=True)

        def __init__(self):
            self.next_of = {}  # token -> the target's top token after it (shared by all requests)
            self.passes = {}  # seq_id -> passes observed (its own per-sequence state)
            self.proposed = 0

        def propose(self, seqs, gammas):
            out = []
            for seq, gamma in zip(seqs, gammas):
                tokens, tok = [], seq.all_ids[-1]
                while len(tokens) < gamma and tok in self.next_of:
                    tok = self.next_of[tok]
                    tokens.append(tok)
                self.proposed += len(tokens)
                out.append(Draft(tokens, method=self.name) if tokens else None)
            return out

        def observe(self, seq, obs):
            for tok, row in zip(obs.tokens, obs.logits):
                self.next_of[tok] = int(row.argmax())
            self.passes[seq.seq_id] = self.passes.get(seq.seq_id, 0) + 1

        def release(self, seq):
            self.passes.pop(seq.seq_id, None)


    def build(ctx):
        return BigramProposer()
''')

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21, 22, 20, 21], list(range(30, 60))]


@pytest.fixture
def toy_drafter(tmp_path, monkeypatch):
    (tmp_path / "toy_bigram.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register("toy_bigram", "toy_bigram")
    yield "toy_bigram"
    registry.unregister("toy_bigram")
    sys.modules.pop("toy_bigram", None)


def run(engine, method):
    spec = SpeculationConfig.make(None, method=method, gamma=4)
    return engine.generate([Request(prompt_ids=p, speculation=spec,
                                    sampling=SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS])


def test_a_drafter_added_as_one_module_is_served_losslessly(tiny_bundle, toy_drafter):
    engine = Engine(tiny_bundle, EngineConfig(max_batch_size=4))
    assert toy_drafter in engine.methods
    toy = engine.speculator.proposers[toy_drafter]
    plain = run(engine, "none")
    for _ in range(2):  # the second round starts from the first round's table
        spec = run(engine, toy_drafter)
        for s, p in zip(spec, plain):
            assert s["token_ids"] == p["token_ids"]
    assert toy.proposed > 0 and sum(r["stats"]["drafted"] for r in spec) > 0
    assert sum(r["stats"]["accepted"] for r in spec) > 0
    assert toy.next_of and toy.passes == {}  # it learned from the logits; its state was freed
    assert engine.cache.used_blocks == 0


def test_an_unregistered_drafter_is_refused_by_name(tiny_bundle):
    with pytest.raises(RequestError, match="toy_bigram"):
        SpeculationConfig.make(None, method="toy_bigram")
    with pytest.raises(ValueError, match="'auto'"):
        registry.register("auto", "x")
