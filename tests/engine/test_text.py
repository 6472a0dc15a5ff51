"""Incremental detokenisation (never half a UTF-8 character) and stop strings (held back,
cut exactly where they begin)."""

from __future__ import annotations

import random

import pytest
from tiny import byte_level_tokenizer_json
from tokenizers import Tokenizer, decoders, models

from specbuild.engine.text import REPLACEMENT, IncrementalDetokenizer, StopStringFilter

MULTIBYTE = "the héllo 世界 🎉 naïve — 𝔘𝔫𝔦 😀👍🏽 ok"


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer.from_str(byte_level_tokenizer_json())


def stream(tokenizer, ids: list[int], group_sizes=None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces, i = [], 0
    sizes = iter(group_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        pieces.append(detok.push(ids[i:i + n]))
        i += n
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


def test_byte_tokens_split_multibyte_characters(byte_tok):
    """Precondition of the tests below: the tokenizer really splits characters into bytes."""
    enc = byte_tok.encode("世🎉")
    assert len(enc.ids) == 7  # 3 + 4 bytes, one token each
    assert byte_tok.decode(enc.ids[:2]).endswith(REPLACEMENT)


def test_never_emits_half_a_character(byte_tok):
    ids = byte_tok.encode(MULTIBYTE).ids
    pieces = stream(byte_tok, ids)
    for p in pieces:
        assert REPLACEMENT not in p
    assert "".join(pieces) == byte_tok.decode(ids) == MULTIBYTE
    # text waited while a character was incomplete: fewer non-empty pieces than tokens
    assert sum(1 for p in pieces if p) < len(ids)
    # each prefix of the stream is a prefix of the final text
    acc = ""
    for p in pieces:
        acc += p
        assert MULTIBYTE.startswith(acc)


def test_any_grouping_of_pushes_gives_the_same_text(byte_tok):
    rng = random.Random(0)
    ids = byte_tok.encode(MULTIBYTE * 2).ids
    for _ in range(20):
        sizes = [rng.randint(1, 5) for _ in range(len(ids))]
        pieces = stream(byte_tok, ids, sizes)
        assert "".join(pieces) == MULTIBYTE * 2
        assert all(REPLACEMENT not in p for p in pieces)


def test_special_tokens_are_skipped(byte_tok):
    ids = byte_tok.encode("ab<|im_end|>cd").ids
    assert 2 in ids  # <|im_end|>
    assert "".join(stream(byte_tok, ids)) == "abcd"


def test_flush_releases_an_incomplete_tail(byte_tok):
    ids = byte_tok.encode("a🎉").ids  # 1 + 4 byte tokens
    detok = IncrementalDetokenizer(byte_tok)
    assert detok.push(ids[:3]) == "a"  # 'a' and half an emoji: only 'a'
    assert detok.flush() == REPLACEMENT  # the end: the broken character shows as U+FFFD
    assert detok.flush() == ""


def test_leading_space_markers_decode_in_context():
    """A SentencePiece-style decoder drops the leading space of the first piece; decoding
    each token alone would lose the spaces between words."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁again": 3, "!": 4}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    assert tok.decode([2]) == "world"  # alone: no space
    pieces = stream(tok, [1, 2, 4, 3])
    assert pieces[:4] == ["hello", " world", "!", " again"]
    assert "".join(pieces) == tok.decode([1, 2, 4, 3]) == "hello world! again"


# ---- stop strings -----------------------------------------------------------------------

def feed(filt: StopStringFilter, chunks: list[str]) -> list[str]:
    return [filt.push(c) for c in chunks]


def test_no_stops_passes_everything_through():
    f = StopStringFilter(())
    assert feed(f, ["a<", "/s>"]) == ["a<", "/s>"] and f.flush() == "" and not f.stopped


def test_prefix_is_held_back_then_released():
    f = StopStringFilter(("</s>",))
    assert f.push("abc<") == "abc"
    assert f.push("/") == ""  # "</" may still become "</s>"
    assert f.push("x") == "</x"  # it did not
    assert f.push("tail <") == "tail "
    assert f.flush() == "<"  # the end: held text is released
    assert not f.stopped


def test_cut_exactly_where_the_stop_begins_across_pushes():
    f = StopStringFilter(("STOP",))
    out = feed(f, ["hello S", "T", "O", "P and more"])
    assert "".join(out) == "hello "
    assert f.stopped
    assert f.push("later text") == "" and f.flush() == ""


def test_earliest_of_several_stops_wins():
    f = StopStringFilter(("abc", "bd"))
    assert f.push("xab") == "x"  # "ab" could begin "abc", "b" could begin "bd"
    assert f.push("d") == "a"  # "bd" found at the held "b"
    assert f.stopped
    f = StopStringFilter(("zz", "xbd", "abc"))
    assert f.push("qxbdabc") == "q"


def test_stop_inside_one_push_and_at_start():
    f = StopStringFilter(("\n\n",))
    assert f.push("line\n\nnext") == "line" and f.stopped
    f = StopStringFilter(("<end>",))
    assert f.push("<end>") == "" and f.stopped


@pytest.mark.parametrize("seed", range(5))
def test_filter_matches_a_one_shot_cut(seed):
    """Random text split at random points: the emitted text equals cutting the whole
    text at the first stop, and nothing past that point ever leaks."""
    rng = random.Random(seed)
    alphabet = "ab<>/ "
    stops = ("</a>", "bb<", "a a")
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        f = StopStringFilter(stops)
        out = "".join(feed(f, chunks)) + f.flush()
        first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        assert out == (text[:first] if first >= 0 else text)
        assert f.stopped == (first >= 0)
