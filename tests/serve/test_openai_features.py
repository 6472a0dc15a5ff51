"""What OpenAI-API clients send, over a real socket with the openai client: logprobs (chat and
completions) equal to the engine's, n > 1 (independent seeded samples), stream_options
include_usage, penalties and logit_bias, echo, and response_format json_schema / regex with
and without speculation (greedy: equal to constrained plain decoding)."""

from __future__ import annotations

import json

import pytest
import torch
from http_client import ServerProcess, post
from tiny import draft_pair_bundle

from specbuild.bench.structured import validates
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(180)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]},
                                           "tag": {"type": "string", "enum": ["alpha", "beta"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return draft_pair_bundle(tmp_path_factory.mktemp("oai"), noise=0.05, max_seq_len=1024, max_batch_size=8)


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    srv = ServerProcess(bundle, str(tmp_path_factory.mktemp("logs") / "oai.log"), "--max-batch-size", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine(bundle):
    return Engine(bundle, EngineConfig(threads=1))


def engine_run(engine, prompt_ids, method="none", **kw):
    logprobs = kw.pop("logprobs", None)
    fmt = kw.pop("response_format", None)
    req = Request(prompt_ids=prompt_ids, logprobs=logprobs, response_format=fmt,
                  speculation=SpeculationConfig.make(None, method=method, gamma=None if method == "none" else 3),
                  sampling=SamplingParams(**kw))
    return engine.generate([req])[0]


def test_completion_logprobs_equal_the_engines(client, engine):
    out = client.completions.create(model="bundle", prompt=PROMPT, max_tokens=12, logprobs=3,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, "speculation": "draft",
                                                "gamma": 3})
    ref = engine_run(engine, PROMPT, max_tokens=12, ignore_eos=True, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 12 and len(lp.top_logprobs) == 12 and lp.text_offset[0] == 0
    for got, want in zip(lp.token_logprobs, ref["logprobs"]):
        assert got == pytest.approx(want["logprob"], abs=1e-6)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # a dict: pieces that decode alike merge
    assert out.usage.accepted_tokens > 0  # speculated, and the logprobs are plain decoding's


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model="bundle", messages=[{"role": "user", "content": "count: 1 2 3"}],
                                         max_tokens=6, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token is the most likely
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token or item.bytes


def test_n_independent_seeded_samples(client, engine):
    out = client.completions.create(model="bundle", prompt=PROMPT, max_tokens=10, n=3, temperature=1.0, seed=11,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, "speculation": "none"})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for i, c in enumerate(out.choices):
        ref = engine_run(engine, PROMPT, max_tokens=10, ignore_eos=True, temperature=1.0, seed=11 + i)
        assert c.model_extra["token_ids"] == ref["token_ids"], i
    assert len({tuple(c.model_extra["token_ids"]) for c in out.choices}) > 1
    assert out.usage.completion_tokens == 30 and out.usage.prompt_tokens == len(PROMPT)


def test_stream_n_with_include_usage(client):
    stream = client.chat.completions.create(model="bundle", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            n=2, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_penalties_and_bias_reach_the_engine(client, engine):
    kw = dict(max_tokens=16, presence_penalty=0.8, frequency_penalty=0.5)
    out = client.completions.create(model="bundle", prompt=PROMPT, logit_bias={"9": -100}, **kw,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, "speculation": "ngram"})
    ref = engine_run(engine, PROMPT, ignore_eos=True, logit_bias={9: -100.0}, **kw)
    assert out.choices[0].model_extra["token_ids"] == ref["token_ids"]
    plain = engine_run(engine, PROMPT, ignore_eos=True, max_tokens=16)
    assert plain["token_ids"] != ref["token_ids"]


def test_echo(server, engine):
    status, _, body = post(server.port, "/v1/completions", {"prompt": "abc", "max_tokens": 3, "echo": True,
                                                            "ignore_eos": True})
    assert status == 200 and body["choices"][0]["text"].startswith("abc")
    # echo + logprobs: the prompt's own logprobs first (the first token's is null), then the answer's
    prompt = PROMPT[:6]
    status, _, body = post(server.port, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "echo": True,
                                                            "logprobs": 2, "ignore_eos": True})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    from specbuild.bench.verify_dist import last_logits  # an independent reading: one forward per prefix

    for i in range(1, len(prompt)):
        want = float(torch.log_softmax(last_logits(engine, prompt[:i]).double(), -1)[prompt[i]])
        assert lp["token_logprobs"][i] == pytest.approx(want, abs=1e-6), i
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_response_format_json_schema(client, engine, method):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    out = client.completions.create(model="bundle", prompt=PROMPT, max_tokens=300,
                                    extra_body={"response_format": fmt, "speculation": method, "return_token_ids": True})
    text = out.choices[0].text
    assert validates(text, SCHEMA) == (True, ""), text
    ref = engine_run(engine, PROMPT, max_tokens=300, response_format=fmt)
    assert out.choices[0].model_extra["token_ids"] == ref["token_ids"]  # constrained plain decoding's tokens
    chat = client.chat.completions.create(model="bundle", messages=[{"role": "user", "content": "a JSON object"}],
                                          max_tokens=300, response_format=fmt)
    assert validates(chat.choices[0].message.content, SCHEMA)[0]


def test_response_format_errors_are_400(client):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.completions.create(model="bundle", prompt="x", max_tokens=3, extra_body={"response_format": {"type": "xml"}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.completions.create(model="bundle", prompt="x", max_tokens=3,
                                  extra_body={"response_format": {"type": "regex", "regex": "(("}})
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model="bundle", prompt="x", max_tokens=3, n=17)
    regex = client.completions.create(model="bundle", prompt=PROMPT, max_tokens=20,
                                      extra_body={"response_format": {"type": "regex", "regex": "(yes|no)!"}})
    assert regex.choices[0].text in ("yes!", "no!")
    assert json.loads(json.dumps(regex.model_dump()))  # the whole answer is plain JSON
