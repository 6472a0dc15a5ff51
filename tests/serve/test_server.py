"""The HTTP server over real loopback sockets, run as `specbuild serve` in a subprocess.

Two servers per module: a main one (batch 4) and a small one (batch 1, queue 1) for
back-pressure and shutdown. Every wait is bounded; the subprocesses are killed in teardown.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from http_client import ServerProcess, get, metric, next_event, open_stream, parse_metrics, post, stream, wait_until

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLD_TOKENS = 4000  # a request that runs for seconds on the tiny model (max_seq_len 4096)


@pytest.fixture(scope="module")
def bundle(tiny_hf_dir, tmp_path_factory) -> str:
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    out = str(tmp_path_factory.mktemp("serve_bundle") / "tiny")
    return compile_bundle(tiny_hf_dir, out, CompileOptions(max_seq_len=4096, max_batch_size=8))


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    srv = ServerProcess(bundle, str(tmp_path_factory.mktemp("logs") / "main.log"), "--max-batch-size", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(bundle):
    from specbuild.engine.engine import Engine, EngineConfig

    return Engine(bundle, EngineConfig(threads=1))


# ---- HTTP helpers ----------------------------------------------------------------------------


# ---- tests ------------------------------------------------------------------------------------
def test_health_models_and_metrics(server):
    # `serve` opens its engine through open_engine: auto picks torch for a torch bundle
    assert "(torch backend, loaded in" in server.output()
    status, text = get(server.port, "/health")
    health = json.loads(text)
    assert status == 200 and health["status"] == "ok" and health["kv_blocks_total"] > 0
    assert health["backend"] == "torch"
    status, text = get(server.port, "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == "tiny"
    status, text = get(server.port, "/metrics")
    samples = parse_metrics(text)
    for family, kind in (("requests_total", "counter"), ("acceptance_rate", "gauge"),
                         ("mean_accepted_tokens", "gauge"), ("draft_tokens_total", "counter"),
                         ("accepted_tokens_total", "counter"), ("ttft_seconds", "histogram"),
                         ("tpot_seconds", "histogram"), ("queue_depth", "gauge"), ("kv_blocks_used", "gauge"),
                         ("gamma", "gauge")):
        assert f"# TYPE specbuild_{family} {kind}\n" in text, family
    assert samples[("specbuild_kv_blocks_total", ())] == health["kv_blocks_total"]
    assert get(server.port, "/nope")[0] == 404
    assert get(server.port, "/v1/completions")[0] == 405


def greedy(engine, max_tokens: int, **request) -> dict:
    from specbuild.sampling.params import SamplingParams
    from specbuild.engine.sequence import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([Request(sampling=params, **request)])[0]


@pytest.mark.parametrize("prompt", ["The quick brown fox", "in the beginning there was"])
def test_completion_equals_engine_generate(server, engine, prompt):
    expect = greedy(engine, 24, prompt=prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    status, _, full = post(server.port, "/v1/completions", body)
    assert status == 200, full
    choice = full["choices"][0]
    assert choice["token_ids"] == expect["token_ids"] and choice["text"] == expect["text"]
    assert choice["finish_reason"] == "length" and full["object"] == "text_completion"
    usage = full["usage"]
    assert usage["completion_tokens"] == 24 and usage["prompt_tokens"] == expect["stats"]["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24 and "seed" in usage
    assert usage["drafted_tokens"] == 0 and usage["accepted_tokens"] == 0

    chunks = stream(server.port, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len(chunks) >= 10, "tokens were not streamed one by one"
    assert sum((c["choices"][0]["token_ids"] for c in chunks[:-1]), []) == expect["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == expect["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24


def test_chat_equals_engine_generate(server, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids = engine.encode(engine.render_chat(messages), add_special_tokens=False)
    expect = greedy(engine, 16, prompt_ids=ids)
    body = {"messages": messages, "max_tokens": 16, "ignore_eos": True, "return_token_ids": True}
    status, _, full = post(server.port, "/v1/chat/completions", body)
    assert status == 200, full
    assert full["object"] == "chat.completion"
    message = full["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == expect["text"]
    assert full["choices"][0]["token_ids"] == expect["token_ids"]
    assert full["usage"]["prompt_tokens"] == len(ids)

    chunks = stream(server.port, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == expect["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16


def test_speculation_fields_reach_the_engine(server, engine):
    """Prompt lookup through the server: drafts proposed and accepted, greedy output unchanged."""
    expect = greedy(engine, 48, prompt="ab ab ab ab")
    body = {"prompt": "ab ab ab ab", "max_tokens": 48, "ignore_eos": True, "return_token_ids": True,
            "speculation": "ngram", "gamma": 4}
    status, _, full = post(server.port, "/v1/completions", body)
    assert status == 200, full
    assert full["choices"][0]["token_ids"] == expect["token_ids"]
    assert full["usage"]["drafted_tokens"] > 0 and full["usage"]["accepted_tokens"] > 0
    assert metric(server.port, "specbuild_draft_tokens_total") >= full["usage"]["drafted_tokens"]
    assert 0 < metric(server.port, "specbuild_acceptance_rate") <= 1


def test_concurrent_requests_all_complete(server):
    before = metric(server.port, "specbuild_generation_tokens_total")
    results: dict[int, int] = {}

    def client(i: int) -> None:
        body = {"prompt": f"request number {i}", "max_tokens": 32, "ignore_eos": True, "return_token_ids": True}
        if i % 2:
            chunks = stream(server.port, "/v1/completions", body)
            results[i] = len(sum((c["choices"][0]["token_ids"] for c in chunks), []))
        else:
            status, _, full = post(server.port, "/v1/completions", body)
            results[i] = len(full["choices"][0]["token_ids"]) if status == 200 else -status

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {i: 32 for i in range(8)}
    assert metric(server.port, "specbuild_generation_tokens_total") - before == 8 * 32
    wait_until(lambda: metric(server.port, "specbuild_kv_blocks_used") == 0, 5, "KV blocks to be freed")


BAD_BODIES = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"prompt": "hi", "length_penalty": 1.5}', 400, "length_penalty"),  # served at 1.0 only
    (b'{"prompt": "hi", "repetition_penalty": -1}', 400, "repetition_penalty"),
    (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "hi", "temperature": -0.5}', 400, "temperature"),
    (b'{"prompt": "hi", "top_p": 1.5}', 400, "top_p"),
    (b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
    (b'{"prompt": "hi", "n": 17}', 400, "n"),
    (b'{"prompt": "hi", "gamma": 99}', 400, "gamma"),
    (b'{"prompt": "hi", "speculation": "telepathy"}', 400, "speculation"),
    (b'{"prompt": ""}', 400, "prompt"),
    (b'{"prompt": [1, 2, 100000]}', 400, "prompt"),
    (b'{"max_tokens": 4}', 400, "prompt"),
    (json.dumps({"prompt": list(range(5, 105)) * 41}).encode(), 400, "prompt"),  # 4100 tokens > max_seq_len
    (b'{"prompt": "hi", "model": "gpt-9"}', 404, "model"),
]


def test_bad_bodies_get_json_errors_while_a_good_request_completes(server):
    good: dict = {}
    body = {"prompt": "keep going", "max_tokens": 300, "ignore_eos": True, "stream_options": {"include_usage": True}}
    worker = threading.Thread(target=lambda: good.update(chunks=stream(server.port, "/v1/completions", body)))
    worker.start()
    for raw, want_status, want_param in BAD_BODIES:
        status, _, err = post(server.port, "/v1/completions", None, raw=raw)
        assert status == want_status, (raw[:60], err)
        assert set(err["error"]) >= {"message", "type", "param"} and err["error"]["message"], err
        assert err["error"]["param"] == want_param, (raw[:60], err)
    status, _, err = post(server.port, "/v1/chat/completions", {"messages": [{"content": "no role"}]})
    assert status == 400 and err["error"]["param"] == "messages"
    # no Content-Length at all
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 411")
    worker.join(timeout=60)
    assert good["chunks"][-2]["choices"][0]["finish_reason"] == "length"
    assert good["chunks"][-1]["usage"]["completion_tokens"] == 300
    assert get(server.port, "/health")[0] == 200
    assert metric(server.port, "specbuild_requests_rejected_total", reason="invalid") >= len(BAD_BODIES) - 1


def test_disconnects_abort_and_free_blocks(server):
    aborted = metric(server.port, "specbuild_requests_total", endpoint="completions", finish_reason="abort")
    conn, resp = open_stream(server.port, "/v1/completions", {"prompt": "long", "max_tokens": HOLD_TOKENS,
                                                              "ignore_eos": True})
    for _ in range(3):
        assert isinstance(next_event(resp), dict)
    assert metric(server.port, "specbuild_kv_blocks_used") > 0
    t0 = time.monotonic()
    resp.close()
    conn.close()
    wait_until(lambda: metric(server.port, "specbuild_requests_total", endpoint="completions",
                              finish_reason="abort") == aborted + 1, 5, "the abort")
    assert time.monotonic() - t0 < 5
    assert metric(server.port, "specbuild_kv_blocks_used") == 0  # freed before the abort is counted
    # a non-streaming client that leaves while waiting is aborted too
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        data = json.dumps({"prompt": "long", "max_tokens": HOLD_TOKENS, "ignore_eos": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        wait_until(lambda: metric(server.port, "specbuild_running_requests") == 1, 5, "the request to start")
    wait_until(lambda: metric(server.port, "specbuild_requests_total", endpoint="completions",
                              finish_reason="abort") == aborted + 2, 5, "the second abort")
    wait_until(lambda: metric(server.port, "specbuild_kv_blocks_used") == 0, 5, "blocks freed")


def test_queue_full_429_then_sigterm(bundle, tmp_path):
    srv = ServerProcess(bundle, str(tmp_path / "small.log"), "--max-batch-size", "1", "--max-queue", "1",
                        "--backend", "torch")
    try:
        assert "(torch backend, loaded in" in srv.output()
        port, long_body = srv.port, {"prompt": "hold", "max_tokens": HOLD_TOKENS, "ignore_eos": True}
        conn_a, resp_a = open_stream(port, "/v1/completions", long_body)
        assert isinstance(next_event(resp_a), dict)  # A is running
        conn_b = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn_b.request("POST", "/v1/completions", body=json.dumps({**long_body, "stream": True}))
        wait_until(lambda: json.loads(get(port, "/health")[1])["queue_depth"] == 1, 5, "B to queue")
        status, headers, err = post(port, "/v1/completions", {"prompt": "C", "max_tokens": 4})
        assert status == 429 and int(headers["Retry-After"]) >= 1, err
        assert err["error"]["type"] == "rate_limit_error"
        assert metric(port, "specbuild_requests_rejected_total", reason="queue_full") == 1
        resp_a.close()
        conn_a.close()  # A leaves: B is admitted
        wait_until(lambda: json.loads(get(port, "/health")[1])["queue_depth"] == 0, 5, "B to be admitted")
        srv.proc.send_signal(signal.SIGTERM)  # B is streaming: shutdown must not wait for it
        assert srv.proc.wait(timeout=15) == 0, srv.output()
        conn_b.close()
    finally:
        srv.stop()


def test_backend_option(bundle, tmp_path):
    """--backend as `generate` takes it: tensorrt-llm on a torch bundle is refused with the reason
    before anything loads; MineDraft (--parallel-draft) is torch-only."""
    base = [sys.executable, "-c", "from specbuild.cli import main; main()", "serve", bundle, "--port", "0"]
    r = subprocess.run(base + ["--backend", "tensorrt-llm"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--backend tensorrt-llm cannot run" in r.stderr and "compiled for the torch backend" in r.stderr
    r = subprocess.run(base + ["--backend", "tensorrt-llm", "--parallel-draft"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 2 and "--parallel-draft runs on the torch backend only" in r.stderr, r.stderr
    r = subprocess.run(base + ["--backend", "onnx"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "'onnx' is not one of 'auto', 'torch', 'tensorrt-llm'" in r.stderr, r.stderr


def test_metrics_exposition_by_hand():
    """Bucket placement, cumulative counts, label escaping and the +Inf bucket, parsed back."""
    from specbuild.serve.metrics import Counter, Histogram

    hist = Histogram("x_seconds", "h", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        hist.observe(value)
    counter = Counter("y_total", "c", ("reason",))
    counter.inc(2, reason='say "hi"\nback\\slash')
    with pytest.raises(ValueError):
        counter.inc(-1, reason="r")
    samples = parse_metrics("\n".join(hist.render() + counter.render()) + "\n")
    assert [samples[("x_seconds_bucket", (("le", le),))] for le in ("0.1", "1", "+Inf")] == [2, 3, 4]
    assert samples[("x_seconds_sum", ())] == pytest.approx(3.65) and samples[("x_seconds_count", ())] == 4
    assert samples[("y_total", (("reason", 'say \\"hi\\"\\nback\\\\slash'),))] == 2


def test_openai_client_and_curl(server, engine):
    """The README's clients: the openai package (sync, streaming, extension fields through
    extra_body) and curl, against the real server."""
    openai = pytest.importorskip("openai")
    expect = greedy(engine, 12, prompt="The quick brown fox")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=60)
    done = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "speculation": "ngram"})
    assert done.choices[0].text == expect["text"] and done.usage.completion_tokens == 12
    pieces = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                            max_tokens=8, stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    messages = [{"role": "user", "content": "hello there"}]
    assert text == greedy(engine, 8, prompt_ids=engine.encode(engine.render_chat(messages),
                                                                add_special_tokens=False))["text"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    assert info.value.status_code == 400 and "wizard" in str(info.value)
    assert [m.id for m in client.models.list().data] == ["tiny", "llama"]  # the directory, the checkpoint
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    out = subprocess.run([curl, "-s", f"127.0.0.1:{server.port}/v1/completions", "-d",  # curl -d: a form type
                          json.dumps({"prompt": "The quick brown fox", "max_tokens": 12, "ignore_eos": True})],
                         capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["choices"][0]["text"] == expect["text"], out
    out = subprocess.run([curl, "-sN", f"127.0.0.1:{server.port}/v1/completions", "-H", "content-type: application/json",
                          "-d", json.dumps({"prompt": "The quick brown fox", "max_tokens": 12, "ignore_eos": True,
                                            "stream": True})], capture_output=True, text=True, timeout=60)
    events = [line[6:] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expect["text"]


def test_suffix_over_http_with_store_sizes_in_metrics(server, engine):
    """`speculation: suffix` through the server: greedy output unchanged, drafts proposed and
    accepted, and the suffix store's sizes in /metrics grow by what the request produced."""
    prompt = "one fish two fish red fish blue fish one fish two fish"
    expect = greedy(engine, 40, prompt=prompt)
    before = metric(server.port, "specbuild_suffix_store_tokens")
    # a fixed depth: the controller's choice follows costs measured at start-up, so with it free
    # the drafts (and whether any is accepted) would depend on the machine's timing
    body = {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "return_token_ids": True,
            "speculation": "suffix", "gamma": 4}
    status, _, full = post(server.port, "/v1/completions", body)
    assert status == 200, full
    assert full["choices"][0]["token_ids"] == expect["token_ids"]
    assert full["usage"]["drafted_tokens"] > 0 and full["usage"]["accepted_tokens"] > 0
    assert metric(server.port, "specbuild_suffix_store_tokens") == before + 40
    assert metric(server.port, "specbuild_suffix_store_max_tokens") > 0
    assert metric(server.port, "specbuild_suffix_store_requests") >= 1
