"""What the scripts share that the library does not provide: a loopback HTTP client with
server-sent events, tiny random bundles, the machine's lscpu lines.

From the library instead: percentiles (`specbuild.bench.served.pct`), the held-out Spec-Bench
prompts (`specbuild.bench.specbench.held_out_questions`, `specbuild.bench.served.held_out_prompts`),
stopping a server's process group (`specbuild.bench.served.stop_process_group`), the Spec-Bench
rows and their table (`specbuild bench`, `specbuild.bench.run`).

A script imports it as `from _common import ...`: Python puts a script's own folder first on
sys.path. tests/test_scripts.py fails when a script defines one of these helpers again.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from typing import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # this tree's specbuild, not an installed copy from another checkout
    sys.path.insert(1, REPO)
HOST = "127.0.0.1"


# ---- HTTP over the loopback ------------------------------------------------------------------
def send(port: int, path: str, body: dict | None = None, raw: bytes | None = None, timeout: float = 120.0,
         host: str = HOST) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """One request: POST `body` as JSON (or `raw` bytes as they are), GET when neither is given.
    Returns the connection (the caller closes it) and the response, unread."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        if body is None and raw is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, body=raw if raw is not None else json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
        return conn, conn.getresponse()
    except BaseException:
        conn.close()
        raise


def get(port: int, path: str, timeout: float = 30.0, host: str = HOST) -> tuple[int, str]:
    """GET: (status, body text); (0, "") when the connection fails."""
    try:
        conn, resp = send(port, path, timeout=timeout, host=host)
    except OSError:
        return 0, ""
    try:
        return resp.status, resp.read().decode()
    except OSError:
        return 0, ""
    finally:
        conn.close()


def get_json(port: int, path: str, timeout: float = 30.0, host: str = HOST) -> dict:
    """GET a JSON document (raises when the server does not answer with one)."""
    conn, resp = send(port, path, timeout=timeout, host=host)
    try:
        return json.loads(resp.read())
    finally:
        conn.close()


def post(port: int, path: str, body: dict | None, raw: bytes | None = None, timeout: float = 120.0,
         host: str = HOST) -> tuple[int, dict]:
    """POST: (status, the JSON answer, or {"raw": its first 200 characters} when it is not JSON)."""
    conn, resp = send(port, path, raw=raw if raw is not None else json.dumps(body).encode(), timeout=timeout, host=host)
    try:
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, {"raw": data[:200].decode(errors="replace")}
    finally:
        conn.close()


def sse_events(resp: http.client.HTTPResponse) -> Iterator[tuple[float, dict | str]]:
    """The `data:` payloads of a server-sent event stream, each with its arrival time
    (time.perf_counter(), taken before it is parsed): a dict, or the string "[DONE]", after
    which the iteration ends (as it does at the end of the body)."""
    while line := resp.readline():
        at = time.perf_counter()
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            yield at, "[DONE]"
            return
        yield at, json.loads(payload)


# ---- tiny random bundles ---------------------------------------------------------------------
def tiny_hf(path: str, **fields) -> str:
    """A random Hugging Face checkpoint (tokenizer included) at `path`: tests/helpers/tiny.py's
    make_tiny_hf with these fields (vocab ~300, 2 layers unless told)."""
    helpers = os.path.join(REPO, "tests", "helpers")
    if helpers not in sys.path:
        sys.path.insert(0, helpers)
    from tiny import make_tiny_hf

    return make_tiny_hf(path, **fields)


def tiny_bundle(root: str, target: str | None = None, draft: str | None = None, draft_noise: float | None = None,
                medusa: bool = False, seed: int = 0, dtype: str = "float64", max_seq_len: int = 512,
                max_batch_size: int = 8) -> str:
    """Compile a tiny bundle into `root`/bundle and return its path. `target`: a checkpoint
    directory (default: tiny_hf at `root`/target, scale 4 for peaked distributions, `seed`);
    `draft`: a draft checkpoint, or with `draft_noise` the target plus that much Gaussian noise
    (accepted often, not always); `medusa`: three Medusa heads trained for a few seconds
    (compiled with the mc_sim_7b_top10 tree)."""
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    target = target or tiny_hf(os.path.join(root, "target"), scale=4.0, seed=seed)
    if draft_noise is not None:
        from tiny import perturbed_copy  # tests/helpers, on sys.path since tiny_hf

        draft = perturbed_copy(target, os.path.join(root, "draft"), noise=draft_noise)
    options = CompileOptions(dtype=dtype, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
    heads = tree = None
    if medusa:
        from specbuild.train.medusa import MedusaTrainConfig, train_medusa

        base = compile_bundle(target, os.path.join(root, "base"), options)
        data = os.path.join(root, "medusa.jsonl")
        with open(data, "w") as f:
            for i in range(12):
                f.write(json.dumps({"prompt": " ".join(f"word{(i * 7 + j) % 23}" for j in range(12))}) + "\n")
        heads, tree = os.path.join(root, "heads"), "mc_sim_7b_top10"
        train_medusa(base, data, heads, MedusaTrainConfig(num_heads=3, steps=60, batch_positions=32, lr=1e-2,
                                                           max_prompts=10, eval_prompts=2, max_answer_tokens=24,
                                                           bf16="off", ignore_eos=True), progress=False,
                     log=lambda m: None)
    return compile_bundle(target, os.path.join(root, "bundle"), options, draft=draft, medusa=heads, tree=tree)


# ---- the machine -----------------------------------------------------------------------------
def lscpu() -> str:
    """lscpu's output ("" where it cannot run)."""
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_info() -> dict:
    """{"model": lscpu's model name, "flags": its flags line}."""
    fields = dict(line.split(":", 1) for line in lscpu().splitlines() if ":" in line)
    return {"model": fields.get("Model name", "unknown").strip(), "flags": fields.get("Flags", "").strip()}
