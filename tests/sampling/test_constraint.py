"""Structured-output constraints (specbuild.sampling.constraint) on the tiny byte-level tokenizer:
request parsing and limits, decoding under the mask always yields text that parses and
validates, masks along a draft equal the masks of decoding it token by token (and leave the
matcher where it was), and the tokens a grammar forces."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from tiny import byte_level_tokenizer_json

from specbuild.errors import RequestError
from specbuild.sampling.constraint import MAX_SPEC_CHARS, GrammarBackend, ResponseFormat, mask_logits

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]},
                                           "tag": {"type": "string", "enum": ["red", "green"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
FMT = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def tok_json() -> str:
    return byte_level_tokenizer_json()


@pytest.fixture(scope="module")
def backend(tok_json) -> GrammarBackend:
    eos = Tokenizer.from_str(tok_json).token_to_id("<|im_end|>")
    return GrammarBackend(tok_json, vocab_size=320, stop_token_ids=[eos])


def test_parse_and_limits():
    assert ResponseFormat.parse(None) is None and ResponseFormat.parse({"type": "text"}) is None
    assert ResponseFormat.parse({"type": "json_object"}).kind == "json_object"
    fmt = ResponseFormat.parse(FMT)
    assert fmt.kind == "json_schema" and json.loads(fmt.spec) == SCHEMA and fmt.name == "t"
    assert ResponseFormat.parse({"type": "regex", "regex": "[ab]+"}).spec == "[ab]+"
    with pytest.raises(RequestError, match=r"response_format.type='xml' is not one of"):
        ResponseFormat.parse({"type": "xml"})
    with pytest.raises(RequestError, match="needs"):
        ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(RequestError, match=rf"characters; at most {MAX_SPEC_CHARS}"):
        ResponseFormat.parse({"type": "regex", "regex": "a" * (MAX_SPEC_CHARS + 1)})


def test_bad_grammar_is_a_request_error(backend):
    with pytest.raises(RequestError, match="does not compile"):
        backend.constraint(ResponseFormat.parse({"type": "grammar", "grammar": "root ::= ("}))


def decode_masked(backend, fmt, seed: int, max_tokens: int = 200) -> list[int]:
    """Greedy decoding of random logits under the constraint (a stand-in for a model)."""
    c = backend.constraint(fmt)
    gen = torch.Generator().manual_seed(seed)
    out = []
    while not c.finished and len(out) < max_tokens:
        logits = torch.randn(320, generator=gen) * 3
        t = int(mask_logits(logits, c.allowed()).argmax())
        c.advance(t)
        out.append(t)
    assert c.finished, "the grammar did not terminate"
    return out


@pytest.mark.parametrize("seed", range(8))
def test_masked_decoding_always_validates(backend, tok_json, seed):
    tok = Tokenizer.from_str(tok_json)
    ids = decode_masked(backend, ResponseFormat.parse(FMT), seed)
    text = tok.decode(ids)  # a stop token, if the grammar took one, is special: decoded as nothing
    value = json.loads(text)
    assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool)
    assert value["n"] in (1, 2, 3) and value["tag"] in ("red", "green")


def test_masks_along_a_draft_equal_stepwise_masks_and_leave_the_state(backend):
    fmt = ResponseFormat.parse(FMT)
    ids = decode_masked(backend, fmt, seed=3)
    c = backend.constraint(fmt)
    for t in ids[:5]:  # somewhere in the middle of the object
        c.advance(t)
    before = c.allowed()
    draft = ids[5:11]
    masks, valid = c.masks_along(draft)
    assert valid == len(draft) and masks.shape == (len(draft) + 1, 320)
    assert torch.equal(c.allowed(), before)  # rolled back
    step = backend.constraint(fmt)
    for t in ids[:5]:
        step.advance(t)
    for i, t in enumerate(draft):
        assert torch.equal(masks[i], step.allowed()), i
        step.advance(t)
    assert torch.equal(masks[len(draft)], step.allowed())
    # a token the grammar refuses cuts the draft there
    bad = int((~masks[2]).nonzero()[0])
    masks2, valid2 = c.masks_along(draft[:2] + [bad] + draft[3:])
    assert valid2 == 2 and not masks2[3:].any() and torch.equal(masks2[:3], masks[:3])


def test_forced_tokens_are_the_grammars_only_choice(backend, tok_json):
    tok = Tokenizer.from_str(tok_json)
    fmt = ResponseFormat.parse({"type": "regex", "regex": r"answer: (yes|no)"})
    c = backend.constraint(fmt)
    forced = c.forced(32)
    assert tok.decode(forced) == "answer: "  # the whole forced text
    for t in forced:
        assert bool(c.allowed()[t])
        c.advance(t)
    assert tok.decode(c.forced(32)) in ("", " ")  # then yes/no is a choice


def test_structured_task_set_compiles_and_the_checker_can_fail(backend):
    from specbuild.bench.structured import load_schemas, load_tasks, validates

    tasks = load_tasks("eval", per_category=1)
    assert len({t["category"] for t in tasks}) >= 6 and all(t["messages"][0]["content"] for t in tasks)
    for name, spec in load_schemas().items():  # every schema compiles for the grammar engine
        backend.constraint(ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": name,
                                                                                          "schema": spec["schema"]}}))
    schema = load_schemas()["qa"]["schema"]
    assert validates('{"answer": "Paris", "confidence": "high"}', schema) == (True, "")
    assert not validates('{"answer": "Paris"}', schema)[0]
    assert not validates('{"answer": "Paris", "confidence": "sure"}', schema)[0]
    assert not validates('{"answer": 3, "confidence": "low"}', schema)[0]
    assert not validates('{"answer": "x", "confidence": "low", "extra": 1}', schema)[0]
    assert not validates("not json", schema)[0]
