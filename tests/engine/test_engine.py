"""The engine loop: batching does not change greedy tokens, seeds reproduce, the block pool
stays whole, aborts free blocks, a background loop serves threads, the queue holds what
the batch cannot, finish reasons, and stop strings cut exactly where they begin.

Exactness tests run on the tiny float64 bundle (no float32 near-ties); the SmolLM2 test
runs in float32 and allows a divergence only where the measured batch drift explains it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading

import pytest
import torch

from specbuild.bundle import read_model_config
from specbuild.errors import RequestError
from specbuild.engine.engine import Engine, EngineConfig, load_weights
from specbuild.model.decoder import reference_forward
from specbuild.sampling.params import SamplingParams
from specbuild.engine.sequence import Request

VOCAB = 320


def prompt_ids(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_alone(engine: Engine, requests: list[Request]) -> list[dict]:
    return [engine.generate([r])[0] for r in requests]


def assert_pool_whole(engine: Engine) -> None:
    cache, sched = engine.cache, engine.scheduler
    assert cache.free_blocks == cache.num_blocks, f"{cache.num_blocks - cache.free_blocks} blocks leaked"
    assert not cache.seqs and not sched.running and not sched.waiting and sched.budget_blocks == 0


@pytest.fixture()
def engine64(tiny_bundle_f64) -> Engine:
    return Engine(tiny_bundle_f64, EngineConfig(prefill_chunk=16))


# ---- greedy exactness ---------------------------------------------------------------------

LENGTHS = (3, 11, 27, 40, 1)


def test_greedy_batch_equals_each_prompt_alone(engine64):
    requests = [Request(prompt_ids=prompt_ids(i, n), sampling=greedy(12)) for i, n in enumerate(LENGTHS)]
    alone = run_alone(engine64, requests)
    passes_alone = engine64.scheduler.passes
    engine64.clear_prefix_cache()  # the batch computes its prompts again (the pass counts below)
    batched = engine64.generate(requests)
    passes_batched = engine64.scheduler.passes - passes_alone
    for a, b in zip(alone, batched):
        assert b["token_ids"] == a["token_ids"] and len(a["token_ids"]) == 12
        assert b["text"] == a["text"] and b["finish_reason"] == a["finish_reason"] == "length"
    # prefill chunks (16 tokens a step, shared) ran in the same forwards as other prompts' decodes
    assert passes_batched < passes_alone / 2
    assert batched[3]["stats"]["target_passes"] >= 3 + 11
    assert_pool_whole(engine64)


def test_greedy_equals_reference_loop(engine64, tiny_bundle_f64):
    target = os.path.join(tiny_bundle_f64, "target")
    config, weights = read_model_config(target), load_weights(target, "cpu")
    assert weights["embed"].dtype == torch.float64
    for seed, n in ((7, 5), (8, 33)):
        ids = prompt_ids(seed, n)
        expected = []
        for _ in range(10):
            logits = reference_forward(config, weights, torch.tensor(ids + expected))  # [T, vocab]
            expected.append(int(logits[-1].argmax()))
        got = engine64.generate([Request(prompt_ids=ids, sampling=greedy(10))])[0]
        assert got["token_ids"] == expected


# ---- seeds ---------------------------------------------------------------------------------

def sampled(seed, max_tokens=16, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=0, max_tokens=max_tokens, seed=seed, ignore_eos=True, **kw)


def test_same_seed_same_tokens_alone_or_batched(engine64):
    ids = prompt_ids(3, 9)
    first = engine64.generate([Request(prompt_ids=ids, sampling=sampled(1234))])[0]
    again = engine64.generate([Request(prompt_ids=ids, sampling=sampled(1234))])[0]
    others = [Request(prompt_ids=prompt_ids(10 + i, 5 + 7 * i), sampling=sampled(i)) for i in range(3)]
    in_batch = engine64.generate(others[:2] + [Request(prompt_ids=ids, sampling=sampled(1234))] + others[2:])[2]
    assert first["token_ids"] == again["token_ids"] == in_batch["token_ids"]
    assert first["text"] == in_batch["text"]
    assert first["stats"]["seed"] == 1234
    # top-k / top-p sampling is reproducible too
    warped = sampled(99, top_p=0.9)
    assert (engine64.generate([Request(prompt_ids=ids, sampling=warped)])[0]["token_ids"]
            == engine64.generate([others[0], Request(prompt_ids=ids, sampling=warped)])[1]["token_ids"])


def test_different_seeds_differ(engine64):
    ids = prompt_ids(4, 6)
    outs = engine64.generate([Request(prompt_ids=ids, sampling=sampled(s)) for s in (1, 2, 3)])
    tokens = [tuple(o["token_ids"]) for o in outs]
    assert len(set(tokens)) == 3


def test_unseeded_request_reports_a_reproducing_seed(engine64):
    ids = prompt_ids(5, 8)
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    first, second = engine64.generate([Request(prompt_ids=ids, sampling=unseeded)] * 2)
    seed = first["stats"]["seed"]
    assert isinstance(seed, int) and seed != second["stats"]["seed"]
    redo = engine64.generate([Request(prompt_ids=ids, sampling=sampled(seed))])[0]
    assert redo["token_ids"] == first["token_ids"]


# ---- the block pool -----------------------------------------------------------------------

def test_block_pool_whole_after_1000_short_requests(tiny_bundle):
    engine = Engine(tiny_bundle, EngineConfig(max_batch_size=8, prefill_chunk=32, block_size=8))
    rng = random.Random(0)
    done = 0
    for rnd in range(125):
        reqs = []
        for _ in range(8):
            mt = rng.randint(1, 4)
            if rng.random() < 0.5:
                params = SamplingParams(max_tokens=mt)
            else:
                params = SamplingParams(temperature=0.8, top_k=rng.choice([0, 20]), max_tokens=mt,
                                        seed=rng.randrange(1 << 30))
            reqs.append((Request(prompt_ids=prompt_ids(rnd * 8 + len(reqs), rng.randint(1, 40)), sampling=params), mt))
        results = engine.generate([r for r, _ in reqs])
        for res, (_, mt) in zip(results, reqs):
            assert res["finish_reason"] in ("length", "stop")
            assert 1 <= len(res["token_ids"]) <= mt
            assert res["finish_reason"] == "stop" or len(res["token_ids"]) == mt
        done += len(results)
        assert engine.cache.free_blocks == engine.cache.num_blocks, f"after round {rnd}"
    assert done == 1000
    assert_pool_whole(engine)


def test_abort_frees_blocks(tiny_bundle_f64):
    engine = Engine(tiny_bundle_f64, EngineConfig(prefill_chunk=16, max_batch_size=2))
    long = engine.submit(Request(prompt_ids=prompt_ids(1, 60), sampling=greedy(50)))
    short = engine.submit(Request(prompt_ids=prompt_ids(2, 10), sampling=greedy(5)))
    queued = engine.submit(Request(prompt_ids=prompt_ids(3, 10), sampling=greedy(5)))
    engine.step()
    engine.step()
    assert 0 < engine.cache.length(long.seq.seq_id) < 60  # the long prompt is mid-prefill
    held = len(engine.cache.seqs[long.seq.seq_id].table)
    free_before = engine.cache.free_blocks
    assert held > 0
    engine.abort(long)
    assert long.seq.seq_id not in engine.cache.seqs
    assert engine.cache.free_blocks == free_before + held
    res = long.result()
    assert res["finish_reason"] == "abort"
    engine.abort(queued)  # still waiting: leaves the queue without ever taking blocks
    assert queued.result()["finish_reason"] == "abort" and queued.seq not in engine.scheduler.waiting
    assert short.result()["finish_reason"] == "length" and len(short.result()["token_ids"]) == 5
    engine.abort(short)  # aborting a finished request changes nothing
    assert short.result()["finish_reason"] == "length"
    assert_pool_whole(engine)


def test_abort_while_decoding(engine64):
    h = engine64.submit(Request(prompt_ids=prompt_ids(6, 20), sampling=greedy(100)))
    streamed = []
    for ev in h:
        streamed += ev.token_ids
        if len(streamed) >= 5:
            engine64.abort(h)
    res = h.result()
    assert res["finish_reason"] == "abort" and 5 <= len(res["token_ids"]) < 100
    assert res["token_ids"] == streamed
    assert_pool_whole(engine64)


# ---- the queue and the background loop ----------------------------------------------------

def test_requests_beyond_max_batch_size_wait_and_complete(tiny_bundle_f64):
    engine = Engine(tiny_bundle_f64, EngineConfig(max_batch_size=2, prefill_chunk=16))
    requests = [Request(prompt_ids=prompt_ids(20 + i, 4 + 5 * i), sampling=greedy(3 + i)) for i in range(5)]
    expected = run_alone(engine, requests)
    handles = [engine.submit(r) for r in requests]
    most = 0
    engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 3
    while engine.has_work():
        most = max(most, len(engine.scheduler.running))
        engine.step()
    assert most == 2
    for h, e in zip(handles, expected):
        r = h.result()
        assert r["token_ids"] == e["token_ids"] and r["finish_reason"] == "length"
    assert_pool_whole(engine)


def test_requests_wait_for_kv_blocks(tiny_bundle_f64):
    """A cache with room for one request at a time serves three, one after another; a
    request that could never fit is refused at submission, naming both sizes."""
    engine = Engine(tiny_bundle_f64, EngineConfig(kv_cache_tokens=64, block_size=16, prefill_chunk=16))
    assert engine.cache.num_blocks == 4
    requests = [Request(prompt_ids=prompt_ids(60 + i, 40), sampling=greedy(10)) for i in range(3)]
    expected = run_alone(engine, requests)
    handles = [engine.submit(r) for r in requests]
    engine.step()
    assert len(engine.scheduler.running) == 1 and len(engine.scheduler.waiting) == 2
    engine.run_until_done()
    assert [h.result()["token_ids"] for h in handles] == [e["token_ids"] for e in expected]
    with pytest.raises(RequestError, match=r"needs \d+ KV blocks .* holds 4"):
        engine.submit(Request(prompt_ids=prompt_ids(70, 40), sampling=greedy(100)))
    assert_pool_whole(engine)


def test_background_loop_serves_concurrent_threads(tiny_bundle_f64):
    engine = Engine(tiny_bundle_f64, EngineConfig(max_batch_size=4, prefill_chunk=16))
    requests = [[Request(prompt_ids=prompt_ids(40 + 3 * t + i, 3 + 4 * i + t), sampling=greedy(6 + t))
                 for i in range(3)] for t in range(4)]
    expected = [run_alone(engine, reqs) for reqs in requests]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def client(t: int) -> None:
        try:
            handles = [engine.submit(r) for r in requests[t]]
            streamed = [tid for ev in handles[0] for tid in ev.token_ids]  # stream one
            results[t] = [h.result() for h in handles]
            assert streamed == results[t][0]["token_ids"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    engine.start()
    try:
        threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert not any(th.is_alive() for th in threads), "a client hung"
    finally:
        engine.stop()
    assert not errors, errors
    for t in range(4):
        assert [r["token_ids"] for r in results[t]] == [e["token_ids"] for e in expected[t]]
    assert_pool_whole(engine)


def test_background_wakes_come_as_the_layer_stack_begins_and_none_is_lost(tiny_bundle_f64):
    """In the loop's thread a waiter's wake is held back until the next forward's layer stack
    begins (the HTTP thread then runs while the stack holds no GIL); the last one, with no
    forward after it, comes when the loop runs out of work. Every event gets its wake."""
    engine = Engine(tiny_bundle_f64, EngineConfig(max_batch_size=4, prefill_chunk=16))
    stack = engine.model.before_stack
    in_stack = threading.local()

    def before_stack() -> None:  # marks the wakes made from the stack's hook
        in_stack.on = True
        try:
            stack()
        finally:
            in_stack.on = False

    engine.model.before_stack = before_stack
    requests = [Request(prompt_ids=prompt_ids(90 + i, 5 + 3 * i), sampling=greedy(8 + 2 * i)) for i in range(3)]
    expected = run_alone(engine, requests)
    engine.start()
    try:
        woken = [threading.Event() for _ in requests]
        calls: list[list[tuple[bool, bool]]] = [[] for _ in requests]  # (from the loop thread, from the hook)
        handles = []
        for i, r in enumerate(requests):
            def wake(i=i) -> None:
                calls[i].append((threading.current_thread() is engine._thread, getattr(in_stack, "on", False)))
                woken[i].set()
            h = engine.submit(r)
            h.listener = wake
            handles.append(h)
        streamed: list[list[int]] = [[] for _ in requests]
        for i, h in enumerate(handles):  # drained through the wakes alone, as the HTTP front end does
            finished = False
            while not finished:
                assert woken[i].wait(timeout=60), f"request {i}: an event without a wake"
                woken[i].clear()
                while (ev := h.get_nowait()) is not None:
                    streamed[i] += ev.token_ids
                    finished = ev.finished
    finally:
        engine.stop()
    assert streamed == [e["token_ids"] for e in expected]
    for i, c in enumerate(calls):
        assert c and all(loop for loop, _ in c), c
        assert sum(hook for _, hook in c) >= 1, c  # some came as a later forward's stack began
    assert not calls[-1][-1][1]  # the last answer's last wake: no forward after it, the idle loop's
    assert_pool_whole(engine)


# ---- finish reasons --------------------------------------------------------------------------

def test_max_tokens_and_max_seq_len(engine64):
    r = engine64.generate([Request(prompt_ids=prompt_ids(1, 4), sampling=greedy(7))])[0]
    assert r["finish_reason"] == "length" and len(r["token_ids"]) == 7
    assert r["stats"]["generated_tokens"] == 7 and r["stats"]["prompt_tokens"] == 4
    limit = engine64.max_seq_len
    r = engine64.generate([Request(prompt_ids=prompt_ids(2, limit - 3), sampling=greedy(100))])[0]
    assert r["finish_reason"] == "length" and len(r["token_ids"]) == 3
    with pytest.raises(RequestError, match=f"max_seq_len is {limit}"):
        engine64.submit(Request(prompt_ids=prompt_ids(3, limit), sampling=greedy(1)))
    with pytest.raises(RequestError, match=r"out of range \[0, 320\)"):
        engine64.submit(Request(prompt_ids=[1, 320], sampling=greedy(1)))
    assert_pool_whole(engine64)


def test_eos_finishes_with_stop(tiny_bundle_f64, tmp_path):
    ids = prompt_ids(11, 12)
    plain = Engine(tiny_bundle_f64).generate([Request(prompt_ids=ids, sampling=greedy(10))])[0]["token_ids"]
    eos = plain[3]
    assert eos not in plain[:3]
    bundle = str(tmp_path / "eos_bundle")
    shutil.copytree(tiny_bundle_f64, bundle)
    meta_path = os.path.join(bundle, "bundle.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["special_tokens"]["eos_token_ids"] = [eos]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    engine = Engine(bundle)
    no_ignore = SamplingParams(max_tokens=10)
    r = engine.generate([Request(prompt_ids=ids, sampling=no_ignore)])[0]
    assert r["finish_reason"] == "stop" and r["token_ids"] == plain[:4]
    r = engine.generate([Request(prompt_ids=ids, sampling=greedy(10))])[0]  # ignore_eos
    assert r["finish_reason"] == "length" and r["token_ids"] == plain
    # a request's own stop token ids act as EOS
    r = Engine(tiny_bundle_f64).generate([Request(prompt_ids=ids, sampling=SamplingParams(
        max_tokens=10, stop_token_ids=(plain[5],)))])[0]
    assert r["finish_reason"] == "stop" and r["token_ids"] == plain[:6]


def clean_window(pieces: list[str]) -> int | None:
    """Index i where pieces i, i+1, i+2 are non-empty, clean text (no U+FFFD)."""
    for i in range(1, len(pieces) - 2):
        window = pieces[i:i + 3]
        if all(p and "\ufffd" not in p for p in window) and "\ufffd" not in "".join(pieces[:i]):
            return i
    return None


def test_stop_string_spanning_tokens_cuts_exactly(engine64):
    """A stop string that starts inside one token's text and ends inside a token two
    later: the text ends exactly where it begins, and nothing of it is streamed."""
    for seed in range(50):
        ids = prompt_ids(100 + seed, 6)
        h = engine64.submit(Request(prompt_ids=ids, sampling=greedy(30)))
        events = list(h)
        pieces = [ev.text for ev in events]
        assert all(len(ev.token_ids) == 1 for ev in events)  # one token per step: piece i is token i
        i = clean_window(pieces)
        if i is not None:
            break
    else:
        pytest.fail("no prompt gave three clean consecutive text pieces")
    full = "".join(pieces)
    assert full == h.result()["text"]
    stop = pieces[i][-1:] + pieces[i + 1] + pieces[i + 2][:1]
    start = full.find(stop)
    assert start >= 0
    h2 = engine64.submit(Request(prompt_ids=ids, sampling=greedy(30, stop=("\x00never", stop))))
    streamed = "".join(ev.text for ev in h2)
    r = h2.result()
    assert r["finish_reason"] == "stop"
    assert r["text"] == streamed == full[:start]
    # generation ended at the token that completed the stop string (at most token i + 2)
    assert len(r["token_ids"]) <= i + 3
    assert r["token_ids"] == h.result()["token_ids"][:len(r["token_ids"])]
    assert_pool_whole(engine64)


# ---- SmolLM2 in float32: batching vs drift ---------------------------------------------------

SMOL_PROMPTS = ["The capital of France is",
                "Here is a short poem about the sea, the wind and the old lighthouse keeper:\n",
                "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


@pytest.mark.integration
def test_smollm2_batch_equals_alone_up_to_measured_drift(smollm2_bundle):
    engine = Engine(smollm2_bundle, EngineConfig(kv_cache_tokens=1024))
    rows: list[torch.Tensor] = []
    forward = engine.model.forward

    def recording_forward(batch, cache, **kw):
        out = forward(batch, cache, **kw)
        rows.append(out.logits.clone())  # [R, vocab]
        return out

    engine.model.forward = recording_forward
    n_new = 5
    requests = [Request(prompt=p, sampling=greedy(n_new)) for p in SMOL_PROMPTS]
    alone, alone_rows = [], []
    for r in requests:
        rows.clear()
        alone.append(engine.generate([r])[0])
        alone_rows.append(torch.cat(rows))  # [n_new, vocab]
    rows.clear()
    batched = engine.generate(requests)
    assert all(x.shape[0] == len(requests) for x in rows)  # all prompts prefilled and decoded together
    batched_rows = torch.stack(rows, dim=1)  # [prompts, n_new, vocab]
    assert len({len(a["token_ids"]) for a in alone}) == 1
    # drift: the same row (same context) computed alone and in the batch
    drift = 0.0
    for i, (a, b) in enumerate(zip(alone, batched)):
        same = 0
        while same < n_new and a["token_ids"][same] == b["token_ids"][same]:
            same += 1
        k = min(same + 1, n_new)  # rows 0..same share their context
        drift = max(drift, (alone_rows[i][:k] - batched_rows[i, :k]).abs().max().item())
    assert drift < 1e-3, f"batched logits drift {drift:.3g} from the same rows alone: a batching bug"
    for i, (a, b) in enumerate(zip(alone, batched)):
        if a["token_ids"] == b["token_ids"]:
            continue
        j = next(k for k in range(n_new) if a["token_ids"][k] != b["token_ids"][k])
        top2 = alone_rows[i][j].topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap <= 2 * drift, (f"prompt {i} diverged at token {j} with a top-2 gap {gap:.3g} larger than "
                                  f"twice the measured drift {drift:.3g}")
    assert_pool_whole(engine)


def test_weight_layouts_give_the_same_greedy_tokens(tiny_bundle_f64, monkeypatch):
    """auto stores each dtype's linears in the layout measured cheaper (here: made to pick the
    transposed one, which the tiny model's timing may or may not favour); it must not change
    what the engine says (float64: no near-ties). A real measurement's choice is what the
    weights show."""
    import specbuild.engine.engine as engine_mod
    from specbuild.model.qlinear import choose_layouts

    real = Engine(tiny_bundle_f64, EngineConfig())
    chosen = real.layouts["float64"]["chosen"]
    assert real.model.w["layers.0.qkv"].is_contiguous() == (chosen == "nk")
    monkeypatch.setattr(engine_mod, "measured_layouts",
                        lambda w: choose_layouts(w, {"float64": {"nk": 2.0, "kn": 1.0}}))
    outs = {}
    for layout in ("rows", "auto"):
        engine = Engine(tiny_bundle_f64, EngineConfig(weight_layouts=layout))
        qkv = engine.model.w["layers.0.qkv"]
        assert qkv.is_contiguous() == (layout == "rows")
        handles = [engine.submit(Request(prompt_ids=prompt_ids(s, 5 + s), sampling=SamplingParams(max_tokens=12)))
                   for s in range(3)]
        while any(not h.seq.finished for h in handles):
            engine.step()
        outs[layout] = [h.result()["token_ids"] for h in handles]
    assert outs["rows"] == outs["auto"] and all(len(o) == 12 for o in outs["rows"])
    with pytest.raises(ValueError, match="weight_layouts='columns'"):
        EngineConfig(weight_layouts="columns")


def test_the_plain_decode_batch_is_the_general_paths_batch(engine64):
    """step.decode_batch (the decode rows' short path) builds the very ForwardBatch the general
    build_forward_batch builds, for one sequence and for a ragged batch of three, plain and with
    a chain draft and a tree draft (a speculative step's batch)."""
    from specbuild.engine.step import WorkItem, build_forward_batch
    from specbuild.speculation.proposers.base import Draft

    hs = [engine64.submit(Request(prompt_ids=prompt_ids(s, n), sampling=greedy(20))) for s, n in ((1, 5), (2, 11), (3, 3))]
    for _ in range(4):  # prefill and a few decode steps: every sequence decoding
        engine64.step()
    seqs = [h.seq for h in hs]
    assert all(not s.finished and s.num_cached == len(s.all_ids) - 1 for s in seqs)
    parents = (-1, 0, 0, 1)  # root; two children of the root; a grandchild under the first
    tree_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)

    def drafts(i):
        if i == 1:
            return Draft([7, 8, 9], method="ngram")
        if i == 2:
            return Draft([4, 5, 6], parents=parents, depths=[1, 1, 2], tree_mask=tree_mask, method="suffix")
        return None

    for group, with_drafts in ((seqs[:1], False), (seqs, False), (seqs, True), (seqs[1:2], True), (seqs[2:], True)):
        items = [WorkItem(s, [s.all_ids[-1]], drafts(seqs.index(s)) if with_drafts else None, start=s.num_cached,
                          completes=True) for s in group]
        fast = build_forward_batch(items, engine64.cache)
        rows0 = [it.row0 for it in items]
        slow = build_forward_batch(items, engine64.cache, fast=False)
        assert [it.row0 for it in items] == rows0
        for name in ("input_ids", "positions", "write_slots", "read_slots", "logit_rows", "prompt_rows"):
            assert torch.equal(getattr(fast, name), getattr(slow, name)), (name, len(group), with_drafts)
        assert (fast.mask is None) == (slow.mask is None) == (fast.input_ids.numel() == 1)
        if fast.mask is not None:
            assert torch.equal(fast.mask, slow.mask)
    for s in seqs:  # the drafts' rows reserved KV past the text: back to what the sequences hold
        engine64.cache.set_length(s.seq_id, s.num_cached)
    engine64.run_until_done()
    assert all(len(h.result()["token_ids"]) == 20 for h in hs)
