"""Hostile triggers mixed with innocent traffic over a real socket (`specbuild serve` in a
subprocess on the tiny bundle with a draft model, Medusa heads and n-grams, Medusa the
default): temperature 1e-38 and top_p 1e-45 (they made every tree verification raise and
the whole batch fail with 500, or returned a NaN token), a grammar the grammar engine gives
up on and an empty-language regex (they failed at the first token or answered empty
text), a tree on a chain method. Every innocent request answers 200 with the very tokens
it gets alone; the hostile ones get the greedy answer or a 400 naming the field.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
from http_client import get, parse_metrics, post

pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import soak_server  # noqa: E402  (scripts/soak_server.py: the bundle and the server process)

PROMPTS = ["word3 word6 word9 word12", "The cat sat on", "word0 word7 word14 word21 word5", "1 2 3 4 5"]
INNOCENT = [{"speculation": m} for m in ("medusa", "ngram", "draft", "none")]
HOSTILE = [
    ({"temperature": 1e-38}, 200, None),  # below the floor: greedy, on the default (Medusa)
    ({"temperature": 0.7, "top_p": 1e-45, "speculation": "draft"}, 200, None),  # the argmax only
    ({"temperature": 0.5, "top_k": 1, "speculation": "medusa"}, 200, None),
    ({"response_format": {"type": "grammar", "grammar": 'start: "a"{100000}'}}, 400, "response_format"),
    ({"response_format": {"type": "regex", "regex": "[^\\s\\S]"}}, 400, "response_format"),
    ({"speculation": "ngram", "tree": [[0], [0, 0]]}, 400, "tree"),
    ({"temperature": 1e38}, 400, "temperature"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    bundle = soak_server.build_bundle(str(tmp_path_factory.mktemp("isolation")), say=lambda m: None)
    srv = soak_server.Server(bundle, str(tmp_path_factory.mktemp("logs") / "isolation.log"),
                             extra=("--max-batch-size", "4"))
    yield srv
    srv.stop()


def complete(port: int, prompt: str, **fields) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    status, _, body = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "ignore_eos": True,
                                                     "return_token_ids": True, **fields})
    return status, body, time.monotonic() - t0


def token_ids(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def test_hostile_requests_beside_innocent_ones(server):
    port = server.port
    alone, alone_s = {}, []
    for i, prompt in enumerate(PROMPTS):  # each innocent request alone: the answers to keep
        for j, fields in enumerate(INNOCENT):
            status, body, dt = complete(port, prompt, **fields)
            assert status == 200, body
            alone[i, j] = token_ids(body)
            alone_s.append(dt)
    greedy = {i: alone[i, 3] for i in range(len(PROMPTS))}  # speculation none, temperature 0
    assert all(alone[i, j] == greedy[i] for i, j in alone)  # lossless, as always

    innocent_out, hostile_out, errors = [], [], []

    def innocents(rounds: int) -> None:
        for _ in range(rounds):
            for i, prompt in enumerate(PROMPTS):
                for j, fields in enumerate(INNOCENT):
                    innocent_out.append(((i, j), *complete(port, prompt, **fields)))

    def hostile(rounds: int) -> None:
        for r in range(rounds):
            for k, (fields, _, _) in enumerate(HOSTILE):
                i = (r + k) % len(PROMPTS)
                hostile_out.append(((i, k), *complete(port, PROMPTS[i], **fields)))

    threads = [threading.Thread(target=innocents, args=(2,)) for _ in range(2)] + \
              [threading.Thread(target=hostile, args=(3,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=500)
    assert not any(t.is_alive() for t in threads), "clients still waiting"
    for (i, j), status, body, _ in innocent_out:
        if status != 200 or token_ids(body) != alone[i, j]:
            errors.append(((i, j), status, body))
    assert not errors, errors[:3]
    for (i, k), status, body, _ in hostile_out:
        fields, want, param = HOSTILE[k]
        assert status == want, (fields, status, body)
        if want == 200:
            assert token_ids(body) == greedy[i], fields
        else:
            assert body["error"]["param"] == param and param in body["error"]["message"], body
    assert len(innocent_out) == 2 * 2 * len(PROMPTS) * len(INNOCENT) and len(hostile_out) == 2 * 3 * len(HOSTILE)
    status, text = get(port, "/health")
    health = json.loads(text)
    assert health["running"] == 0 and health["kv_blocks_used"] == 0
    metrics = parse_metrics(get(port, "/metrics")[1])
    assert metrics[("specbuild_step_failures_total", ())] == 0  # nothing failed a batch
    worst = max(dt for *_, dt in innocent_out)
    print(f"\ninnocent latency: alone median {sorted(alone_s)[len(alone_s) // 2]:.3f}s max {max(alone_s):.3f}s; "
          f"beside hostile traffic max {worst:.3f}s over {len(innocent_out)} requests")


def test_engine_errors_map_to_the_status_the_engine_gives():
    """A request the engine failed alone answers 400 naming response_format when its grammar
    caused it, 500 (server_error) otherwise (Sequence.fail's status)."""
    from types import SimpleNamespace

    from specbuild.serve.openai_http import engine_error

    grammar = engine_error(SimpleNamespace(error="response_format grammar: the grammar engine stopped on this "
                                                 "grammar: parser error: Too many items", error_status=400))
    assert grammar.status == 400 and grammar.body()["error"]["param"] == "response_format"
    assert grammar.body()["error"]["type"] == "invalid_request_error"
    nan = engine_error(SimpleNamespace(error="the engine failed this request while choosing its next tokens: "
                                             "NumericsError: ...", error_status=500))
    assert nan.status == 500 and nan.body()["error"]["type"] == "server_error"
