"""Prompt lookup (speculation/proposers/ngram.py): the drafter's indexed lookup gives what the
definition (`lookup`, a scan of the whole text with every n) gives, step by step as a text
grows, for every n-gram range a request may ask; and its per-sequence index is freed."""

from __future__ import annotations

import numpy as np
import pytest

from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.proposers.ngram import NgramProposer, lookup


class Seq:
    def __init__(self, seq_id, prompt, n_min, n_max):
        self.seq_id, self.prompt_ids, self.output_ids = seq_id, list(prompt), []
        self.spec = SpeculationConfig.make(None, method="ngram", ngram_min=n_min, ngram_max=n_max)

    @property
    def all_ids(self):
        return self.prompt_ids + self.output_ids


@pytest.mark.parametrize("n_min,n_max", [(1, 3), (2, 2), (1, 8), (3, 5), (4, 8)])
def test_indexed_lookup_equals_the_definition_as_the_text_grows(n_min, n_max):
    rng = np.random.default_rng(n_min * 10 + n_max)
    prop = NgramProposer()
    drafted = compared = 0
    for s in range(12):
        vocab = int(rng.integers(2, 30))
        prompt = rng.integers(0, vocab, int(rng.integers(1, 80))).tolist()
        if s % 2:  # a text that repeats itself: long matches, many hits (the numpy compare)
            prompt = (prompt * 30)[:400]
        seq = Seq(s, prompt, n_min, n_max)
        for _ in range(60):
            gamma = int(rng.integers(1, 9))
            got = prop.propose([seq], [gamma])[0]
            want = lookup(np.asarray(seq.all_ids, dtype=np.int64), n_min, n_max, gamma)
            assert (list(got.tokens) if got is not None else []) == want, (s, len(seq.all_ids))
            compared += 1
            drafted += bool(want)
            # the text grows by what the target would have kept: the draft's head or other tokens
            grow = want[:int(rng.integers(0, len(want) + 1))] if want and rng.random() < 0.6 else []
            seq.output_ids += grow + rng.integers(0, vocab, 1).tolist()
        prop.release(seq)
    assert compared == 720 and drafted > 50 and not prop.local


def test_nothing_drafted_without_an_earlier_occurrence_or_room():
    prop = NgramProposer()
    seq = Seq(0, [1, 2, 3, 4], 1, 3)
    assert prop.propose([seq], [4]) == [None]  # no token occurs twice
    seq.output_ids = [2]
    assert prop.propose([seq], [0]) == [None]  # gamma 0: plain step
    assert list(prop.propose([seq], [4])[0].tokens) == [3, 4, 2]  # "2" occurred, followed by 3 4 2
