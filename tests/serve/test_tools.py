"""serve/tools.py without a server: the <tool_call> parser, the streaming parser at every
chunking, the call grammars (checked by llguidance on real token strings), and the built-in
tool template with tool turns."""

from __future__ import annotations

import json
import random

import pytest

from specbuild.engine.chat import render_chat
from specbuild.serve.tools import BUILTIN_TEMPLATE, HermesParser, StreamParser, ToolUse, call_grammar, held_prefix

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop"}}]
NAMES = {"get_weather", "noop"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_parse_calls_and_content():
    assert HermesParser.parse("just text", NAMES) == ("just text", [])
    content, calls = HermesParser.parse(CALL + "\n" + CALL.replace("Paris", "Rome"), NAMES)
    assert content is None and [json.loads(c["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    content, calls = HermesParser.parse("Let me check. " + CALL, NAMES)
    assert content == "Let me check." and calls[0]["name"] == "get_weather"
    # not a call: unknown function, broken JSON, arguments not an object -> left as text
    for bad in ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "<tool_call>{oops</tool_call>",
                '<tool_call>{"name": "noop", "arguments": 3}</tool_call>'):
        assert HermesParser.parse(bad, NAMES) == (bad, [])


@pytest.mark.parametrize("text", ["hello " + CALL + "\n" + CALL, CALL, "a < b and <tool but not a call", "x" + CALL + " tail",
                                  "<tool_call>\n{unfinished"])
def test_stream_parser_matches_the_final_parse_at_any_chunking(text):
    use = ToolUse(TOOLS, "auto", names=NAMES)
    want_content, want_calls = HermesParser.parse(text, NAMES)
    rng = random.Random(0)
    for _ in range(30):
        parser, deltas, at = StreamParser(use), [], 0
        while at < len(text):
            step = rng.randint(1, 7)
            deltas += parser.push(text[at:at + step])
            at += step
        deltas += parser.finish()
        content = "".join(d.get("content", "") for d in deltas)
        calls = accumulate(deltas)
        assert calls == want_calls
        assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]] == \
            list(range(len(calls)))
        if want_calls:  # streamed as generated: several deltas per call
            assert sum("tool_calls" in d for d in deltas) > len(want_calls)
        if want_calls:  # streamed text cannot be trimmed afterwards: equal up to the whitespace around calls
            assert (content.strip() or None) == want_content
        else:
            assert content == want_content
        assert all("<tool_call>" not in d.get("content", "") for d in deltas) or not want_calls


def accumulate(deltas: list[dict]) -> list[dict]:
    """What the openai client's stream helpers do with tool_calls deltas: per index, the first
    delta's name, every delta's arguments appended."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for t in d.get("tool_calls", []):
            slot = calls.setdefault(t["index"], {"name": "", "arguments": ""})
            slot["name"] += t["function"].get("name", "")
            slot["arguments"] += t["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def test_held_prefix():
    assert held_prefix("abc <tool", "<tool_call>") == 5 and held_prefix("abc", "<tool_call>") == 0
    assert held_prefix("<", "<tool_call>") == 1


def test_grammars_accept_calls_and_refuse_others():
    llg = pytest.importorskip("llguidance")
    from tiny import byte_level_tokenizer_json

    tok = llg.LLTokenizer(byte_level_tokenizer_json(), n_vocab=320)

    def accepts(grammar: str, text: str) -> bool:
        m = llg.LLMatcher(tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        ok = all(m.consume_token(t) for t in tok.tokenize_str(text))
        return ok and m.is_accepting()

    required = call_grammar(TOOLS, "required", parallel=True)
    assert accepts(required, CALL) and accepts(required, CALL + "\n" + CALL)
    assert not accepts(required, "sure! " + CALL)
    assert not accepts(required, CALL.replace('"Paris"', "42"))  # the argument schema holds
    assert not accepts(call_grammar(TOOLS, "required", parallel=False), CALL + "\n" + CALL)
    named = call_grammar(TOOLS, "noop", parallel=True)
    assert accepts(named, '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert not accepts(named, CALL)
    auto = call_grammar(TOOLS, "auto", parallel=True)
    assert accepts(auto, "no call at all") and accepts(auto, "first " + CALL + " then text")
    assert not accepts(auto, "text <tool_call>\n{\"name\": \"rm\"")  # a call that starts must be valid


def test_builtin_template_renders_tools_and_tool_turns():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    text = render_chat(BUILTIN_TEMPLATE, messages, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nbe brief\n\nYou are a function calling AI model.")
    assert json.dumps(TOOLS[0]["function"]) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
           '<|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = render_chat(BUILTIN_TEMPLATE, messages[1:2])
    assert plain == "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n"


def test_a_repeated_call_ends_the_output():
    """CallsConstraint (what tools.py asks the engine for): consuming a call identical to an
    earlier one ends the output at its closing tag; a different call does not; and the parser
    drops the repeat, so the answer is the distinct calls."""
    pytest.importorskip("llguidance")
    from tiny import byte_level_tokenizer_json
    from tokenizers import Tokenizer

    from specbuild.sampling.constraint import CallsConstraint, GrammarBackend, ResponseFormat
    from specbuild.serve.tools import parse_tool_use

    tok_json = byte_level_tokenizer_json()
    tok = Tokenizer.from_str(tok_json)
    backend = GrammarBackend(tok_json, vocab_size=320, stop_token_ids=[tok.token_to_id("<|im_end|>")])

    class Body:  # the fields of a ChatRequest parse_tool_use reads
        functions = function_call = None
        tools = [type("T", (), {"model_dump": lambda self, t=t, **kw: t})() for t in TOOLS]
        tool_choice, parallel_tool_calls = "required", None

    use = parse_tool_use(Body(), None)
    assert isinstance(use.response_format, ResponseFormat) and use.response_format.calls == ("<tool_call>",
                                                                                             "</tool_call>")
    other = CALL.replace("Paris", "Rome")

    def run(text: str) -> tuple[bool, int]:
        c = backend.constraint(use.response_format)
        assert isinstance(c, CallsConstraint)
        ids = tok.encode(text).ids
        for i, t in enumerate(ids):
            assert bool(c.allowed()[t]), (text, i)
            c.advance(t)
            if c.finished:
                return True, i + 1
        return False, len(ids)

    assert run(CALL) == (False, len(tok.encode(CALL).ids))  # one call: the grammar goes on (newline or end)
    assert run(CALL + "\n" + other)[0] is False  # two different calls
    stopped, at = run(CALL + "\n" + CALL)
    assert stopped and at == len(tok.encode(CALL + "\n" + CALL).ids)  # at the repeat's closing tag
    assert run(CALL + "\n" + other + "\n" + CALL)[0]  # a repeat of any earlier call
    # without `calls` the same grammar does not stop there (the old behaviour: repeats until max_tokens)
    import dataclasses

    plain = backend.constraint(dataclasses.replace(use.response_format, calls=None))
    for t in tok.encode(CALL + "\n" + CALL).ids:
        plain.advance(t)
    assert not plain.finished
    content, calls = HermesParser.parse(CALL + "\n" + other + "\n" + CALL, NAMES)
    assert content is None and [json.loads(c["arguments"])["city"] for c in calls] == ["Paris", "Rome"]


def test_required_answers_hold_calls_only_even_when_cut():
    """Under required / named, text outside complete calls is a call max_tokens cut: not
    content, not a call (streamed and whole alike); under auto it stays text."""
    cut = CALL + "\n" + CALL.replace("Paris", "Rome")[:30]
    required = ToolUse(TOOLS, "required", names=NAMES)

    class Seq:
        text, output_ids, finish_reason = cut, [], "length"

    class Call_:
        return_token_ids = False

    whole = required.final_choice(Call_(), Seq(), 0, None)
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == [{"city": "Paris"}]
    parser = StreamParser(required)
    deltas = parser.push(cut) + parser.finish()
    assert [d for d in deltas if "content" in d] == [] and len(parser.calls) == 1
    auto = StreamParser(ToolUse(TOOLS, "auto", names=NAMES))
    deltas = auto.push(cut) + auto.finish()
    assert "".join(d.get("content", "") for d in deltas) == cut[len(CALL) + 1:]
    # a repeated call is not streamed twice
    for step in (1, 3, 200):  # a repeat is held back while it could still be one, then dropped
        rep, deltas = StreamParser(required), []
        text = CALL + "\n" + CALL
        for at in range(0, len(text), step):
            deltas += rep.push(text[at:at + step])
        deltas += rep.finish()
        assert accumulate(deltas) == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
        assert {d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d} == {0}
    # a call that starts like an earlier one is sent once it differs
    rep, deltas = StreamParser(required), []
    text = CALL + "\n" + CALL.replace("Paris", "Pari")
    for ch in text:
        deltas += rep.push(ch)
    assert [c["arguments"] for c in accumulate(deltas + rep.finish())] == ['{"city": "Paris"}', '{"city": "Pari"}']
