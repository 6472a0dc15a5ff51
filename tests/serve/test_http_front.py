"""The connection layer (serve/http_guard.py) over real loopback sockets, against `specbuild
serve` in a subprocess: idle sockets never shut a client out, request heads have a deadline,
a size and a header count (431), and the request limit counts requests, not sockets.

Two servers: one with the default header timeout (10 s, so the idle sockets of a test stay
open while it runs) and one with short timeouts and small caps. Every wait is bounded and for a
state; latencies are measured by scripts/soak_hostile.py, not asserted here.
"""

from __future__ import annotations

import json
import resource
import select
import socket
import threading

import pytest
from http_client import ServerProcess, get, open_stream, post, wait_until

pytestmark = pytest.mark.timeout(180)

IDLE_SOCKETS = 1030  # more than uvicorn's old limit_concurrency (1024) counted


@pytest.fixture(scope="module")
def bundle(tiny_hf_dir, tmp_path_factory) -> str:
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    out = str(tmp_path_factory.mktemp("front_bundle") / "tiny")
    return compile_bundle(tiny_hf_dir, out, CompileOptions(max_seq_len=1024, max_batch_size=4))


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    srv = ServerProcess(bundle, str(tmp_path_factory.mktemp("logs") / "front.log"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def strict(bundle, tmp_path_factory):
    srv = ServerProcess(bundle, str(tmp_path_factory.mktemp("logs") / "strict.log"), "--header-timeout", "0.5",
                        "--max-connections", "64", "--max-inflight", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(bundle):
    from specbuild.engine.engine import Engine, EngineConfig

    return Engine(bundle, EngineConfig(threads=1))


def greedy_ids(engine, prompt: str, max_tokens: int) -> list[int]:
    from specbuild.engine.sequence import Request
    from specbuild.sampling.params import SamplingParams

    request = Request(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return engine.generate([request])[0]["token_ids"]


def open_files(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"this test opens {need} sockets; the hard open-file limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def closed_by_peer(sock: socket.socket) -> bool:
    """True when the server has closed this socket (EOF or reset is readable now)."""
    poller = select.poll()  # not select(): these fds run past 1024
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def raw_exchange(port: int, data: bytes) -> bytes:
    """Send `data` (from a thread: the server may answer before it has read all of it) and
    read the answer until the server closes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)

    def send() -> None:
        try:
            sock.sendall(data)
        except OSError:  # the server closed after its answer; what it said is still readable
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    reply = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    except OSError:
        pass
    sender.join(timeout=30)
    sock.close()
    return reply


def completion(prompt: str = "the quick brown fox", max_tokens: int = 8) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True}


def test_idle_sockets_never_shut_a_client_out(server, engine):
    open_files(IDLE_SOCKETS + 256)
    expect = greedy_ids(engine, "the quick brown fox", 8)
    idle = []
    try:
        for _ in range(IDLE_SOCKETS):  # connected, never a byte sent
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
        status, _, body = post(server.port, "/v1/completions", completion())
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == expect
        assert get(server.port, "/health")[0] == 200
        # answered while every idle socket was still open on the server's side
        assert not [s for s in idle if closed_by_peer(s)]
    finally:
        for s in idle:
            s.close()


def test_a_huge_header_gets_431(server):
    big = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\nContent-Length: 2\r\n\r\n{}"
    reply = raw_exchange(server.port, big)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert str(64 * 1024) in error["message"] and error["code"] == "header_too_large", error
    # a huge request line is the same limit
    reply = raw_exchange(server.port, b"GET /" + b"p" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert post(server.port, "/v1/completions", completion())[0] == 200


def test_ten_thousand_headers_get_431(server):
    many = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"a: b\r\n" * 10_000 + b"\r\n"  # 60 kB: under the size limit
    assert len(many) < 64 * 1024
    reply = raw_exchange(server.port, many)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert "128 header lines" in error["message"] and error["code"] == "too_many_headers", error
    # up to the limit is fine
    ok = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + b"a: b\r\n" * 120 + b"\r\n"
    assert raw_exchange(server.port, ok).startswith(b"HTTP/1.1 200")


def test_a_socket_that_sends_nothing_is_closed_after_the_header_timeout(strict):
    silent = socket.create_connection(("127.0.0.1", strict.port), timeout=30)
    half = socket.create_connection(("127.0.0.1", strict.port), timeout=30)
    try:
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        wait_until(lambda: closed_by_peer(silent), 20, "the server to close a socket that sent nothing")
        assert silent.recv(4096) == b""  # closed without an answer: nothing was asked
        reply = b""
        half.settimeout(20)
        while not reply.endswith(b"}"):
            chunk = half.recv(4096)
            if not chunk:
                break
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"header_timeout" in reply, reply[:300]
    finally:
        silent.close()
        half.close()
    # a keep-alive connection's second request has a head deadline too
    conn = socket.create_connection(("127.0.0.1", strict.port), timeout=30)
    try:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = conn.recv(65536)
        while b"\r\n\r\n" not in first or not first.endswith(b"}"):
            first += conn.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        conn.sendall(b"GET /health HTTP/1.1\r\nHo")
        conn.settimeout(20)
        assert conn.recv(65536).startswith(b"HTTP/1.1 408")
    finally:
        conn.close()


def test_the_socket_cap_closes_the_longest_idle_not_the_newcomer(strict):
    idle = [socket.create_connection(("127.0.0.1", strict.port), timeout=30) for _ in range(100)]  # cap: 64
    try:
        status, text = get(strict.port, "/health")
        assert status == 200, text
        wait_until(lambda: closed_by_peer(idle[0]), 10, "the longest-idle socket to be closed")
        assert not closed_by_peer(idle[-1])  # the newest stay
    finally:
        for s in idle:
            s.close()


def test_the_request_limit_counts_requests(strict):
    body = {"prompt": "once upon a time", "max_tokens": 900, "ignore_eos": True}
    streams = [open_stream(strict.port, "/v1/completions", body) for _ in range(2)]  # --max-inflight 2
    try:
        status, headers, err = post(strict.port, "/v1/completions", completion())
        assert status == 503 and headers["Retry-After"] == "1", err
        assert err["error"]["code"] == "too_many_requests" and "--max-inflight" in err["error"]["message"], err
        assert get(strict.port, "/health")[0] == 200  # never counted, never refused
    finally:
        for conn, _ in streams:
            conn.close()

    def answered() -> bool:
        return post(strict.port, "/v1/completions", completion())[0] == 200

    wait_until(answered, 30, "a request to be answered once the streams are gone")


# ---- echo + logprobs: an ordinary request ----------------------------------------------------------
@pytest.fixture(scope="module")
def narrow(bundle, tmp_path_factory):
    srv = ServerProcess(bundle, str(tmp_path_factory.mktemp("logs") / "narrow.log"), "--max-batch-size", "1",
                        "--max-queue", "2")
    yield srv
    srv.stop()


def health(port: int) -> dict:
    status, text = get(port, "/health")
    assert status == 200, text
    return json.loads(text)


def test_echo_logprobs_is_validated_queued_and_bounded(narrow):
    port = narrow.port
    echo = {"prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 2, "echo": True, "logprobs": 1, "ignore_eos": True}
    # validated before anything runs: out-of-vocabulary ids and over-long prompts are 400s
    status, _, err = post(port, "/v1/completions", {**echo, "prompt": [5, 6, 320]})
    assert status == 400 and err["error"]["param"] == "prompt" and "[0, 320)" in err["error"]["message"], err
    status, _, err = post(port, "/v1/completions", {**echo, "prompt": [5] * 1030})
    assert status == 400 and err["error"]["param"] == "prompt" and "max_seq_len is 1024" in err["error"]["message"], err
    # queued like any request: the one slot is held, two wait (/health answers), the next is 429
    hold, _ = open_stream(port, "/v1/completions", {"prompt": "once upon a time", "max_tokens": 1000, "ignore_eos": True})
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(post(port, "/v1/completions", echo))) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: health(port)["queue_depth"] == 2, 30, "two echo requests queued")
        status, headers, err = post(port, "/v1/completions", echo)
        assert status == 429 and err["error"]["code"] == "queue_full", err
        # a queued one whose client leaves is aborted without holding anyone up
        gone = socket.create_connection(("127.0.0.1", port), timeout=30)
        data = json.dumps(echo).encode()
        gone.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        gone.close()
    finally:
        hold.close()
    for t in threads:
        t.join(timeout=60)
    assert [r[0] for r in results] == [200, 200], results
    for _, _, body in results:
        lp = body["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == 7 + 2 and lp["token_logprobs"][0] is None
        assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    wait_until(lambda: (lambda h: h["running"] == h["queue_depth"] == h["kv_blocks_used"] == 0)(health(port)), 30,
               "the server to be idle with its KV pool whole")


def test_echo_logprobs_streamed_equal_the_whole_answer(narrow):
    body = {"prompt": "the cat sat on the mat", "max_tokens": 4, "echo": True, "logprobs": 2, "ignore_eos": True}
    status, _, whole = post(narrow.port, "/v1/completions", body)
    assert status == 200, whole
    from http_client import stream

    chunks = stream(narrow.port, "/v1/completions", body)
    first = chunks[0]["choices"][0]
    assert first["text"] == body["prompt"]  # the echo comes first, with the prompt's logprobs
    got = sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks if c["choices"][0].get("logprobs")), [])
    assert got == whole["choices"][0]["logprobs"]["token_logprobs"]


def test_a_disconnect_never_holds_the_event_loop(bundle):
    """The abort of a request whose client left takes the engine lock; it runs on its own
    thread, so while it waits the server still answers (an in-process server whose engine's
    abort is held at a gate until the test has its /health answer)."""
    import http.client

    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.serve.openai_http import OpenAIServer, ServeConfig

    engine = Engine(bundle, EngineConfig(threads=1))
    gate, entered = threading.Event(), threading.Event()
    abort = engine.abort

    def held_abort(handle) -> None:
        entered.set()
        gate.wait(60)
        abort(handle)

    engine.abort = held_abort
    app = OpenAIServer(engine, ServeConfig(port=0))
    app.bind()
    serving = threading.Thread(target=app.serve_forever, daemon=True)
    serving.start()
    try:
        conn, resp = open_stream(app.port, "/v1/completions", {"prompt": "hold", "max_tokens": 900, "ignore_eos": True})
        resp.readline()
        conn.close()  # the client leaves: its abort waits at the gate
        wait_until(entered.is_set, 30, "the abort to start")
        probe = http.client.HTTPConnection("127.0.0.1", app.port, timeout=10)
        probe.request("GET", "/health")
        answer = probe.getresponse()
        assert answer.status == 200 and not gate.is_set()  # answered while the abort still waits
        probe.close()
    finally:
        gate.set()
        app.shutdown()
        serving.join(timeout=10)
    assert engine.cache.used_blocks == 0


def test_the_chat_path_is_set_up_before_the_first_request(bundle):
    """bind() sets up what the first chat request would otherwise set up in its own time (the
    chat encoder's tokenizer copy, jinja, the tool module: 249 ms of a first TTFT against 16-18 ms
    after); the first chat then encodes with that encoder, and as the engine encodes it."""
    import http.client
    import sys

    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.serve.openai_http import OpenAIServer, ServeConfig

    engine = Engine(bundle, EngineConfig(threads=1))
    app = OpenAIServer(engine, ServeConfig(port=0))
    assert "_chat_encoder" not in engine.__dict__
    app.bind()
    serving = threading.Thread(target=app.serve_forever, daemon=True)
    serving.start()
    try:
        encoder = engine.__dict__.get("_chat_encoder")
        assert encoder is not None and "specbuild.serve.tools" in sys.modules
        messages = [{"role": "user", "content": "hello there"}]
        body = {"messages": messages, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
        conn = http.client.HTTPConnection("127.0.0.1", app.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        answer = json.loads(conn.getresponse().read())
        conn.close()
        assert answer["usage"]["prompt_tokens"] == len(engine.encode_chat(messages, True))
        assert engine.__dict__["_chat_encoder"] is encoder  # the one set up at bind
    finally:
        app.shutdown()
        serving.join(timeout=10)
