"""What client libraries send by default, over a real socket (`specbuild serve` in a
subprocess, the openai client): the field policy (unknown fields ignored, logged and listed
in a header; --strict-fields refuses them; OpenAI no-op fields; vLLM extras), usage once at
the end of a stream, completions with a list of prompts, max_tokens 0 with echo, model-name
aliases, and tool calling (tools, tool_choice, legacy functions, tool turns, streamed deltas)
with and without speculation."""

from __future__ import annotations

import json

import pytest
from http_client import ServerProcess, get, post, stream
from tiny import draft_pair_bundle

from specbuild.bench.structured import validates
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5]
PARAMS = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]},
                                          "days": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "the weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "what is the weather"}]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return draft_pair_bundle(tmp_path_factory.mktemp("clients"), noise=0.05, max_seq_len=2048, max_batch_size=8)


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    srv = ServerProcess(bundle, str(tmp_path_factory.mktemp("logs") / "clients.log"), "--max-batch-size", "4",
                        "--log-level", "info")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine(bundle):
    return Engine(bundle, EngineConfig(threads=1))


def engine_ids(engine, prompt_ids, max_tokens, **kw) -> list[int]:
    req = Request(prompt_ids=prompt_ids, speculation=SpeculationConfig.make(None, method="none"),
                  sampling=SamplingParams(max_tokens=max_tokens, **kw))
    return engine.generate([req])[0]["token_ids"]


# ---- field policy -------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_logged_and_listed(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "frobnicate": {"x": 1}, "zeta": 2,
            "store": True, "metadata": {"k": "v"}, "user": "u1", "service_tier": "auto"}
    status, headers, out = post(server.port, "/v1/completions", body)
    assert status == 200, out
    assert headers["x-specbuild-ignored-fields"] == "frobnicate,zeta"  # no-op OpenAI fields are known
    assert "ignored unknown field(s) frobnicate, zeta" in server.output()
    status, headers, out = post(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi", "weird": 1}], "max_tokens": 2})
    assert status == 200 and headers["x-specbuild-ignored-fields"] == "messages[0].weird", out
    status, headers, out = post(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and headers.get("x-specbuild-ignored-fields") is None
    # sizes stay bounded: a known field out of range is still a 400 naming it
    status, _, out = post(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "min_tokens": -1})
    assert status == 400 and out["error"]["param"] == "min_tokens"
    # rejected requests are in the log at info level, with their reason
    assert "rejected (400)" in server.output() and "min_tokens" in server.output()


def test_strict_fields_refuses_unknown(bundle, tmp_path):
    srv = ServerProcess(bundle, str(tmp_path / "strict.log"), "--strict-fields")
    try:
        status, _, out = post(srv.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "frobnicate": 1})
        assert status == 400 and out["error"]["param"] == "frobnicate" and "unknown field" in out["error"]["message"]
        status, _, out = post(srv.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "store": False})
        assert status == 200, out
    finally:
        srv.stop()


def test_neutral_only_extras(server):
    ok = {"prompt": PROMPT, "max_tokens": 2, "repetition_penalty": 1.0, "min_p": 0.0, "skip_special_tokens": True,
          "use_beam_search": False}
    assert post(server.port, "/v1/completions", ok)[0] == 200
    status, _, out = post(server.port, "/v1/completions", {**ok, "min_p": 0.3})
    assert status == 400 and out["error"]["param"] == "min_p" and "0.3" in out["error"]["message"]
    status, _, out = post(server.port, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "echo": True})
    assert status == 400 and out["error"]["param"] == "echo"


def test_min_tokens_and_stop_token_ids(server, engine):
    free = engine_ids(engine, PROMPT, 40)
    stop_at = free[3]
    body = {"prompt": PROMPT, "max_tokens": 40, "return_token_ids": True, "stop_token_ids": [stop_at]}
    status, _, out = post(server.port, "/v1/completions", body)
    assert status == 200 and out["choices"][0]["token_ids"][-1] == stop_at, out
    assert len(out["choices"][0]["token_ids"]) <= 4
    status, _, out = post(server.port, "/v1/completions", {**body, "min_tokens": 10, "speculation": "draft"})
    ids = out["choices"][0]["token_ids"]
    assert status == 200 and len(ids) >= 10 and stop_at not in ids[:9], ids
    ref = engine_ids(engine, PROMPT, 40, stop_token_ids=(stop_at,), min_tokens=10,
                     min_tokens_ids=tuple(engine.eos_ids) + (stop_at,))
    assert ids == ref  # min_tokens is lossless under speculation


def test_repetition_penalty(server, engine):
    """vLLM's repetition_penalty: over the prompt's tokens and the output's, the same tokens
    with and without speculation, and the engine's with the prompt's ids (chat: the rendered
    prompt's; completions text: the engine's encoding)."""
    free = engine_ids(engine, PROMPT, 30, ignore_eos=True)
    ref = engine_ids(engine, PROMPT, 30, ignore_eos=True, repetition_penalty=1.3, repetition_ids=tuple(PROMPT))
    assert ref != free
    for method in ("none", "draft"):
        status, _, out = post(server.port, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 30, "ignore_eos": True, "return_token_ids": True,
            "repetition_penalty": 1.3, "speculation": method})
        assert status == 200 and out["choices"][0]["token_ids"] == ref, out
        if method == "draft":
            assert out["usage"]["drafted_tokens"] > 0 and out["usage"]["accepted_tokens"] > 0
    text = engine.tokenizer.decode(PROMPT)
    status, _, out = post(server.port, "/v1/completions", {"prompt": text, "max_tokens": 30, "ignore_eos": True,
                                                           "return_token_ids": True, "repetition_penalty": 1.3})
    ids = engine.encode(text)
    assert out["choices"][0]["token_ids"] == engine_ids(engine, ids, 30, ignore_eos=True, repetition_penalty=1.3,
                                                        repetition_ids=tuple(ids))
    status, _, out = post(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "repetition_penalty": 0})
    assert status == 400 and out["error"]["param"] == "repetition_penalty"


def test_skip_special_tokens_false_keeps_them(server, engine):
    """skip_special_tokens false: special tokens the model generates stay in the text (whole
    and streamed alike), the end-of-sequence token that ends the answer does not (vLLM's);
    spaces_between_special_tokens is accepted (no effect with a fast tokenizer)."""
    tok = engine.tokenizer
    special = tok.token_to_id("<|im_start|>")
    eos = int(engine.eos_ids[0])
    assert special not in engine.eos_ids
    body = {"prompt": PROMPT, "max_tokens": 4, "logit_bias": {str(special): 100}, "return_token_ids": True}
    status, _, kept = post(server.port, "/v1/completions", {**body, "skip_special_tokens": False,
                                                            "spaces_between_special_tokens": False})
    status2, _, skipped = post(server.port, "/v1/completions", body)
    assert status == status2 == 200 and kept["choices"][0]["token_ids"] == [special] * 4
    assert kept["choices"][0]["text"] == "<|im_start|>" * 4 and skipped["choices"][0]["text"] == ""
    chunks = stream(server.port, "/v1/completions", {**body, "skip_special_tokens": False, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == "<|im_start|>" * 4
    # the end-of-sequence token that ends the answer is not text; one generated before it is
    ended = {"prompt": PROMPT, "max_tokens": 4, "logit_bias": {str(eos): 100}, "skip_special_tokens": False}
    status, _, out = post(server.port, "/v1/completions", ended)
    assert status == 200 and out["choices"][0]["text"] == "" and out["choices"][0]["finish_reason"] == "stop"
    status, _, out = post(server.port, "/v1/completions", {**ended, "ignore_eos": True})
    assert out["choices"][0]["text"] == tok.decode([eos], skip_special_tokens=False) * 4
    chat = post(server.port, "/v1/chat/completions", {"messages": USER, "max_tokens": 3, "skip_special_tokens": False,
                                                      "logit_bias": {str(special): 100}})[2]
    assert chat["choices"][0]["message"]["content"] == "<|im_start|>" * 3
    status, _, err = post(server.port, "/v1/completions", {**body, "skip_special_tokens": False, "stop": ["x"]})
    assert status == 400 and err["error"]["param"] == "skip_special_tokens" and "stop" in err["error"]["message"]


@pytest.mark.parametrize("field, value, check", [
    ("guided_choice", ["yes!", "no!"], lambda t: t in ("yes!", "no!")),
    ("guided_regex", "[ab]{3}!", lambda t: len(t) == 4 and set(t[:3]) <= {"a", "b"} and t[3] == "!"),
    ("guided_json", PARAMS, lambda t: validates(t, PARAMS) == (True, "")),
    ("guided_grammar", 'root ::= "x" [0-9] "y"', lambda t: len(t) == 3 and t[0] == "x" and t[2] == "y"),
])
def test_guided_fields_map_to_response_format(server, field, value, check):
    status, _, out = post(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 300, field: value,
                                                           "speculation": "draft"})
    assert status == 200, out
    assert check(out["choices"][0]["text"]), out["choices"][0]["text"]
    status, _, out = post(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, field: value,
                                                           "response_format": {"type": "json_object"}})
    assert status == 400 and out["error"]["param"] == "response_format", out


def test_chat_template_kwargs_reach_the_template(server):
    status, _, out = post(server.port, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 2, "chat_template_kwargs": {"tools": []}})
    assert status == 400 and "tools" in out["error"]["message"]
    status, _, out = post(server.port, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, out


# ---- usage once ---------------------------------------------------------------------------------
def test_stream_usage_only_when_asked_and_once(server):
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "n": 2}
    chunks = stream(server.port, "/v1/completions", body)
    assert not any("usage" in c for c in chunks), chunks[-1]
    chunks = stream(server.port, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    with_usage = [c for c in chunks if c.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["usage"]["prompt_tokens"] == len(PROMPT)
    chunks = stream(server.port, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 5, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert all("usage" in c for c in chunks) and counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


# ---- prompt lists -------------------------------------------------------------------------------
def test_completions_prompt_list(client, engine):
    prompts = [PROMPT, [9, 10, 11, 12], PROMPT[:4]]
    out = client.completions.create(model="bundle", prompt=prompts, max_tokens=5, n=2, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, "speculation": "draft"})
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        assert c.model_extra["token_ids"] == engine_ids(engine, prompts[c.index // 2], 5, ignore_eos=True)
    assert out.usage.prompt_tokens == sum(map(len, prompts)) and out.usage.completion_tokens == 30
    texts = client.completions.create(model="bundle", prompt=["ab", "cd"], max_tokens=3, extra_body={"ignore_eos": True})
    assert len(texts.choices) == 2 and texts.choices[0].text != "" and texts.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        client.completions.create(model="bundle", prompt=["x"] * 33, max_tokens=1, n=2)


def test_max_tokens_zero_with_echo_scores_the_prompt(server, client):
    out = client.completions.create(model="bundle", prompt=[PROMPT, PROMPT[:5]], max_tokens=0, echo=True, logprobs=1)
    assert [len(c.logprobs.token_logprobs) for c in out.choices] == [len(PROMPT), 5]
    assert out.choices[0].logprobs.token_logprobs[0] is None and out.usage.completion_tokens == 0
    with_answer = client.completions.create(model="bundle", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1)
    assert with_answer.choices[0].logprobs.token_logprobs[:len(PROMPT)] == out.choices[0].logprobs.token_logprobs
    status, _, err = post(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and err["error"]["param"] == "max_tokens"


# ---- tools ------------------------------------------------------------------------------------------
def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ping"}}])
def test_tool_choice_required_and_named_validate(client, choice):
    answers = {}
    for method in ("none", "draft", "ngram"):
        out = client.chat.completions.create(model="bundle", messages=USER, tools=TOOLS, tool_choice=choice,
                                             max_tokens=800, temperature=0,
                                             extra_body={"speculation": method, "return_token_ids": True})
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        calls = calls_of(c.message)
        assert calls and all(validates(json.dumps(args), SCHEMAS[name]) == (True, "") for name, args in calls)
        if isinstance(choice, dict):
            assert {name for name, _ in calls} == {"ping"}
        assert all(t.id.startswith("call_") and t.type == "function" for t in c.message.tool_calls)
        answers[method] = c.model_extra["token_ids"]
        if method != "none":  # speculation ran: the grammar's forced tokens are drafts too
            assert out.usage.model_extra["drafted_tokens"] > 0 and out.usage.model_extra["accepted_tokens"] > 0
    assert answers["none"] == answers["draft"] == answers["ngram"]  # greedy: lossless


def test_parallel_tool_calls_false_gives_one_call(client):
    out = client.chat.completions.create(model="bundle", messages=USER, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=800)
    assert len(out.choices[0].message.tool_calls) == 1


def test_tool_choice_none_and_empty_tools(client, server):
    plain = client.chat.completions.create(model="bundle", messages=USER, max_tokens=8, extra_body={"ignore_eos": True})
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {"tools": [], "tool_choice": "none"}, {"tools": []}):
        out = client.chat.completions.create(model="bundle", messages=USER, max_tokens=8,
                                             extra_body={"ignore_eos": True}, **kw)
        assert out.choices[0].message.content == plain.choices[0].message.content and not out.choices[0].message.tool_calls
    status, _, err = post(server.port, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "max_tokens": 4,
                                                                "tool_choice": {"type": "function",
                                                                                "function": {"name": "nope"}}})
    assert status == 400 and err["error"]["param"] == "tool_choice" and "nope" in err["error"]["message"]
    status, _, err = post(server.port, "/v1/chat/completions", {"messages": USER, "tool_choice": "required",
                                                                "max_tokens": 4})
    assert status == 400 and err["error"]["param"] == "tool_choice"


def test_tool_auto_is_text_or_valid_calls(client):
    out = client.chat.completions.create(model="bundle", messages=USER, tools=TOOLS, max_tokens=40,
                                         extra_body={"speculation": "draft"})
    c = out.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert all(validates(json.dumps(a), SCHEMAS[n]) == (True, "") for n, a in calls_of(c.message))


def test_tool_calls_stream_as_deltas_the_client_accumulates(client):
    kw = dict(model="bundle", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=800)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    calls: dict[int, dict] = {}
    finish, pieces = None, 0
    for chunk in chunks:
        for ch in chunk.choices:
            assert not ch.delta.content  # only calls: no content deltas
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = slot["id"] or d.id
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
                pieces += bool(d.function.arguments)
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and chunks[-1].usage.completion_tokens > 0
    # the arguments streamed as they were generated (several pieces per call), reassembled exactly
    assert pieces > 2 * len(calls)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())
    # the openai library's own accumulator reads the same deltas
    with client.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    assert calls_of(final.choices[0].message) == calls_of(whole.message)


def test_legacy_functions(client):
    out = client.chat.completions.create(model="bundle", messages=USER, max_tokens=800,
                                         functions=[t["function"] for t in TOOLS], function_call={"name": "forecast"})
    c = out.choices[0]
    assert c.finish_reason == "function_call" and c.message.function_call.name == "forecast"
    assert validates(c.message.function_call.arguments, PARAMS) == (True, "")
    # streamed: function_call deltas, the name first, the arguments in pieces
    name, args, pieces, finish = "", "", 0, None
    for chunk in client.chat.completions.create(model="bundle", messages=USER, max_tokens=800, stream=True,
                                                functions=[t["function"] for t in TOOLS],
                                                function_call={"name": "forecast"}):
        for ch in chunk.choices:
            if ch.delta.function_call is not None:
                name += ch.delta.function_call.name or ""
                args += ch.delta.function_call.arguments or ""
                pieces += bool(ch.delta.function_call.arguments)
            finish = ch.finish_reason or finish
    assert (name, args, finish) == ("forecast", c.message.function_call.arguments, "function_call") and pieces > 2


def test_tool_turns_render_back(client, server):
    first = client.chat.completions.create(model="bundle", messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=800)
    message = first.choices[0].message
    history = USER + [message.model_dump()] + [
        {"role": "tool", "tool_call_id": t.id, "name": t.function.name, "content": "sunny"} for t in message.tool_calls]
    history.append({"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "tomorrow?"}]})
    out = client.chat.completions.create(model="bundle", messages=history, tools=TOOLS, max_tokens=5)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    status, _, err = post(server.port, "/v1/chat/completions", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert status == 400 and "messages[0].content[1]" in err["error"]["message"] and "image_url" in err["error"]["message"]


def test_model_name_aliases(server):
    status, text = get(server.port, "/v1/models")
    ids = [m["id"] for m in json.loads(text)["data"]]
    assert ids[0] == "bundle" and ids[1] == "target"  # the directory's name, then the checkpoint's
    status, _, out = post(server.port, "/v1/completions", {"model": "target", "prompt": PROMPT, "max_tokens": 1})
    assert status == 200, out


# ---- tokenizer endpoints (vLLM's shapes) ---------------------------------------------------------
def test_tokenize_detokenize_and_tokenizer_info(server, engine):
    for prefix in ("", "/v1"):
        status, _, out = post(server.port, f"{prefix}/tokenize", {"prompt": "hello there", "return_token_strs": True})
        assert status == 200, out
        assert out["tokens"] == engine.encode("hello there") and out["count"] == len(out["tokens"])
        assert out["max_model_len"] == engine.max_seq_len and len(out["token_strs"]) == out["count"]
        status, _, back = post(server.port, f"{prefix}/detokenize", {"tokens": out["tokens"]})
        assert status == 200 and back["prompt"] == engine.tokenizer.decode(out["tokens"], skip_special_tokens=False)
    status, _, chat = post(server.port, "/tokenize", {"messages": USER})
    full = post(server.port, "/v1/chat/completions", {"messages": USER, "max_tokens": 1})[2]
    assert status == 200 and chat["count"] == full["usage"]["prompt_tokens"]  # the prompt the chat endpoint builds
    status, _, err = post(server.port, "/detokenize", {"tokens": [10 ** 6]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, text = get(server.port, "/tokenizer_info")
    info = json.loads(text)
    assert status == 200 and info["model_max_length"] == engine.max_seq_len and "eos_token" in info


def test_chat_template_option(bundle, engine, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                        "{% if tools %}<tools>{{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    srv = ServerProcess(bundle, str(tmp_path / "tpl.log"), "--chat-template", str(template))
    try:
        status, _, out = post(srv.port, "/tokenize", {"messages": USER, "tools": TOOLS})
        want = engine.encode("[user]what is the weather<tools>forecast,ping[assistant]", add_special_tokens=False)
        assert status == 200 and out["tokens"] == want, out  # the file's template, tools through it
        status, _, full = post(srv.port, "/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                                  "add_generation_prompt": False})
        assert status == 200 and full["usage"]["prompt_tokens"] == len(
            engine.encode("[user]what is the weather", add_special_tokens=False))
    finally:
        srv.stop()
    template.write_text("{% for m in messages %}")  # does not parse: refused at start-up, not per request
    with pytest.raises(AssertionError, match="chat template does not parse"):
        ServerProcess(bundle, str(tmp_path / "bad.log"), "--chat-template", str(template))
