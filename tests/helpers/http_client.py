"""HTTP client helpers for tests of a real server over loopback sockets (http.client only):
GET/POST, server-sent event streams, Prometheus text parsing, and bounded waits for a state."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import json
import math
import re
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    except OSError:
        return 0, ""
    finally:
        conn.close()


def post(port: int, path: str, body, raw: bytes | None = None) -> tuple[int, "http.client.HTTPMessage", dict]:
    """(status, headers (case-insensitive, as HTTP names are), JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.headers, json.loads(resp.read())
    finally:
        conn.close()


def open_stream(port: int, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.getheader("Content-Type") == "text/event-stream"
    return conn, resp


def next_event(resp: http.client.HTTPResponse):
    """The next SSE `data:` payload (dict, or the string "[DONE]"); None at end of body."""
    while True:
        line = resp.readline()
        if not line:
            return None
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[6:].decode()
            return payload if payload == "[DONE]" else json.loads(payload)


def stream(port: int, path: str, body: dict) -> list:
    conn, resp = open_stream(port, path, body)
    events = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ev = next_event(resp)
        if ev is None:
            break
        events.append(ev)
    conn.close()
    assert events and events[-1] == "[DONE]", events[-3:]
    return events[:-1]


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Strict parse of the Prometheus text format; checks TYPE lines and histogram shape."""
    types: dict[str, str] = {}
    samples: dict[tuple[str, tuple], float] = {}
    sample_re = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
            continue
        m = sample_re.match(line)
        assert m, f"unparsable metrics line {line!r}"
        name, labels_text, value = m.groups()
        labels = tuple(label_re.findall(labels_text or ""))
        assert "".join(f'{k}="{v}",' for k, v in labels).rstrip(",") == (labels_text or ""), line
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"{name} has no TYPE line"
        samples[(name, labels)] = float(value)
    for name, kind in types.items():
        if kind == "histogram":
            buckets = [(float(dict(k[1])["le"]), v) for k, v in samples.items() if k[0] == name + "_bucket"]
            buckets.sort()
            counts = [v for _, v in buckets]
            assert counts == sorted(counts) and buckets[-1][0] == math.inf, name
            assert buckets[-1][1] == samples[(name + "_count", ())], name
    return samples


def metric(port: int, name: str, **labels) -> float:
    status, text = get(port, "/metrics")
    assert status == 200
    return parse_metrics(text).get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)



# ---- `specbuild serve` in a subprocess ----------------------------------------------------------
class ServerProcess:
    """`specbuild serve` on a free loopback port; the port is read from its output. `env`: the
    subprocess's environment (default: this one's); `timeout`: seconds until it prints its URL;
    `cwd`: its working directory, which `python -c` puts first on sys.path (another tree's, to
    run that tree's code)."""

    def __init__(self, bundle: str, log_path: str, *args: str, env: dict | None = None, timeout: float = 60,
                 cwd: str = REPO) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        # the console script's entry point (not `-m specbuild.cli`, which imports cli twice)
        cmd = [sys.executable, "-c", "from specbuild.cli import main; main()", "serve", bundle, "--host", "127.0.0.1", "--port", "0",
               "--threads", "1", "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        self.port = self._wait_for_url(deadline=time.monotonic() + timeout)
        deadline = time.monotonic() + 10
        while get(self.port, "/health")[0] != 200:
            assert time.monotonic() < deadline, "/health did not answer 200"
            time.sleep(0.05)

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def _wait_for_url(self, deadline: float) -> int:
        while time.monotonic() < deadline:
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", self.output())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"server printed no URL in time:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


