"""HTTP client helpers for tests of a real server over loopback sockets (http.client only):
GET/POST, server-sent event streams, Prometheus text parsing, and bounded waits for a state."""

from __future__ import annotations

import http.client
import json
import math
import re
import time


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

