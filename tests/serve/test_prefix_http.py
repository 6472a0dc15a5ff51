"""Prefix caching over HTTP: `specbuild serve` as users start it, with and without
--no-prefix-cache, on a row-invariant tiny bundle (int4, int8 activations): usage's
prompt_tokens_details.cached_tokens, cache_salt, identical text and logprobs, /metrics."""

from __future__ import annotations

import json

import pytest
from http_client import ServerProcess, get, parse_metrics, post
from tiny import draft_pair_bundle

SYSTEM = list(range(40, 120))  # 80 tokens: 5 full blocks of 16


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return draft_pair_bundle(tmp_path_factory.mktemp("prefix_http"), noise=0.05, quantize="int4", activations="int8",
                             max_seq_len=512)


@pytest.fixture(scope="module")
def servers(bundle, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    on = ServerProcess(bundle, str(logs / "on.log"))
    try:
        off = ServerProcess(bundle, str(logs / "off.log"), "--no-prefix-cache")
    except BaseException:
        on.stop()
        raise
    yield on, off
    on.stop()
    off.stop()


def complete(port: int, prompt: list[int], **fields) -> dict:
    body = {"model": "bundle", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2, **fields}
    status, _, out = post(port, "/v1/completions", body)
    assert status == 200, out
    return out


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_second_request_reuses_the_first_and_answers_the_same(servers):
    on, off = servers
    for srv in servers:
        first = complete(srv.port, SYSTEM + [5, 6, 7])
        assert cached(first) == 0
    got = complete(on.port, SYSTEM + [9, 9, 8, 7])
    want = complete(off.port, SYSTEM + [9, 9, 8, 7])
    assert cached(got) == 80 and cached(want) == 0
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
    # speculation on top of the reused prefix
    spec = complete(on.port, SYSTEM + [9, 9, 8, 7], speculation={"method": "draft", "gamma": 3}, max_tokens=32)
    plain = complete(off.port, SYSTEM + [9, 9, 8, 7], max_tokens=32)
    assert cached(spec) >= 80 and spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec["usage"]["drafted_tokens"] > 0 and spec["usage"]["accepted_tokens"] > 0


def test_n_choices_count_the_prompts_cached_tokens_once(servers):
    """Sampled choices with and without the cache give the same text. Their draft depth is fixed:
    an adaptive depth follows each server's measured step costs, and a sampled request's exact
    tokens follow its drafts (its distribution is the target's either way), so two servers could
    draft differently and sample other tokens (seen once in a dozen runs)."""
    on, off = servers
    complete(on.port, SYSTEM + [1])
    fixed = {"method": "draft", "gamma": 3, "gamma_min": 3, "gamma_max": 3}
    got = complete(on.port, SYSTEM + [2, 3], n=3, temperature=0.8, seed=5, speculation=fixed)
    want = complete(off.port, SYSTEM + [2, 3], n=3, temperature=0.8, seed=5, speculation=fixed)
    assert cached(got) == 80 and cached(want) == 0
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    assert got["usage"]["drafted_tokens"] > 0 and got["usage"]["accepted_tokens"] > 0


def test_echo_with_logprobs_scores_the_whole_prompt(servers):
    on, off = servers
    complete(on.port, SYSTEM + [1])
    got = complete(on.port, SYSTEM + [4, 4], echo=True, max_tokens=3)
    want = complete(off.port, SYSTEM + [4, 4], echo=True, max_tokens=3)
    assert cached(got) == 0  # prompt logprobs come from the request's own rows
    assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
    assert len(got["choices"][0]["logprobs"]["token_logprobs"]) == len(SYSTEM) + 2 + 3


def test_cache_salt_keeps_tenants_apart(servers):
    on, _ = servers
    prompt = [7, 8, 9, 10] * 12 + [3]
    assert cached(complete(on.port, prompt, cache_salt="tenant-a")) == 0
    assert cached(complete(on.port, prompt, cache_salt="tenant-b")) == 0
    assert cached(complete(on.port, prompt)) == 0
    assert cached(complete(on.port, prompt, cache_salt="tenant-a")) == 48
    for bad, why in (("", "at least 1 character"), ("x" * 257, "at most 256 characters")):
        status, _, out = post(on.port, "/v1/completions", {"model": "bundle", "prompt": prompt, "cache_salt": bad})
        assert status == 400 and "cache_salt" in out["error"]["message"] and why in out["error"]["message"], out


def test_metrics_report_the_hit_rate(servers):
    on, off = servers
    complete(on.port, SYSTEM + [1])
    complete(on.port, SYSTEM + [1, 2])
    status, text = get(on.port, "/metrics")
    assert status == 200
    samples = {name: v for (name, _), v in parse_metrics(text).items()}
    assert samples["specbuild_prefix_cache_hit_tokens_total"] >= 80
    assert samples["specbuild_prefix_cache_queried_tokens_total"] >= samples["specbuild_prefix_cache_hit_tokens_total"]
    assert 0 < samples["specbuild_prefix_cache_hit_rate"] <= 1
    assert samples["specbuild_prefix_cache_blocks"] >= 5
    status, health = get(on.port, "/health")
    assert status == 200 and json.loads(health)["prefix_cache"]["hit_tokens"] >= 80
    _, text = get(off.port, "/metrics")
    off_samples = {name: v for (name, _), v in parse_metrics(text).items()}
    assert off_samples["specbuild_prefix_cache_hit_tokens_total"] == 0
