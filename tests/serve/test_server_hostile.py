"""The HTTP server against a hostile client, over real loopback sockets: `specbuild serve` in
a subprocess on a tiny bundle with every drafter (draft model, Medusa heads, n-grams).

Property-based bodies (hypothesis) built from the request schema's field names: every
answer 2xx/4xx, never 5xx, the server alive and its KV pool whole after. Files never read
on a client's word (tree), OpenAI's chat roles only, a limit with a 4xx naming the field on
everything a client controls, slow clients that block no one, and a CI-sized run of
scripts/soak_server.py. Every wait is for a state and bounded.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import sys

import pytest
from http_client import get, post, stream, wait_until

pytestmark = pytest.mark.timeout(300)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import soak_server  # noqa: E402  (scripts/soak_server.py: the bundle, the server process, the soak)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return soak_server.build_bundle(str(tmp_path_factory.mktemp("hostile")), say=lambda m: None)


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    srv = soak_server.Server(bundle, str(tmp_path_factory.mktemp("logs") / "hostile.log"),
                             extra=("--max-batch-size", "4", "--body-timeout", "1"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(bundle):
    from specbuild.engine.engine import Engine, EngineConfig

    return Engine(bundle, EngineConfig(threads=1, load_draft=False))


def greedy_ids(engine, prompt: str, max_tokens: int) -> list[int]:
    from specbuild.engine.sequence import Request
    from specbuild.sampling.params import SamplingParams

    request = Request(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      speculation={"method": "none"})
    return engine.generate([request])[0]["token_ids"]


def idle(port: int) -> bool:
    status, text = get(port, "/health")
    health = json.loads(text) if status == 200 else {}
    return status == 200 and health["running"] == 0 and health["queue_depth"] == 0 and health["kv_blocks_used"] == 0


# ---- schema ---------------------------------------------------------------------------------------
def test_openapi_schema_lists_every_field(server):
    status, text = get(server.port, "/openapi.json")
    assert status == 200
    schema = json.loads(text)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    components = schema["components"]["schemas"]
    common = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
              "user", "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "ignore_eos", "content_type",
              "return_token_ids", "speculation", "cache_salt",
              "gamma", "gamma_min", "gamma_max", "tree", "ngram_min", "ngram_max", "typical",
              # the field policy's OpenAI no-ops and vLLM extras (serve/openai_fields.py)
              "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "reasoning_effort",
              "verbosity", "request_id", "guided_decoding_backend", "min_tokens", "stop_token_ids", "guided_json",
              "guided_regex", "guided_choice", "guided_grammar", "add_special_tokens", "min_p", "repetition_penalty",
              "length_penalty", "use_beam_search", "include_stop_str_in_output", "skip_special_tokens",
              "spaces_between_special_tokens", "prompt_logprobs", "truncate_prompt_tokens",
              "guided_whitespace_pattern", "priority"}
    assert set(components["CompletionRequest"]["properties"]) == common | {"prompt", "echo", "best_of", "logprobs",
                                                                            "suffix"}
    assert set(components["ChatRequest"]["properties"]) == common | {
        "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
        "functions", "function_call", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "echo"}
    roles = components["Message"]["properties"]["role"]["enum"]
    assert roles == ["system", "developer", "user", "assistant", "tool", "function"]


# ---- the two fixes ----------------------------------------------------------------------------------
def test_a_tree_is_a_preset_or_inline_paths_never_a_file(server, engine, tmp_path):
    real = tmp_path / "tree.json"
    real.write_text(json.dumps([[0], [0, 0]]))
    answers = []
    for tree in (str(real), str(tmp_path / "missing.json"), "/etc/passwd", "../../../../etc/passwd"):
        for body in ({"prompt": "hi", "max_tokens": 4, "speculation": "medusa", "tree": tree},
                     {"prompt": "hi", "max_tokens": 4, "speculation": {"method": "medusa", "tree": tree}}):
            status, _, err = post(server.port, "/v1/completions", body)
            assert status == 400 and err["error"]["param"] in ("tree", "speculation"), err
            assert "never a file" in err["error"]["message"], err
            answers.append(re.sub(r"'[^']*'", "'PATH'", err["error"]["message"]))  # paths (cut or not) masked
    assert len(set(answers)) <= 2, answers  # the same answer whether the file exists or not: no oracle
    # inline paths and presets work, losslessly, and the heads draft and get accepted
    prompt = "word3 word10 word17 word1 word8 word15"
    expect = greedy_ids(engine, prompt, 24)
    drafted = accepted = 0
    for tree in ([[0], [0, 0], [1]], "chain_2", "mc_sim_7b_top10"):
        body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True,
                "speculation": "medusa", "tree": tree}
        status, _, full = post(server.port, "/v1/completions", body)
        assert status == 200, full
        assert full["choices"][0]["token_ids"] == expect
        drafted += full["usage"]["drafted_tokens"]
        accepted += full["usage"]["accepted_tokens"]
    assert drafted > 0 and accepted > 0


def test_chat_roles_are_openais(server):
    status, _, err = post(server.port, "/v1/chat/completions",
                          {"messages": [{"role": "wizard", "content": "abracadabra"}], "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "messages", err
    assert "wizard" in err["error"]["message"] and "'developer'" in err["error"]["message"]
    for role in ("system", "developer", "user", "assistant", "tool", "function"):
        status, _, full = post(server.port, "/v1/chat/completions",
                               {"messages": [{"role": role, "content": "hi"}, {"role": "user", "content": "go"}],
                                "max_tokens": 2})
        assert status == 200, (role, full)


LIMITS = [  # (body, param, a piece of the message: the limit)
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "16"),
    ({"stop": "x" * 257}, "stop", "256"),
    ({"stop": [""]}, "stop", "at least 1"),
    ({"tree": [[0]] + [[0, i % 16] for i in range(256)]}, "tree", "256"),
    ({"tree": [[0] * 17]}, "tree", "16"),
    ({"tree": [[16]]}, "tree", "16"),
    ({"tree": "x" * 300}, "tree", "256"),
    ({"max_tokens": (1 << 20) + 1}, "max_tokens", str(1 << 20)),
    ({"gamma": 17}, "gamma", "16"),
    ({"gamma_max": -1}, "gamma_max", "0"),
    ({"ngram_max": 9}, "ngram_max", "8"),
    ({"speculation": {"method": "ngram", "gamma": 99}}, "speculation", "16"),
    ({"prompt": [5] * 1030}, "prompt", "max_seq_len"),
    ({"prompt": [[1, 2]] * 65}, "prompt", "64 items"),
    ({"prompt": [5, -1]}, "prompt", "0"),
    ({"prompt": [1 << 40]}, "prompt", str(1 << 31)),
    ({"seed": 1 << 64}, "seed", str((1 << 63) - 1)),
    ({"top_k": 1 << 30}, "top_k", str(1 << 20)),
    ({"temperature": 1000}, "temperature", "100"),
    ({"model": "m" * 1000}, "model", "256"),
]


@pytest.mark.parametrize("extra, param, limit", LIMITS, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(LIMITS)])
def test_every_bound_has_a_limit_named_in_a_4xx(server, extra, param, limit):
    status, _, err = post(server.port, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **extra})
    assert status == 400, err
    assert err["error"]["param"] == param and limit in err["error"]["message"], err


PARAMS = [  # (body, the field `param` names, a piece of the message)
    ({"response_format": {"type": "xml"}}, "response_format", "'xml'"),
    ({"response_format": {"type": "regex", "regex": "(("}}, "response_format", "regex"),
    ({"response_format": {"type": "regex"}}, "response_format", "regex"),
    ({"typical": True, "speculation": "ngram"}, "typical", "medusa"),
    ({"speculation": {"method": "ngram", "typical": True}}, "speculation", "medusa"),
    ({"speculation": "ngram", "ngram_min": 5, "ngram_max": 2}, "ngram_min", "ngram_min <= ngram_max"),
    ({"speculation": "ngram", "ngram_max": 1, "ngram_min": 2}, "ngram_min", "ngram_min <= ngram_max"),
    ({"speculation": {"method": "ngram", "ngram_min": 6, "ngram_max": 3}}, "speculation", "ngram_min <= ngram_max"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "'abc'"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "'-1'"),
    ({"logit_bias": {"\u0665": 1}}, "logit_bias", "plain decimal digits (0-9)"),  # ARABIC-INDIC FIVE
    ({"logit_bias": {"1_000": 1}}, "logit_bias", "plain decimal digits (0-9)"),
    ({"logit_bias": {" 5": 1}}, "logit_bias", "plain decimal digits (0-9)"),
    ({"logit_bias": {"5": 1, "320": -1}}, "logit_bias", "token id 320 is out of range [0, 320)"),
]


@pytest.mark.parametrize("extra, param, piece", PARAMS, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(PARAMS)])
def test_errors_name_the_field_the_client_wrote(server, extra, param, piece):
    status, _, err = post(server.port, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **extra})
    assert status == 400, err
    assert err["error"]["param"] == param and piece in err["error"]["message"], err


def test_hostile_bodies_answered_4xx(server):
    huge_exponent = b'{"prompt": "hi", "temperature": 1e400}'
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for raw in (huge_exponent, deep, b'{"prompt": "hi", "top_p": NaN}', b"\xff\xfe", b"", b"null", b'"text"',
                b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}'):
        status, _, err = post(server.port, "/v1/completions", None, raw=raw)
        assert 400 <= status < 500, (raw[:40], status, err)
        assert err["error"]["message"], err
    messages = [{"role": "user", "content": "a"}] * 5000
    status, _, err = post(server.port, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "messages" and "4096" in err["error"]["message"], err
    parts = [{"type": "text", "text": "a"}] * 300
    status, _, err = post(server.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]})
    assert status == 400 and err["error"]["param"] == "messages" and "256" in err["error"]["message"], err
    # a body announced over the limit is refused before a byte of it is read
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    # a chunked body that runs over the limit is cut off at the limit
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    chunk = b"x" * (1 << 20)  # 4 MiB and one byte: all of it is sent before the answer is read
    conn.request("POST", "/v1/completions", body=iter([chunk] * 4 + [b"x"]), encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert resp.status == 413, resp.read()
    conn.close()
    assert idle(server.port)


# ---- property-based bodies ------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
# per field: values of the right type, in range and out of it (combinations may still clash)
COMMON = {
    "model": st.sampled_from(["bundle", "gpt-4"]), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2) | st.floats(), "top_p": st.floats(0, 1.5), "top_k": st.integers(-1, 400),
    "seed": st.integers(-1, 1 << 64), "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20),
    "n": st.integers(0, 2), "ignore_eos": st.booleans(), "return_token_ids": st.booleans(),
    "presence_penalty": st.floats(-1, 1), "logprobs": st.integers(0, 1),
    "speculation": st.sampled_from(["none", "ngram", "draft", "medusa", "auto"]) | st.fixed_dictionaries(
        {}, optional={"method": st.sampled_from(["ngram", "draft", "medusa"]), "gamma": st.integers(0, 4),
                      "tree": st.sampled_from(["chain_2", "mc_sim_7b_top10"])}),
    "gamma": st.integers(-2, 20), "gamma_min": st.integers(-1, 5), "gamma_max": st.integers(0, 20),
    "tree": st.sampled_from(["chain_2", "mc_sim_7b_top10", "/etc/hostname"])
    | st.lists(st.lists(st.integers(-1, 17), min_size=1, max_size=4), min_size=1, max_size=5),
    "ngram_min": st.integers(0, 9), "ngram_max": st.integers(0, 9), "typical": st.booleans(),
}
# max_tokens always given and mostly small: the bundle's default (128) would make the run slow
MAX_TOKENS = st.integers(1, 6) | st.integers(-3, 0) | st.integers(1 << 19, 1 << 22)
PROMPT = st.text(max_size=40) | st.lists(st.integers(-5, 400), max_size=12) | st.lists(st.text(max_size=8), max_size=2)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard", ""]),
                                 "content": st.text(max_size=30) | st.lists(
                                     st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                            "text": st.text(max_size=10)}), max_size=2)})


@st.composite
def bodies(draw, required: dict, optional: dict):
    """A body of well-typed fields; half the time one field (or an unknown one) is any JSON value."""
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(st.booleans()):
        body[draw(st.sampled_from(sorted(set(required) | set(optional) | {"frobnicate"})))] = draw(JSON)
    return body


COMPLETION_BODIES = bodies({"prompt": PROMPT, "max_tokens": MAX_TOKENS}, COMMON)
CHAT_BODIES = bodies({"messages": st.lists(MESSAGE, max_size=3), "max_tokens": MAX_TOKENS},
                     {**COMMON, "max_completion_tokens": st.integers(-1, 6)})
HYPOTHESIS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))


def send(port: int, path: str, body) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200 or resp.getheader("Content-Type") != "text/event-stream":
            parsed = json.loads(data)
            assert ("error" in parsed) == (resp.status != 200), (resp.status, parsed)
        else:
            assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
        return resp.status
    finally:
        conn.close()


@pytest.mark.parametrize("path, bodies", [("/v1/completions", COMPLETION_BODIES),
                                          ("/v1/chat/completions", CHAT_BODIES)], ids=["completions", "chat"])
def test_schema_fuzz_never_5xx(server, path, bodies):
    seen: dict[int, int] = {}

    @HYPOTHESIS
    @given(body=bodies)
    def check(body):
        status = send(server.port, path, body)
        seen[status] = seen.get(status, 0) + 1
        assert status == 200 or 400 <= status < 500, (status, body)

    check()
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if k >= 400) > 0, seen  # both kinds were sent
    wait_until(lambda: idle(server.port), 30, "the server to be idle with its KV pool whole")


# ---- slow clients ---------------------------------------------------------------------------------
def test_slow_clients_block_no_one(server, engine):
    body = json.dumps({"prompt": "hi", "max_tokens": 8}).encode()
    half_bodies, half_headers = [], []
    try:
        for _ in range(24):  # each sends its headers and a third of its body, then stalls
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body[: len(body) // 3]))
            half_bodies.append(sock)
        for _ in range(8):  # these stall inside their headers
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            half_headers.append(sock)
        # meanwhile whole requests are answered, greedy as generate
        expect = greedy_ids(engine, "the quick brown fox jumps", 16)
        whole = {"prompt": "the quick brown fox jumps", "max_tokens": 16, "ignore_eos": True, "return_token_ids": True}
        status, _, full = post(server.port, "/v1/completions", whole)
        assert status == 200 and full["choices"][0]["token_ids"] == expect, full
        chunks = stream(server.port, "/v1/completions", whole)
        assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == expect
        # a stalled body is answered 408 once --body-timeout (1 s here) passes: it held its own
        # connection only
        for sock in half_bodies:
            reply = b""
            while b"\r\n\r\n" not in reply:
                data = sock.recv(4096)
                if not data:
                    break
                reply += data
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    finally:
        for sock in half_bodies + half_headers:
            sock.close()
    assert idle(server.port)


# ---- the soak, CI-sized ---------------------------------------------------------------------------
def test_soak_ci_sized(server, bundle):
    jobs = soak_server.make_jobs(48, seed=1)
    assert {j.body.get("speculation", "none") for j in jobs if j.body} >= set(soak_server.METHODS)
    assert {j.kind for j in jobs} >= {"greedy", "stream", "chat_stream", "cancel", "bad", "sampled"}
    expect = soak_server.expected_answers(bundle, jobs)
    result = soak_server.soak(server.port, jobs, expect, clients=8)
    assert result["failures"] == [], result["failures"]
    assert result["admitted"] == sum(j.kind != "bad" for j in jobs)
    status, text = get(server.port, "/metrics")
    drafted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("specbuild_accepted_tokens_total"))
    assert drafted > 0  # speculation ran and some drafts were accepted


HTTP_ATTACKS = ["idle_sockets", "huge_headers", "echo_logprobs", "role_injection", "disconnects"]


def test_hostile_soak_ci_sized(bundle, tmp_path):
    """scripts/soak_hostile.py's attacks on the HTTP front, short phases: no innocent request
    failed or changed its answer, the server survived (latencies are the script's to print)."""
    import resource

    import soak_hostile

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    attacks = list(HTTP_ATTACKS)
    if hard != resource.RLIM_INFINITY and hard < 1030 + 256:
        attacks.remove("idle_sockets")  # this machine cannot hold that many sockets on the client side
    elif soft != resource.RLIM_INFINITY and soft < 1030 + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    result = soak_hostile.soak_server_tree(bundle, soak_hostile.innocent_jobs(bundle), attacks, 2.0, 2,
                                           str(tmp_path / "soak.log"), None, say=lambda m: None)
    assert result["server_survived"]
    rows = result["rows"]
    assert set(attacks) <= set(rows)
    for name, row in rows.items():
        assert row["innocent_failed"] == 0, (name, row["failures"])
    assert rows["huge_headers"]["attack_outcomes"].get("HTTP/1.1 431", 0) >= 2, rows["huge_headers"]
    assert sum(r["innocent_requests"] for r in rows.values()) > len(rows)  # innocents ran throughout


def test_triton_inputs_get_the_same_stop_limits(engine):
    """The limits live in SamplingParams, so the Triton model refuses the same stop words."""
    import numpy as np

    from specbuild.errors import RequestError
    from specbuild.serve.tritonserver_model import build_request, parse_inputs

    base = {"text_input": np.array([b"hi"], dtype=object), "max_tokens": np.array([4], np.int32)}
    for words, limit in (([b"x" * 257], "at most 256"), ([b"w%d" % i for i in range(17)], "at most 16")):
        parsed = parse_inputs({**base, "stop_words": np.array(words, dtype=object)})
        with pytest.raises(RequestError, match=limit):
            build_request(parsed, engine)
    assert build_request(parse_inputs({**base, "stop_words": np.array([b"x" * 256], dtype=object)}), engine)
