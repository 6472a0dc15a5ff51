"""The Triton backend against a real tritonserver (2.51, from the nvidia-pytriton wheel).

One server per module on free loopback ports, started from a repository that
`specbuild triton-repo` writes for a tiny float64 bundle (float64: batch shape cannot move
a greedy token, so texts served in any batch equal `Engine.generate`'s). Clients:
tritonclient over HTTP and gRPC (unary requests go to <name>_plain, which Triton needs for
decoupled models), the gRPC stream, and raw server-sent events from `generate_stream`.
Every wait is bounded; the server's process group is killed in teardown. Tests skip (with
the reason) only when the wheel cannot be had.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(180)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "specbuild"
PLAIN = MODEL + "_plain"
PROMPTS = ["the cat the cat", "Hello world, hello world", "one two three one two three", "abcabcabc",
           "in the end there was", "a b a b a b", "The quick brown fox", "on and on and on"]
MAX_TOKENS = 24
WARM_PROMPT = "seven sheep sleep under seven stars"  # its plain output is the server's warm suffix corpus

tritonclient_http = pytest.importorskip("tritonclient.http", reason="tritonclient[http,grpc] is not installed")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[http,grpc] is not installed")


def load_getter():
    spec = importlib.util.spec_from_file_location("get_tritonserver", os.path.join(REPO_ROOT, "scripts",
                                                                                    "get_tritonserver.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def triton_paths() -> dict:
    getter = load_getter()
    try:
        return getter.ensure()
    except getter.Unavailable as e:
        pytest.skip(f"no tritonserver here: {e}")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    from tiny import make_tiny_hf

    from specbuild.compiler.compile import CompileOptions, compile_bundle

    root = tmp_path_factory.mktemp("triton_bundle")
    hf = make_tiny_hf(str(root / "hf"), scale=4.0)
    return compile_bundle(hf, str(root / "bundle"), CompileOptions(dtype="float64", max_seq_len=1024,
                                                                    max_batch_size=8))


@pytest.fixture(scope="module")
def engine(bundle):
    from specbuild.engine.engine import Engine, EngineConfig

    return Engine(bundle, EngineConfig(threads=1))


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class TritonProcess:
    """tritonserver in its own process group (so its backend stubs die with it)."""

    def __init__(self, paths: dict, repo: str, log_path: str) -> None:
        from specbuild.serve.tritonserver import server_command

        self.log_path = log_path
        for _attempt in range(3):  # a free port may be taken between probing and binding
            self.http, self.grpc, self.metrics = free_ports(3)
            argv, env = server_command(paths, repo, self.http, self.grpc, self.metrics)
            env["OMP_NUM_THREADS"] = "1"
            with open(log_path, "w") as log:
                self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
            self.t_start = time.monotonic()
            if self.wait_ready(deadline=time.monotonic() + 90):
                self.startup_s = time.monotonic() - self.t_start
                return
            if "Address already in use" not in self.output():
                break
        out = self.output()
        self.stop()
        raise AssertionError(f"tritonserver did not become ready:\n{out[-4000:]}")

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if get(self.http, "/v2/health/ready")[0] == 200:
                    return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: the stubs run finalize()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stubs left behind, if any
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(triton_paths, bundle, engine, tmp_path_factory):
    from specbuild.serve.tritonserver import RepoConfig, write_repository

    root = tmp_path_factory.mktemp("triton_repo")
    corpus = root / "warm.jsonl"  # the suffix store's warm corpus: the target's plain output for WARM_PROMPT
    corpus.write_text(json.dumps({"token_ids": reference(engine, [WARM_PROMPT])[0]["token_ids"]}) + "\n")
    write_repository(bundle, str(root / "repo"), RepoConfig(model_name=MODEL, python_env=triton_paths["python_env"],
                                                            threads=1, plain_instances=2,
                                                            telemetry=str(root / "telemetry.db"),
                                                            suffix_store_tokens=5000, suffix_corpus=str(corpus)))
    srv = TritonProcess(triton_paths, str(root / "repo"), str(root / "tritonserver.log"))
    srv.telemetry = str(root / "telemetry.db")
    print(f"tritonserver ready in {srv.startup_s:.1f}s")
    yield srv
    srv.stop()


# ---- helpers ---------------------------------------------------------------------------------
def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def make_inputs(mod, prompt: str, max_tokens: int | None, /, **fields) -> list:
    """tritonclient inputs with the model's types: str -> BYTES, bool -> BOOL, float -> FP32,
    int -> INT32 (seed, random_seed: UINT64); a (array, datatype) pair is sent as given. Every
    tensor gets the batch dimension ([1, ...]): the repository has max_batch_size > 0, as
    TensorRT-LLM's ensemble."""
    out = []

    def add(name, arr, datatype):
        arr = arr.reshape((1,) + arr.shape)
        tensor = mod.InferInput(name, list(arr.shape), datatype)
        tensor.set_data_from_numpy(arr)
        out.append(tensor)

    add("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES")
    if max_tokens is not None:
        add("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")
    for name, value in fields.items():
        if isinstance(value, tuple):
            add(name, *value)
        elif isinstance(value, bool):
            add(name, np.array([value]), "BOOL")
        elif isinstance(value, str):
            add(name, np.array([value.encode()], dtype=np.object_), "BYTES")
        elif isinstance(value, float):
            add(name, np.array([value], dtype=np.float32), "FP32")
        elif name in ("seed", "random_seed"):
            add(name, np.array([value], dtype=np.uint64), "UINT64")
        else:
            add(name, np.array([value], dtype=np.int32), "INT32")
    return out


def reference(engine, prompts: list[str], method: str = "none", max_tokens: int = MAX_TOKENS) -> list[dict]:
    from specbuild.sampling.params import SamplingParams
    from specbuild.engine.sequence import Request
    from specbuild.speculation.config import SpeculationConfig

    spec = SpeculationConfig.make(engine.default_speculation, method=method)
    return engine.generate([Request(prompt=p, sampling=SamplingParams(max_tokens=max_tokens), speculation=spec)
                            for p in prompts])


class GrpcStream:
    """One gRPC stream; responses routed to per-request queues by request id."""

    def __init__(self, port: int) -> None:
        self.client = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{port}")
        self.queues: dict[str, queue.Queue] = {}
        self.errors: queue.Queue = queue.Queue()
        self.client.start_stream(callback=self.on_response)

    def on_response(self, result, error) -> None:
        if error is not None:
            self.errors.put(error)
            return
        self.queues[result.get_response().id].put((time.monotonic(), result))

    def send(self, request_id: str, inputs: list) -> None:
        self.queues[request_id] = queue.Queue()
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)

    def collect(self, request_id: str, timeout: float = 60) -> list[tuple[float, object]]:
        """All responses of one request up to and including the one with the final flag."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"request {request_id} got no final response in {timeout}s ({len(out)} so far)"
            try:
                t, result = self.queues[request_id].get(timeout=min(left, 1.0))
            except queue.Empty:
                assert self.errors.empty(), f"stream error: {self.errors.get()}"
                continue
            out.append((t, result))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def text_of(result) -> str:
    arr = result.as_numpy("text_output")
    return "" if arr is None else b"".join(arr.reshape(-1)).decode()


# ---- no server needed -------------------------------------------------------------------------
def test_repository_files(bundle, tmp_path):
    from click.testing import CliRunner

    from specbuild.cli.main import main

    out = tmp_path / "repo"
    result = CliRunner().invoke(main, ["triton-repo", bundle, "--out", str(out), "--max-queue", "7"])
    assert result.exit_code == 0, result.output
    config = (out / MODEL / "config.pbtxt").read_text()
    assert "decoupled: true" in config and 'backend: "python"' in config
    for name, dtype in (("text_input", "TYPE_STRING"), ("max_tokens", "TYPE_INT32"), ("seed", "TYPE_UINT64"),
                        ("stop_words", "TYPE_STRING"), ("acceptance_rate", "TYPE_FP32")):
        assert f'name: "{name}" data_type: {dtype}' in config
    assert '{ name: "stop_words" data_type: TYPE_STRING dims: [ -1 ] optional: true }' in config
    assert f'string_value: "{os.path.abspath(bundle)}"' in config and 'string_value: "7"' in config
    assert "decoupled: false" in (out / PLAIN / "config.pbtxt").read_text()
    assert (out / MODEL / "1" / "model.py").read_text() == open(
        os.path.join(REPO_ROOT, "specbuild", "serve", "tritonserver_model.py")).read()
    bad = CliRunner().invoke(main, ["triton-repo", str(tmp_path / "missing"), "--out", str(out)])
    assert bad.exit_code == 2 and "error:" in bad.output
    # the engine comes from open_engine, with --backend as `generate` takes it (default auto)
    assert 'key: "engine_factory" value: { string_value: "specbuild.backends.select:open_engine" }' in config
    assert 'key: "backend" value: { string_value: "auto" }' in config
    assert '{ name: "content_type" data_type: TYPE_STRING dims: [ 1 ] optional: true }' in config
    result = CliRunner().invoke(main, ["triton-repo", bundle, "--out", str(out), "--backend", "torch"])
    assert result.exit_code == 0, result.output
    assert 'key: "backend" value: { string_value: "torch" }' in (out / MODEL / "config.pbtxt").read_text()
    assert 'key: "compile"' not in (out / MODEL / "config.pbtxt").read_text()
    result = CliRunner().invoke(main, ["triton-repo", bundle, "--out", str(out), "--compile"])
    assert result.exit_code == 0 and 'key: "compile" value: { string_value: "1" }' in (out / MODEL / "config.pbtxt").read_text()
    bad = CliRunner().invoke(main, ["triton-repo", bundle, "--out", str(out), "--backend", "tensorrt-llm",
                                    "--engine-factory", "specbuild.engine.engine:Engine"])
    assert bad.exit_code == 2 and "applies to the default engine factory" in bad.output
    from specbuild.backends.select import BACKEND_CHOICES
    from specbuild.serve.tritonserver_repo import BACKEND_CHOICES as REPO_CHOICES

    assert REPO_CHOICES == BACKEND_CHOICES


def test_parse_inputs_values():
    from specbuild.serve.tritonserver_model import InputError, parse_inputs

    parsed = parse_inputs({"text_input": np.array([b"hi"], dtype=object), "max_tokens": np.array([5], np.int32),
                           "top_p": np.array([0.0], np.float32), "stop_words": np.array([b"", b"x"], dtype=object),
                           "speculation": np.array([b"ngram"], dtype=object), "gamma": np.array([3], np.int32),
                           "stream": np.array([True]), "content_type": np.array([b"code"], dtype=object)})
    assert parsed.content_type == "code"
    assert parsed.prompt == "hi" and parsed.sampling == {"max_tokens": 5, "top_p": 1.0, "stop": ("x",)}
    assert parsed.speculation == {"method": "ngram", "gamma": 3} and parsed.stream and not parsed.perf
    with pytest.raises(InputError, match="max_tokens must hold exactly one element"):
        parse_inputs({"text_input": np.array([b"hi"], dtype=object), "max_tokens": np.array([1, 2], np.int32)})
    with pytest.raises(InputError, match="text_input is not valid UTF-8"):
        parse_inputs({"text_input": np.array([b"\xff"], dtype=object), "max_tokens": np.array([1], np.int32)})


# ---- over real sockets -----------------------------------------------------------------------------
def test_http_and_grpc_plain_requests(server, engine):
    ref = reference(engine, PROMPTS[:2], method="ngram")
    http_client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{server.http}")
    result = http_client.infer(PLAIN, make_inputs(tritonclient_http, PROMPTS[0], MAX_TOKENS, speculation="ngram",
                                                  return_perf_metrics=True))
    assert text_of(result) == ref[0]["text"]
    drafted, accepted = int(result.as_numpy("total_draft_tokens").item()), int(result.as_numpy("total_accepted_draft_tokens").item())
    assert drafted > 0 and 0 < accepted <= drafted
    assert result.as_numpy("acceptance_rate").item() == pytest.approx(accepted / drafted, rel=1e-6)
    grpc_client = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{server.grpc}")
    result = grpc_client.infer(PLAIN, make_inputs(tritonclient_grpc, PROMPTS[1], MAX_TOKENS, speculation="ngram"))
    assert text_of(result) == ref[1]["text"]
    assert result.as_numpy("total_draft_tokens") is None  # perf outputs only when asked
    grpc_client.close()


def test_grpc_stream_streams_increments(server, engine):
    ref = reference(engine, [PROMPTS[1]])[0]
    stream = GrpcStream(server.grpc)
    try:
        stream.send("s1", make_inputs(tritonclient_grpc, PROMPTS[1], MAX_TOKENS, stream=True))
        responses = stream.collect("s1")
    finally:
        stream.close()
    pieces = [text_of(r) for _, r in responses]
    assert len(pieces) > 3, pieces  # increments, not one block
    assert "".join(pieces) == ref["text"]


def test_http_generate_stream_sse(server, engine):
    ref = reference(engine, [PROMPTS[5]])[0]
    conn = http.client.HTTPConnection("127.0.0.1", server.http, timeout=30)
    body = json.dumps({"text_input": PROMPTS[5], "max_tokens": MAX_TOKENS, "stream": True})
    conn.request("POST", f"/v2/models/{MODEL}/generate_stream", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
    events = []
    for raw in resp:  # read line by line as it arrives
        line = raw.decode().strip()
        if line.startswith("data:"):
            events.append(json.loads(line[5:]))
    conn.close()
    assert len(events) > 3 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == ref["text"]


def test_eight_concurrent_speculative_streams(server, engine):
    long = 96  # long enough that a request outlives the others' admission
    refs = reference(engine, PROMPTS, method="ngram", max_tokens=long)
    stream = GrpcStream(server.grpc)
    try:
        for wave in range(2):  # the second wave: the forwarding threads' sends race again (see model.ipc_lock)
            for i, prompt in enumerate(PROMPTS):
                stream.send(f"c{wave}-{i}", make_inputs(tritonclient_grpc, prompt, long, stream=True,
                                                        speculation="ngram", return_perf_metrics=True))
            got = {i: stream.collect(f"c{wave}-{i}") for i in range(len(PROMPTS))}
    finally:
        stream.close()
    total_drafted = total_accepted = 0
    for i, ref in enumerate(refs):
        responses = [r for _, r in got[i]]
        assert "".join(text_of(r) for r in responses) == ref["text"], PROMPTS[i]
        final = responses[-1]
        drafted = int(final.as_numpy("total_draft_tokens").item())
        accepted = int(final.as_numpy("total_accepted_draft_tokens").item())
        rate = float(final.as_numpy("acceptance_rate").item())
        generated = len(ref["token_ids"])
        # each verify pass yields accepted + 1 tokens, so at most generated - 1 accepted drafts
        assert 0 <= accepted <= min(drafted, generated - 1)
        assert rate == pytest.approx(accepted / drafted if drafted else 0.0, rel=1e-6)
        total_drafted, total_accepted = total_drafted + drafted, total_accepted + accepted
    assert total_drafted > 0 and total_accepted > 0
    # the requests were served together (they shared the engine's steps): at some moment
    # at least three of them were between their first and their last response (serial: one)
    spans = [(got[i][0][0], got[i][-1][0]) for i in got]
    assert max(sum(a <= t <= b for a, b in spans) for t, _ in spans) >= 3, spans


def test_malformed_requests_fail_alone(server, engine):
    ref = reference(engine, [PROMPTS[2]], max_tokens=64)[0]
    stream = GrpcStream(server.grpc)
    stream.send("good", make_inputs(tritonclient_grpc, PROMPTS[2], 64, stream=True))
    bad_cases = {
        "type": (dict(max_tokens=None, extra={"max_tokens": (np.array([4.0], np.float32), "FP32")}), "max_tokens"),
        "shape": (dict(max_tokens=None, extra={"max_tokens": (np.array([4, 4], np.int32), "INT32")}), "max_tokens"),
        "temperature": (dict(max_tokens=8, extra={"temperature": -1.0}), "temperature"),
        "speculation": (dict(max_tokens=8, extra={"speculation": "bogus"}), "bogus"),
        "gamma": (dict(max_tokens=8, extra={"speculation": "ngram", "gamma": 99}), "gamma"),
    }
    errors = {}

    def send_bad(name, case):
        client = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{server.grpc}")
        try:
            client.infer(PLAIN, make_inputs(tritonclient_grpc, "x y", case["max_tokens"], **case["extra"]))
            errors[name] = None
        except tritonclient_grpc.InferenceServerException as e:
            errors[name] = str(e)
        finally:
            client.close()

    threads = [threading.Thread(target=send_bad, args=(n, c)) for n, (c, _) in bad_cases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        responses = stream.collect("good")
    finally:
        stream.close()
    for name, (_, needle) in bad_cases.items():
        assert errors.get(name) and needle in errors[name], (name, errors.get(name))
        assert "INVALID_ARGUMENT" in errors[name], (name, errors[name])  # the code survives the BLS hop
    assert "".join(text_of(r) for _, r in responses) == ref["text"]
    # and a bad request through the decoupled model's own stream is answered too
    status, body = post(server.http, f"/v2/models/{MODEL}/generate", {"text_input": "x", "max_tokens": 0})
    assert status == 400 and "max_tokens=0" in json.loads(body)["error"]


def post(port: int, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_metrics_endpoint(server):
    status, body = post(server.http, f"/v2/models/{MODEL}/generate",
                        {"text_input": PROMPTS[1], "max_tokens": 16, "speculation": "ngram"})
    assert status == 200, body
    status, body = get(server.metrics, "/metrics")
    text = body.decode()
    assert status == 200
    assert f'nv_inference_request_success{{model="{MODEL}",version="1"}}' in text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("specbuild_")}
    assert values["specbuild_generated_tokens_total"] >= 16 and values["specbuild_draft_tokens_total"] > 0
    assert 0 < values["specbuild_accepted_draft_tokens_total"] <= values["specbuild_draft_tokens_total"]


def test_parse_response_format():
    from specbuild.serve.tritonserver_model import MAX_FORMAT_CHARS, InputError, parse_inputs

    base = {"text_input": np.array([b"hi"], dtype=object), "max_tokens": np.array([5], np.int32)}
    fmt = b'{"type": "regex", "regex": "(yes|no)"}'
    assert parse_inputs({**base, "response_format": np.array([fmt], dtype=object)}).response_format == \
        {"type": "regex", "regex": "(yes|no)"}
    with pytest.raises(InputError, match="response_format is not JSON"):
        parse_inputs({**base, "response_format": np.array([b"{"], dtype=object)})
    with pytest.raises(InputError, match=f"at most {MAX_FORMAT_CHARS}"):
        parse_inputs({**base, "response_format": np.array([b" " * (MAX_FORMAT_CHARS + 1)], dtype=object)})


def test_structured_output_over_triton(server, engine):
    """response_format through the Triton model: the answer matches the regex, and is the engine's
    constrained greedy answer while prompt lookup speculates."""
    pytest.importorskip("llguidance")
    from specbuild.engine.sequence import Request
    from specbuild.sampling.params import SamplingParams

    fmt = {"type": "regex", "regex": "(yes|no|maybe)[.!]"}
    ref = engine.generate([Request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS),
                                   response_format=fmt)])[0]
    client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{server.http}")
    result = client.infer(PLAIN, make_inputs(tritonclient_http, PROMPTS[0], MAX_TOKENS, speculation="ngram",
                                             response_format=json.dumps(fmt)))
    assert text_of(result) == ref["text"] and ref["text"] in ("yes.", "yes!", "no.", "no!", "maybe.", "maybe!")
    with pytest.raises(Exception, match="response_format"):
        client.infer(PLAIN, make_inputs(tritonclient_http, PROMPTS[0], MAX_TOKENS, response_format='{"type": "xml"}'))


def test_content_type_and_telemetry_store(server, engine):
    """content_type reaches the engine's gamma policy lookup and the model's telemetry store."""
    import sqlite3

    ref = reference(engine, [PROMPTS[0]], method="ngram")
    client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{server.http}")
    result = client.infer(PLAIN, make_inputs(tritonclient_http, PROMPTS[0], MAX_TOKENS, speculation="ngram",
                                             content_type="legal", return_perf_metrics=True))
    assert text_of(result) == ref[0]["text"]
    # what this request drafted, as the model reported it (the reference engine's count may differ:
    # each engine's batch fit cuts drafts on the row price its own steps' times taught it)
    drafted = int(result.as_numpy("total_draft_tokens").reshape(-1)[0])
    with pytest.raises(tritonclient_http.InferenceServerException, match="content_type='Bad!'"):
        client.infer(PLAIN, make_inputs(tritonclient_http, "x", 4, content_type="Bad!"))
    deadline, row = time.monotonic() + 30, None
    while row is None and time.monotonic() < deadline:  # the writer commits within ~0.2 s
        with sqlite3.connect(server.telemetry, timeout=5) as conn:
            row = conn.execute("SELECT source, content_type_source, status, generated_tokens, total_drafted FROM "
                               "speculation_sessions WHERE content_type = 'legal' AND status = 'completed'").fetchone()
        time.sleep(0.1)
    assert row is not None and row[:3] == ("triton", "request", "completed")
    assert row[3] == len(ref[0]["token_ids"]) and row[4] == drafted > 0


def test_suffix_served_by_name(server, engine):
    """`speculation: suffix` over Triton's HTTP endpoint: the engine's greedy text, drafts
    proposed and accepted (a prompt that repeats itself)."""
    prompt = PROMPTS[2]
    ref = reference(engine, [prompt], method="suffix")[0]
    client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{server.http}")
    result = client.infer(PLAIN, make_inputs(tritonclient_http, prompt, MAX_TOKENS, speculation="suffix",
                                             return_perf_metrics=True))
    assert text_of(result) == ref["text"] == reference(engine, [prompt])[0]["text"]
    drafted = int(result.as_numpy("total_draft_tokens").reshape(-1)[0])
    accepted = int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
    assert drafted > 0 and 0 < accepted <= drafted


def test_suffix_store_settings_are_model_parameters(bundle, tmp_path):
    """--suffix-* on triton-repo become model parameters of the same names, which the model
    reads into EngineConfig; the warm corpus is checked (and its size limited) when written."""
    from click.testing import CliRunner

    from specbuild.cli.main import main
    from specbuild.engine.engine import EngineConfig
    from specbuild.serve.tritonserver_model import config_parameters, suffix_settings
    from specbuild.speculation.proposers.suffix import CORPUS_MAX_BYTES

    corpus = tmp_path / "warm.jsonl"
    corpus.write_text('{"token_ids": [5, 6, 7]}\n')
    out = tmp_path / "repo"
    result = CliRunner().invoke(main, ["triton-repo", bundle, "--out", str(out), "--suffix-store-tokens", "5000",
                                       "--suffix-scope", "content_type", "--suffix-prompts", "--suffix-corpus",
                                       str(corpus)])
    assert result.exit_code == 0, result.output
    config = (out / MODEL / "config.pbtxt").read_text()
    params = {}
    for line in config.splitlines():
        if line.startswith("parameters {"):
            key = line.split('key: "', 1)[1].split('"', 1)[0]
            params[key] = {"string_value": line.split('string_value: "', 1)[1].rsplit('"', 1)[0]}
    settings = suffix_settings(config_parameters({"parameters": params}))
    assert settings == {"suffix_store_tokens": 5000, "suffix_scope": "content_type", "suffix_prompts": True,
                        "suffix_corpus": str(corpus.resolve())}
    cfg = EngineConfig(**settings)
    assert (cfg.suffix_store_tokens, cfg.suffix_scope, cfg.suffix_prompts) == (5000, "content_type", True)
    # a setting on by default is written only when turned off, and read back off
    off = tmp_path / "repo-off"
    result = CliRunner().invoke(main, ["triton-repo", bundle, "--out", str(off), "--no-suffix-answers"])
    assert result.exit_code == 0, result.output
    text = (off / MODEL / "config.pbtxt").read_text()
    assert 'key: "suffix_answers"' in text
    params = {line.split('key: "', 1)[1].split('"', 1)[0]: {"string_value": line.split('string_value: "', 1)[1].rsplit('"', 1)[0]}
              for line in text.splitlines() if line.startswith("parameters {")}
    read = suffix_settings(config_parameters({"parameters": params}))
    assert read["suffix_answers"] is False and "suffix_prompts" not in read
    assert EngineConfig(**read).suffix_answers is False
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(CORPUS_MAX_BYTES + 1)
    bad = CliRunner().invoke(main, ["triton-repo", bundle, "--out", str(out), "--suffix-corpus", str(big)])
    assert bad.exit_code == 2 and f"over the limit of {CORPUS_MAX_BYTES} bytes" in bad.output, bad.output
    bad = CliRunner().invoke(main, ["triton-repo", bundle, "--out", str(out), "--suffix-store-tokens", "-1"])
    assert bad.exit_code == 2 and "suffix_store_tokens=-1" in bad.output, bad.output


def test_no_prefix_cache_is_a_model_parameter(bundle, tmp_path):
    from click.testing import CliRunner

    from specbuild.cli.main import main
    from specbuild.engine.engine import EngineConfig
    from specbuild.serve.tritonserver_model import config_parameters, engine_flags

    def flags(*args):
        out = tmp_path / f"repo{len(args)}"
        result = CliRunner().invoke(main, ["triton-repo", bundle, "--out", str(out), *args])
        assert result.exit_code == 0, result.output
        params = {}
        for line in (out / MODEL / "config.pbtxt").read_text().splitlines():
            if line.startswith("parameters {"):
                key = line.split('key: "', 1)[1].split('"', 1)[0]
                params[key] = {"string_value": line.split('string_value: "', 1)[1].rsplit('"', 1)[0]}
        return engine_flags(config_parameters({"parameters": params}))

    assert "prefix_cache" not in flags() and EngineConfig(**flags()).prefix_cache
    off = flags("--no-prefix-cache", "--compile")
    assert off["compile"] is True and off["prefix_cache"] is False and not EngineConfig(**off).prefix_cache


def test_the_warm_suffix_store_drafts_a_first_request(server, engine, bundle):
    """The server's engine loaded the warm corpus (a model parameter): the first request for
    WARM_PROMPT drafts from it and accepts more than a cold engine does; the text is unchanged."""
    from specbuild.engine.engine import Engine, EngineConfig

    cold = reference(Engine(bundle, EngineConfig(threads=1)), [WARM_PROMPT], method="suffix")[0]
    client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{server.http}")
    result = client.infer(PLAIN, make_inputs(tritonclient_http, WARM_PROMPT, MAX_TOKENS, speculation="suffix",
                                             return_perf_metrics=True))
    assert text_of(result) == cold["text"] == reference(engine, [WARM_PROMPT])[0]["text"]
    accepted = int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
    assert accepted > cold["stats"]["accepted"], (accepted, cold["stats"])


# ---- TensorRT-LLM ensemble clients ---------------------------------------------------------------
def test_tensorrt_llm_ensemble_client_shapes_and_inputs(server, engine):
    """What a client written for TensorRT-LLM's ensemble sends ([1, 1] tensors, the ensemble's
    sampling and output inputs, genai-perf's exclude_input_in_output), answered as it expects."""
    from specbuild.sampling.params import SamplingParams
    from specbuild.engine.sequence import Request

    prompt = PROMPTS[1]
    end = int(engine.eos_ids[0])
    # min_length 1 masks the end token at the first position: its logprob is of that distribution
    ref = engine.generate([Request(prompt=prompt, logprobs=0, sampling=SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=1, min_tokens_ids=tuple(engine.eos_ids) + (end,), stop_token_ids=(end,)))])[0]
    trt = dict(exclude_input_in_output=True, return_log_probs=True, beam_width=1, random_seed=7, top_k=0, top_p=0.0,
               temperature=0.0, repetition_penalty=1.0, length_penalty=1.0, presence_penalty=0.0,
               frequency_penalty=0.0, min_length=1, pad_id=2, end_id=end,
               return_context_logits=False, return_generation_logits=False,
               bad_words=(np.array([b""], dtype=np.object_), "BYTES"),
               stop_words=(np.array([b""], dtype=np.object_), "BYTES"))
    client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{server.http}")
    result = client.infer(PLAIN, make_inputs(tritonclient_http, prompt, MAX_TOKENS, **trt))
    out = result.as_numpy("text_output")
    assert out.shape == (1, 1) and text_of(result) == ref["text"]
    lps = result.as_numpy("output_log_probs")
    assert lps.shape == (1, 1, MAX_TOKENS)
    want = [x["logprob"] for x in ref["logprobs"]]
    assert np.allclose(lps.reshape(-1), want, atol=1e-5)
    assert result.as_numpy("cum_log_probs").reshape(-1)[0] == pytest.approx(sum(want), abs=1e-4)
    # exclude_input_in_output false (the ensemble's default): the prompt comes first
    result = client.infer(PLAIN, make_inputs(tritonclient_http, prompt, MAX_TOKENS, exclude_input_in_output=False,
                                             temperature=0.0))
    assert text_of(result) == prompt + ref["text"]
    # repetition_penalty: over the prompt's tokens (the engine's encoding) and the output's, as the ensemble's
    ids = engine.encode(prompt)
    rep = engine.generate([Request(prompt_ids=ids, sampling=SamplingParams(
        max_tokens=MAX_TOKENS, repetition_penalty=1.3, repetition_ids=tuple(ids)))])[0]
    result = client.infer(PLAIN, make_inputs(tritonclient_http, prompt, MAX_TOKENS, exclude_input_in_output=True,
                                             temperature=0.0, repetition_penalty=1.3))
    assert text_of(result) == rep["text"]
    # the gRPC stream (genai-perf --service-kind triton --backend tensorrtllm --streaming)
    stream = GrpcStream(server.grpc)
    try:
        stream.send("trt", make_inputs(tritonclient_grpc, prompt, MAX_TOKENS, stream=True, exclude_input_in_output=True,
                                       temperature=0.0))
        responses = stream.collect("trt")
    finally:
        stream.close()
    assert "".join(text_of(r) for _, r in responses) == ref["text"] and len(responses) > 2
    # what is not served is refused by name; a batch of two is refused with the limit
    for bad, needle in ((dict(beam_width=4), "beam_width=4"), (dict(length_penalty=1.2), "length_penalty"),
                        (dict(bad_words=(np.array([b"cat"], dtype=np.object_), "BYTES")), "bad_words")):
        with pytest.raises(tritonclient_http.InferenceServerException, match=needle):
            client.infer(PLAIN, make_inputs(tritonclient_http, prompt, 4, **bad))
    two = [tritonclient_http.InferInput("text_input", [2, 1], "BYTES"), tritonclient_http.InferInput("max_tokens", [2, 1], "INT32")]
    two[0].set_data_from_numpy(np.array([[b"a"], [b"b"]], dtype=np.object_))
    two[1].set_data_from_numpy(np.array([[4], [4]], dtype=np.int32))
    with pytest.raises(tritonclient_http.InferenceServerException, match="batch size 1"):
        client.infer(PLAIN, two)


# ---- tool calling -----------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["n"],
        "additionalProperties": False}}}]


def test_tool_calls(server, engine):
    """The tools input: text_input is the user's turn, the calls come back in tool_calls as
    the HTTP chat endpoint answers them (unary HTTP and the gRPC stream), a named choice
    holds, and bad tool inputs are refused naming the input."""
    pytest.importorskip("llguidance")
    from specbuild.bench.structured import validates
    from specbuild.serve.openai_http import ChatRequest, OpenAIServer

    prompt = PROMPTS[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    def http_answer(choice):  # what the HTTP chat endpoint's parsing gives, run in-process
        body = ChatRequest.model_validate({"messages": [{"role": "user", "content": prompt}], "tools": TOOLS,
                                           "tool_choice": choice, "max_tokens": 200, "temperature": 0})
        call = OpenAIServer(engine).parse(body, "chat")
        out = engine.generate([call.request])[0]

        class Seq:
            text, output_ids, finish_reason = out["text"], out["token_ids"], out["finish_reason"]

        return call.tools.final_choice(call, Seq(), 0, None)["message"]

    def calls(text: str) -> list[tuple[str, str]]:
        return [(c["function"]["name"], c["function"]["arguments"]) for c in json.loads(text)]

    ref = http_answer("required")
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in ref["tool_calls"]]
    assert want and all(validates(args, schemas[name]) == (True, "") for name, args in want)
    client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{server.http}")
    kw = dict(tools=json.dumps(TOOLS), tool_choice="required", temperature=0.0)
    result = client.infer(PLAIN, make_inputs(tritonclient_http, prompt, 200, **kw))
    assert text_of(result) == "" and calls(b"".join(result.as_numpy("tool_calls").reshape(-1)).decode()) == want
    stream = GrpcStream(server.grpc)
    try:
        stream.send("tools", make_inputs(tritonclient_grpc, prompt, 200, stream=True, **kw))
        responses = [r for _, r in stream.collect("tools")]
    finally:
        stream.close()
    assert "".join(text_of(r) for r in responses) == ""
    final = [r.as_numpy("tool_calls") for r in responses if r.as_numpy("tool_calls") is not None]
    assert len(final) == 1 and calls(b"".join(final[0].reshape(-1)).decode()) == want
    named = http_answer({"type": "function", "function": {"name": "pick"}})
    result = client.infer(PLAIN, make_inputs(tritonclient_http, prompt, 200, **{**kw, "tool_choice": "pick"}))
    got = calls(b"".join(result.as_numpy("tool_calls").reshape(-1)).decode())
    assert {n for n, _ in got} == {"pick"} and got == [(c["function"]["name"], c["function"]["arguments"])
                                                       for c in named["tool_calls"]]
    for bad, needle in ((dict(kw, tool_choice="nope"), "nope"), (dict(kw, tools="{}"), "input tools must be a JSON array"),
                        (dict(tool_choice="required"), "tool_choice needs the tools input")):
        with pytest.raises(tritonclient_http.InferenceServerException, match=needle):
            client.infer(PLAIN, make_inputs(tritonclient_http, prompt, 20, **bad))


def test_a_second_turn_reuses_the_prefix_over_triton(server, bundle):
    """The engine model keeps automatic prefix caching on (triton-repo's default): a prompt that
    begins with an earlier one reuses its blocks (TensorRT-LLM's kv_cache_reused_blocks
    output) and answers what an engine without the cache answers."""
    from specbuild.engine.engine import Engine, EngineConfig

    off = Engine(bundle, EngineConfig(threads=1, prefix_cache=False))
    first = " ".join(f"item{(i * 5) % 17}" for i in range(30))
    second = first + " and then the next question"
    client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{server.http}")
    blocks = []
    for prompt in (first, second):
        result = client.infer(PLAIN, make_inputs(tritonclient_http, prompt, MAX_TOKENS, return_perf_metrics=True))
        assert text_of(result) == reference(off, [prompt])[0]["text"]
        blocks.append([int(result.as_numpy(k).item()) for k in
                       ("kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks")])
    prompt_tokens = len(off.tokenizer.encode(first))
    assert blocks[1][0] >= prompt_tokens // 16 - 1 > 0, blocks
    assert all(reused + new == total for reused, new, total in blocks)
