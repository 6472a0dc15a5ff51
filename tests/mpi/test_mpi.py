"""MineDraft and the MPI runtime: the wire format, the two-batch scheduler in process (a
loopback drafter), and the real thing: `mpirun -n 2 ... serve --parallel-draft` queried over
loopback HTTP, its draft rank SIGKILLed mid-run, world sizes refused; and TensorRT-LLM leader
mode: `mpirun -n 2 ... serve` of a bundle whose engines were built for tp 2, every rank
driving the stand-in executor of tests/helpers/trtllm_stub.py (SPECBUILD_TEST_TRTLLM_BINDINGS).

Every wait is bounded; server process groups are killed in teardown.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from specbuild.compiler.compile import CompileOptions, compile_bundle
from specbuild.mpi import draft_worker as W
from specbuild.mpi import minedraft as M
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.sampling.params import SamplingParams
from specbuild.engine.sequence import Request
from specbuild.speculation.config import SpeculationConfig
from specbuild.errors import SpecbuildError
from specbuild.speculation.proposers.remote import NO_ROLLBACK
from http_client import get, metric, next_event, post, stream, wait_until
from mpi_launch import CLI, MPIRUN, REPO, MpiServer, need_mpi
from tiny import draft_pair_bundle, make_tiny_hf

pytestmark = pytest.mark.timeout(120)

HELPERS = os.path.join(REPO, "tests", "helpers")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21], list(range(30, 90)), [40, 41, 42], [7, 7, 7, 7]]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return draft_pair_bundle(tmp_path_factory.mktemp("minedraft"), max_seq_len=4096, max_batch_size=8)


@pytest.fixture(scope="module")
def engine(bundle):
    return Engine(bundle, EngineConfig(max_batch_size=4, threads=1))


def requests(method: str, max_tokens: int = 30, gamma: int | None = 3, **sampling) -> list[Request]:
    spec = SpeculationConfig.make(None, method=method, gamma=gamma)
    return [Request(prompt_ids=p, speculation=spec,
                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)) for p in PROMPTS]


def loopback_engine(bundle, fail_after=None, **config):
    """An engine opened with MineDraft over the in-process link -> (engine, its planning
    policy, the draft worker)."""
    proposer, vocab = W.load_draft_proposer(bundle, EngineConfig(max_batch_size=4, threads=1))
    worker = W.DraftWorker(proposer, vocab)
    md = M.plugin(bundle, M.LoopbackTransport(worker, fail_after))
    engine = Engine(bundle, EngineConfig(max_batch_size=4, threads=1, **config), **md.open_kwargs())
    return engine, md.planning, worker


# ---- wire format ---------------------------------------------------------------------------------
def test_request_and_reply_round_trip():
    gen = torch.Generator().manual_seed(0)
    from specbuild.model.kv_cache import salt_key

    orders = [W.Order(7, 12, 13, [1, 2, 3], 4, 5, 2**62 + 1, 0.7, 0.9, salt_key("tenant")),
              W.Order(9, 0, 0, list(range(40)), 2, 0, 3, 0.0, 1.0)]
    assert orders[0].salt > 0 and orders[1].salt == 0
    buf = W.encode_request(W.KIND_DRAFT, 11, orders, [3, 4])
    assert buf.dtype == np.int64
    kind, step, back, releases = W.decode_request(buf)
    assert (kind, step, releases) == (W.KIND_DRAFT, 11, [3, 4]) and back == orders
    probs = torch.rand(4, 50, generator=gen)
    probs /= probs.sum(-1, keepdim=True)
    meta, prob_buf = W.encode_reply(11, [(7, W.OK, [5, 6, 7, 8], probs), (9, W.OK, [1, 2], None),
                                         (10, W.RESYNC, [], None)], 50, 0.25, seen_at=123.5)
    assert meta[3] == len(meta) and prob_buf.dtype == np.float32 and prob_buf.shape == (4, 50)
    step, results, timing = W.decode_reply(meta, prob_buf, sampled={7})
    assert step == 11 and timing.draft_seconds == 0.25 and timing.seen_at == 123.5
    assert 0 < timing.ready_at <= time.monotonic()
    assert results[7][:2] == (W.OK, [5, 6, 7, 8]) and torch.equal(results[7][2], probs.float())
    assert results[9] == (W.OK, [1, 2], None) and results[10] == (W.RESYNC, [], None)


@pytest.mark.parametrize("formats", [{}, {"quantize": "int4", "embedding_format": "int8", "lm_head_format": "int8"}])
def test_draft_rank_reads_only_the_shared_target_tensors(tmp_path, formats):
    """What a draft shares from the target (its embedding, its output rows) is read alone from
    the target's file, and is what the whole target's load gives (a quantized one too)."""
    from specbuild.engine.engine import load_weights
    from specbuild.model.qlinear import as_dense

    hf = make_tiny_hf(str(tmp_path / "hf"), scale=8.0)
    bundle = compile_bundle(hf, str(tmp_path / "bundle"), CompileOptions(dtype="float32", max_seq_len=64,
                                                                         max_batch_size=2, **formats))
    whole = load_weights(f"{bundle}/target", "cpu")
    part = W.load_target_tensors(f"{bundle}/target", ["embed", "lm_head"], "cpu")
    assert part.keys() == {"embed", "lm_head"}
    for name in part:
        assert type(part[name]) is type(whole[name]), name
        assert torch.equal(as_dense(part[name]), as_dense(whole[name])), name
        assert getattr(part[name], "rescore_top", None) == getattr(whole[name], "rescore_top", None), name
    assert bool(formats) == (not isinstance(part["embed"], torch.Tensor))  # int8 embedding: a QLinear
    with pytest.raises(SpecbuildError, match="target/nope"):
        W.load_target_tensors(f"{bundle}/target", ["nope"], "cpu")
    with pytest.raises(SpecbuildError, match="the draft rank reads only the target's tensors"):
        W.shared_target_names({"shares": {"embed": "medusa/embed"}})


# ---- the two-batch planning, in process-----------------------------------------------------------------
def test_minedraft_greedy_equals_plain_and_standard(bundle, engine):
    plain = engine.generate(requests("none"))
    standard = engine.generate(requests("draft"))
    md_engine, planning, worker = loopback_engine(bundle)
    minedraft = md_engine.generate(requests("draft"))
    for p, s, m in zip(plain, standard, minedraft):
        assert p["token_ids"] == s["token_ids"] == m["token_ids"]
    assert sum(r["stats"]["drafted"] for r in minedraft) > 0 and sum(r["stats"]["accepted"] for r in minedraft) > 0
    stats = planning.stats
    assert stats["minedraft_steps"] > 10, stats  # two batches really alternated
    assert stats["imbalance_sum"] <= stats["minedraft_steps"], stats  # balance counter kept |A - B| <= 1 mostly
    # sequences that reached their verify turn without drafts in hand were drafted then, not decoded plainly
    assert stats["sync_drafted_sequences"] > 0, stats
    assert md_engine.cache.used_blocks == 0 and worker.proposer.cache.used_blocks == 0 and not worker.mirrors


@pytest.mark.parametrize("prefill_chunk", [256, 16])
def test_prompts_prefill_on_the_draft_rank_while_the_target_prefills(bundle, engine, prefill_chunk):
    """The step that admits a request sends its prompt to the draft rank, which fills its
    cache meanwhile: before the first draft request the draft cache already holds the prompt
    (all but its last token), and the target's chunked prefill does not trim it. Output stays
    the plain greedy one, drafts are proposed and accepted, and nothing had to be resent."""
    plain = engine.generate(requests("none"))
    md_engine, planning, worker = loopback_engine(bundle, prefill_chunk=prefill_chunk)
    handles = [md_engine.submit(r) for r in requests("draft")]
    md_engine.step()
    admitted = [h.seq for h in handles if h.seq in md_engine.scheduler.running]
    assert len(admitted) == 4 and worker.requests == 0  # prefilled ahead, nothing drafted yet
    for seq in admitted:
        assert worker.proposer.cache.length(seq.seq_id) == len(seq.prompt_ids) - 1, seq.seq_id
    longest = max(admitted, key=lambda s: len(s.prompt_ids))
    while longest.num_cached < len(longest.prompt_ids):  # with chunks of 16: several steps
        md_engine.step()
    remote = md_engine.speculator.proposers["draft"]
    assert not remote.state(longest).drafted  # the others were drafted meanwhile, not this one
    assert remote.state(longest).keep == NO_ROLLBACK  # no chunk commit asks to trim the prompt
    assert worker.proposer.cache.length(longest.seq_id) == len(longest.prompt_ids) - 1
    md_engine.run_until_done()
    out = [h.result() for h in handles]
    assert [r["token_ids"] for r in out] == [p["token_ids"] for p in plain]
    assert sum(r["stats"]["drafted"] for r in out) > 0 and sum(r["stats"]["accepted"] for r in out) > 0
    stats = planning.remote.stats
    assert stats["prefilled_sequences"] == len(PROMPTS) and stats["resyncs"] == 0, stats
    assert worker.prefills == len(PROMPTS) and not worker.mirrors


def test_uneven_finishes_rebalance_without_starving(bundle, engine):
    """Requests that end at different times unbalance the batches; the surplus moves over
    and nobody is left waiting (a request stuck in both batches would never be verified)."""
    lengths = [4, 40, 5, 40, 6, 40, 7, 40]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]

    def reqs(method):
        spec = SpeculationConfig.make(None, method=method, gamma=3)
        return [Request(prompt_ids=p, speculation=spec, sampling=SamplingParams(max_tokens=n, ignore_eos=True))
                for p, n in zip(prompts, lengths)]

    plain = engine.generate(reqs("none"))
    md_engine, planning, _ = loopback_engine(bundle)
    handles = [md_engine.submit(r) for r in reqs("draft")]
    steps = 0
    while md_engine.has_work():
        md_engine.step()
        steps += 1
        assert steps < 200, (planning.batches, planning.stats)
        assert abs(planning.balance) <= 1 or not all(planning.batches)
    assert [h.result()["token_ids"] for h in handles] == [p["token_ids"] for p in plain]
    assert planning.stats["minedraft_steps"] > 0


class RecordingSink:
    """An events.EventSink that keeps what it is told."""

    enabled = True

    def __init__(self) -> None:
        self.started, self.ended, self.steps, self.events = [], [], [], []

    def on_session_start(self, seq) -> None:
        self.started.append(seq.seq_id)

    def on_step(self, seq, step) -> None:
        self.steps.append((seq.seq_id, step))

    def on_session_end(self, seq) -> None:
        self.ended.append(seq.seq_id)

    def on_event(self, seq, kind, detail) -> None:
        self.events.append((kind, detail))

    def stats(self) -> dict:
        return {"telemetry_rows_written": len(self.steps)}


def test_minedraft_plugs_in_and_keeps_the_telemetry_sink(bundle):
    """The engine opens with MineDraft's drafter and planning policy: its scheduler and
    speculator are its own (nothing replaced afterwards), so a sink attached as `serve
    --telemetry` attaches it gets every session and one step per decode pass, MineDraft's
    steps included."""
    from specbuild.engine.scheduler import Scheduler
    from specbuild.speculation.proposers.remote import RemoteDraftProposer

    engine, planning, _ = loopback_engine(bundle)
    assert type(engine.scheduler) is Scheduler and engine.scheduler.planning is planning
    assert isinstance(engine.speculator.proposers["draft"], RemoteDraftProposer)
    assert engine.speculator.proposers["draft"] is planning.remote
    sink = RecordingSink()
    engine.set_sink(sink)
    out = engine.generate(requests("draft", max_tokens=20))
    assert planning.stats["minedraft_steps"] > 0, planning.stats
    assert len(sink.started) == len(sink.ended) == len(PROMPTS)
    drafted = sum(r["stats"]["drafted"] for r in out)
    accepted = sum(r["stats"]["accepted"] for r in out)
    assert drafted > 0 and accepted > 0
    assert len(sink.steps) == sum(r["stats"]["generated_tokens"] - 1 for r in out) - accepted
    assert sum(st.drafted for _, st in sink.steps) == drafted
    assert sum(st.accepted for _, st in sink.steps) == accepted
    assert {st.method for _, st in sink.steps if st.drafted} == {"draft"}
    assert engine.stats()["telemetry_rows_written"] == len(sink.steps)


def test_minedraft_sampled_carries_draft_probs_and_is_reproducible(bundle):
    runs = []
    for _ in range(2):
        md_engine, planning, _ = loopback_engine(bundle)
        runs.append(md_engine.generate(requests("draft", temperature=0.8, seed=5)))
    assert [r["token_ids"] for r in runs[0]] == [r["token_ids"] for r in runs[1]]
    drafted = sum(r["stats"]["drafted"] for r in runs[0])
    accepted = sum(r["stats"]["accepted"] for r in runs[0])
    assert drafted > 0 and 0 < accepted < drafted
    assert planning.stats["minedraft_steps"] > 0


def test_lost_drafter_degrades_to_plain(bundle, engine):
    plain = engine.generate(requests("none"))
    md_engine, planning, _ = loopback_engine(bundle, fail_after=4)
    out = md_engine.generate(requests("draft"))
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in plain]
    assert all(r["finish_reason"] == "length" for r in out)
    health = planning.health()
    assert health["status"] == "degraded" and health["draft_rank"]["state"] == "lost"
    assert md_engine.cache.used_blocks == 0


def test_drafter_exception_degrades_only_its_sequences(bundle, engine):
    plain = engine.generate(requests("none"))
    md_engine, planning, worker = loopback_engine(bundle)
    real = worker.proposer.propose
    calls = {"n": 0}

    def flaky(seqs, gammas):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected drafter failure")
        return real(seqs, gammas)

    worker.proposer.propose = flaky
    out = md_engine.generate(requests("draft"))
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in plain]
    assert planning.remote.stats["failed_sequences"] >= 1 and planning.health()["status"] == "ok"
    assert sum(r["stats"]["accepted"] for r in out) > 0


def test_world_size_checks():
    from specbuild.errors import SpecbuildError
    from specbuild.mpi.context import DistContext, WorldNeed, check_world

    check_world(1, False)
    check_world(2, True)
    for size, flag in ((3, True), (1, True), (2, False), (4, False)):
        with pytest.raises(SpecbuildError, match="supported: 1 process"):
            check_world(size, flag)
    tp4 = WorldNeed("tensorrt-llm", ranks=4, tp=2, pp=2)
    check_world(4, False, tp4)
    check_world(1, False, WorldNeed("tensorrt-llm"))
    for size in (1, 2, 8):
        with pytest.raises(SpecbuildError) as e:
            check_world(size, False, tp4, "generate")
        assert str(e.value) == (f"MPI world size {size} does not match this bundle's TensorRT-LLM engines, built for "
                                "tp*pp = 4 ranks (tp 2, pp 2): launch it with `mpirun -n 4 specbuild generate BUNDLE`")
    with pytest.raises(SpecbuildError, match=r"MPI world size 2 .* tp\*pp = 1 rank \(tp 1, pp 1\): run `specbuild "
                                             "serve BUNDLE` without mpirun"):
        check_world(2, False, WorldNeed("tensorrt-llm"))
    with pytest.raises(SpecbuildError, match=r"world size 2 is not supported without --parallel-draft on the torch "
                                             r"backend \(--backend auto chose torch: no GPU here\); supported"):
        check_world(2, False, WorldNeed(why="no GPU here"))
    roles = [DistContext(r, 4, leader_mode=True) for r in range(4)]
    assert [c.role for c in roles] == ["leader", "worker", "worker", "worker"] and roles[1].peer is None
    assert [DistContext(r, 2).role for r in range(2)] == ["verifier", "drafter"]


def test_the_draft_rank_reuses_prefixes_in_its_own_cache(bundle):
    """MineDraft over the in-process link: the draft rank's cache adopts the blocks of a text it
    computed for an earlier request (drafts only), salted requests apart; output unchanged."""
    md_engine, _, worker = loopback_engine(bundle)
    off = Engine(bundle, EngineConfig(max_batch_size=4, threads=1, prefix_cache=False))
    spec = SpeculationConfig.make(None, method="draft", gamma=3)
    turn1 = list(range(30, 90)) + [5, 6, 7, 8] * 4

    def ask(engine, prompt, salt=None):
        return engine.generate([Request(prompt_ids=prompt, speculation=spec, cache_salt=salt,
                                        sampling=SamplingParams(max_tokens=12, ignore_eos=True))])[0]

    first = ask(md_engine, turn1)
    draft_cache = worker.proposer.cache
    before = draft_cache.counters["hit_tokens"]
    second = ask(md_engine, turn1 + first["token_ids"] + [41, 42])
    assert draft_cache.counters["hit_tokens"] - before >= 64
    assert second["token_ids"] == ask(off, turn1 + first["token_ids"] + [41, 42])["token_ids"]
    assert second["stats"]["cached_tokens"] >= 64 and second["stats"]["drafted"] > 0
    hits = draft_cache.counters["hit_tokens"]
    ask(md_engine, turn1 + [9], salt="other tenant")
    assert draft_cache.counters["hit_tokens"] == hits  # another salt: nothing shared on either rank
    draft_cache.check()


# ---- the real thing: two ranks under mpirun ----------------------------------------------------------
@pytest.fixture(scope="module")
def mpi_server(bundle, tmp_path_factory):
    need_mpi()
    srv = MpiServer(bundle, str(tmp_path_factory.mktemp("mpi_logs") / "server.log"))
    yield srv
    srv.stop()


@pytest.mark.parametrize("kill", ["process-group", "launcher-only"])
def test_no_rank_outlives_its_launcher(bundle, tmp_path, kill):
    """SIGKILL of mpirun's whole process group (what a test fixture or CI timeout does), or of
    mpirun alone (a user's kill -9): within a bounded wait no guard and no rank is left, and the
    port is free again. Both ranks run in their own sessions under their guards, so the group
    kill never reaches them: only their tie to the launcher can take them down."""
    need_mpi()
    srv = MpiServer(bundle, str(tmp_path / "server.log"))
    assert len(srv.rank_pids) == 2 and srv.proc.pid not in srv.rank_pids, srv.rank_pids
    try:
        if kill == "process-group":
            os.killpg(srv.proc.pid, signal.SIGKILL)
        else:
            os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(timeout=10)
        srv.assert_no_process_left()
        assert get(srv.port, "/health")[0] == 0  # nobody answers on the port any more
    finally:
        srv.stop()


def test_mpi_server_greedy_equals_generate(mpi_server, engine):
    health = mpi_server.health()
    assert health["status"] == "ok" and health["draft_rank"]["state"] == "ok" and health["draft_rank"]["pid"] > 0
    plain = engine.generate(requests("none", max_tokens=24))
    standard = engine.generate(requests("draft", max_tokens=24))
    results: dict[int, list] = {}

    def ask(i: int, prompt: list[int]) -> None:
        body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "gamma": 3, "return_token_ids": True}
        if i % 2:
            chunks = stream(mpi_server.port, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
            results[i] = [sum((c["choices"][0].get("token_ids", []) for c in chunks[:-1]), []), chunks[-1]["usage"]]
        else:
            status, _, full = post(mpi_server.port, "/v1/completions", body)
            assert status == 200, full
            results[i] = [full["choices"][0]["token_ids"], full["usage"]]

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == len(PROMPTS)
    for i, (p, s) in enumerate(zip(plain, standard)):
        assert results[i][0] == p["token_ids"] == s["token_ids"], i
    assert sum(u["drafted_tokens"] for _, u in results.values()) > 0
    assert sum(u["accepted_tokens"] for _, u in results.values()) > 0
    assert mpi_server.health()["draft_rank"]["minedraft_steps"] > 0
    wait_until(lambda: metric(mpi_server.port, "specbuild_kv_blocks_used") == 0, 5, "KV blocks to be freed")


def test_mpi_server_second_turn_reuses_the_prefix(mpi_server, bundle):
    """MineDraft's verifier rank keeps automatic prefix caching: a chat's second turn reuses the
    first turn's blocks (usage's cached_tokens) and gives what an engine without the cache
    gives, drafted by the draft rank (whose own cache computes the text: it keeps none)."""
    off = Engine(bundle, EngineConfig(max_batch_size=4, threads=1, prefix_cache=False))
    turn1 = list(range(30, 90)) + [5, 6, 7, 8] * 4
    body = {"max_tokens": 20, "ignore_eos": True, "gamma": 3, "return_token_ids": True}
    status, _, first = post(mpi_server.port, "/v1/completions", {**body, "prompt": turn1})
    assert status == 200, first
    turn2 = turn1 + first["choices"][0]["token_ids"] + [41, 42, 43]
    status, _, second = post(mpi_server.port, "/v1/completions", {**body, "prompt": turn2})
    assert status == 200, second
    want = off.generate([Request(prompt_ids=p, sampling=SamplingParams(max_tokens=20, ignore_eos=True))
                         for p in (turn1, turn2)])
    assert [first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]] == [w["token_ids"] for w in want]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(turn1) // 16 * 16
    assert second["usage"]["drafted_tokens"] > 0 and first["usage"]["accepted_tokens"] + \
        second["usage"]["accepted_tokens"] > 0


# a hang guard, not a speed goal: 4 x 3,000 tokens in process and then over HTTP take ~40 s on a
# quiet 2-core machine and passed 120 s at a load average of 12-15 (on the code before this test changed too)
@pytest.mark.timeout(420)
def test_mpi_draft_rank_sigkill_degrades_then_sigterm(mpi_server, engine):
    """Runs last on the module's server: it kills the draft rank.

    The four requests are held open by construction, not by the machine being slow: all four
    are sent before any stream is read, so they run side by side in the engine's batches, and
    each asks for 3,000 tokens (the bundle allows 4,096), so the state "four running, the draft
    rank drafting" lasts for hundreds of steps; the test waits for that state, then kills."""
    n_tokens = 3000
    body = {"max_tokens": n_tokens, "ignore_eos": True, "gamma": 3, "return_token_ids": True}
    expect = engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_tokens=n_tokens, ignore_eos=True))
                              for p in PROMPTS[:4]])
    conns = [http.client.HTTPConnection("127.0.0.1", mpi_server.port, timeout=60) for _ in range(4)]
    for conn, p in zip(conns, PROMPTS[:4]):  # all four sent before any answer is read
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "prompt": p, "stream": True,
                                                                 "stream_options": {"include_usage": True}}).encode(),
                     headers={"Content-Type": "application/json"})
    opened = [(conn, conn.getresponse()) for conn in conns]
    assert all(resp.status == 200 for _, resp in opened)
    tokens: list[list[int]] = [[] for _ in opened]
    for i, (_, resp) in enumerate(opened):  # every stream is under way, past its first drafted steps
        while len(tokens[i]) < 20:
            tokens[i] += next_event(resp)["choices"][0].get("token_ids", [])
    state: dict = {}

    def four_drafting() -> bool:
        state.update(mpi_server.health())
        return state["running"] == 4 and state["draft_rank"]["requests"] > 0

    wait_until(four_drafting, 30, "four running requests with the draft rank drafting")
    health = state
    os.kill(health["draft_rank"]["pid"], signal.SIGKILL)
    finals, usages = [], []
    for i, (conn, resp) in enumerate(opened):
        deadline = time.monotonic() + 240  # bounded; generous for a loaded machine
        while (ev := next_event(resp)) not in (None, "[DONE]"):
            assert time.monotonic() < deadline
            assert "error" not in ev, ev
            if not ev["choices"]:  # the usage chunk, last (stream_options.include_usage)
                usages.append(ev["usage"])
                continue
            tokens[i] += ev["choices"][0].get("token_ids", [])
            if ev["choices"][0]["finish_reason"]:
                finals.append(ev)
        conn.close()
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"] * 4
    assert len(usages) == 4 and all(u["drafted_tokens"] > 0 for u in usages)  # speculated before the kill
    assert tokens == [e["token_ids"] for e in expect]  # nothing lost or duplicated, still lossless
    wait_until(lambda: mpi_server.health()["status"] == "degraded", 10, "/health to report the loss")
    assert mpi_server.health()["draft_rank"]["state"] == "lost"
    assert mpi_server.proc.poll() is None  # rank 0 (and mpirun) survived
    status, _, full = post(mpi_server.port, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8})
    assert status == 200 and full["usage"]["completion_tokens"] >= 1 and full["usage"]["drafted_tokens"] == 0
    wait_until(lambda: metric(mpi_server.port, "specbuild_kv_blocks_used") == 0, 5, "KV blocks to be freed")
    mpi_server.proc.send_signal(signal.SIGTERM)
    mpi_server.proc.wait(timeout=20)
    out = mpi_server.output()
    assert "stopped" in out and "forced exit" not in out, out[-2000:]


@pytest.mark.parametrize("launch, flag, message", [
    (3, True, "needs exactly 2 MPI ranks, got world size 3"),
    (2, False, "world size 2 is not supported without --parallel-draft"),
    (0, True, "needs exactly 2 MPI ranks, got world size 1"),
])
def test_world_size_refused_at_start(bundle, launch, flag, message):
    if launch:
        need_mpi()
    cmd = ([MPIRUN, "-n", str(launch)] if launch else []) + CLI + ["serve", bundle, "--port", "0"] + \
        (["--parallel-draft"] if flag else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count(message) == 1 and "supported: 1 process" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ---- TensorRT-LLM leader mode: `mpirun -n tp*pp specbuild serve BUNDLE` (stand-in executor) -----------
STUB_ENV = {"SPECBUILD_TEST_TRTLLM_BINDINGS": "trtllm_stub:mpi_bindings",
            "PYTHONPATH": os.pathsep.join(filter(None, [HELPERS,
                                                        os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def tp2_bundle(tmp_path_factory) -> str:
    """A tiny target compiled with --backend tensorrt-llm --tp 2, its engine's config.json written
    as trtllm-build would (mapping world_size 2): no engine files, the stand-in runs it. No draft:
    draft/target at tp 2 is refused (two leader-mode executors on one MPI world; issue 17 row 7).
    Head size 32: the default 16 has no TensorRT-LLM kernel."""
    from trtllm_stub import write_engine_config

    root = tmp_path_factory.mktemp("leader")
    target = make_tiny_hf(str(root / "target"), scale=8.0, head_dim=32)
    bundle = compile_bundle(target, str(root / "bundle"), CompileOptions(
        dtype="float64", max_seq_len=128, max_batch_size=4, max_draft_len=4, backend="tensorrt-llm",
        trtllm_dtype="bfloat16", tp=2))
    for role in ("target",):
        assert write_engine_config(bundle, role)["pretrained_config"]["mapping"]["world_size"] == 2
    return bundle


def test_leader_mode_serve_two_ranks(tp2_bundle, tmp_path):
    """Both ranks open the engine; rank 0 answers over HTTP while rank 1 waits in its executor's
    shutdown; SIGTERM to mpirun: rank 0 shuts down, which releases rank 1; both exit 0."""
    need_mpi()
    log_path = str(tmp_path / "leader.log")
    log = open(log_path, "w")
    cmd = [MPIRUN, "-n", "2", *CLI, "serve", tp2_bundle, "--host", "127.0.0.1", "--port", "0"]  # --backend auto
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env={**os.environ, **STUB_ENV})

    def output() -> str:
        with open(log_path) as f:
            return f.read()

    try:
        deadline = time.monotonic() + 90
        while not (m := re.search(r"on http://127\.0\.0\.1:(\d+)", output())) or \
                "rank 1/2 target: waiting for rank 0's shutdown" not in output():
            assert proc.poll() is None, f"mpirun exited with {proc.returncode}:\n{output()}"
            assert time.monotonic() < deadline, f"no URL in time:\n{output()}"
            time.sleep(0.05)
        port = int(m.group(1))
        out = output()
        assert "tensorrt-llm backend" in out and "leader of 2 MPI ranks" in out, out
        # every rank built its executors; only rank 0 may enqueue; rank 1 binds GPU 1 % 8
        for rank, leader in ((0, True), (1, False)):
            for role in ("target",):
                assert f"stub executor rank {rank}/2 {role}: built, can_enqueue_requests={leader}" in out, out
        assert "rank 1: GPU 1, serving its part of the engine" in out, out

        expect = Engine(tp2_bundle, EngineConfig()).generate(
            [Request(prompt_ids=[5] * 8, speculation={"method": "none"},
                     sampling=SamplingParams(max_tokens=10, ignore_eos=True))])[0]["token_ids"]
        body = {"prompt": [5] * 8, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "speculation": "none"}
        status, _, full = post(port, "/v1/completions", body)
        assert status == 200, full
        assert full["choices"][0]["token_ids"] == expect
        chunks = stream(port, "/v1/completions", body)
        assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == expect
        health = json.loads(get(port, "/health")[1])
        assert health["status"] == "ok" and health["backend"] == "tensorrt-llm"
        out = output()
        assert "released" not in out and "stopped" not in out, out  # rank 1 still serves its part

        proc.send_signal(signal.SIGTERM)  # mpirun forwards it to both ranks
        assert proc.wait(timeout=60) == 0, output()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
    out = output()
    assert "rank 1: SIGTERM noted; waiting for rank 0" in out, out  # the leader owns shutdown
    assert "stub executor rank 0/2 target: shut down; released 1 worker rank(s)" in out, out
    assert "stub executor rank 1/2 target: released by rank 0" in out, out
    assert re.search(r"^stopped$", out, re.M) and re.search(r"^rank 1: stopped$", out, re.M), out
    for bad in ("Traceback", "forced exit", "BAD TERMINATION", "error:"):
        assert bad not in out, out


@pytest.mark.parametrize("launch, command, size", [(3, "serve", 3), (0, "serve", 1), (3, "generate", 3)])
def test_leader_mode_world_size_refused(tp2_bundle, launch, command, size):
    """A world size other than the engines' tp*pp: every rank refuses before loading anything,
    one line naming both numbers and the mpirun line to use."""
    if launch:
        need_mpi()
    args = ["--port", "0"] if command == "serve" else ["--prompt", "hi", "--max-tokens", "2"]
    cmd = ([MPIRUN, "-n", str(launch)] if launch else []) + CLI + [command, tp2_bundle, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=REPO, env={**os.environ, **STUB_ENV})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = (f"error: MPI world size {size} does not match this bundle's TensorRT-LLM engines, built for tp*pp = 2 "
            f"ranks (tp 2, pp 1): launch it with `mpirun -n 2 specbuild {command} BUNDLE`\n")
    assert proc.stderr == line, proc.stderr  # once, not once per rank, and nothing else
    assert "stub executor" not in proc.stdout + proc.stderr  # refused before any engine was built
