"""MineDraft's verification is the plain step itself (`Scheduler.begin_step`, then
`complete_step` with the batch being drafted as `leave_out`), so everything the plain step does happens on MineDraft steps too: Medusa and
`auto` requests get the target's hidden state and keep drafting; and the running set is
never swapped for a subset while a step plans, so `stats()` (read without the lock, e.g.
by /health) always counts every running request. In process, over the loopback drafter."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from safetensors.torch import load_file

from specbuild.compiler.compile import CompileOptions, compile_bundle
from specbuild.compiler.medusa_role import add_medusa, parse_heads
from specbuild.mpi import draft_worker as W
from specbuild.mpi import minedraft as M
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.errors import BundleError
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig
from mpi_launch import CLI, MPIRUN, REPO, need_mpi
from tiny import draft_pair_bundle, make_tiny_hf

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21], [40, 41, 42], [7, 7, 7, 7]]
HIDDEN, VOCAB = 64, 320  # tests/helpers/tiny.py defaults


def shared_heads(lm_head: torch.Tensor, num_heads: int = 2) -> dict[str, torch.Tensor]:
    """Medusa heads in FasterDecoding layout: a small residual block over the target's own
    lm_head (so their guesses are the target's, a step late: accepted on repetitive text)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for h in range(num_heads):
        out[f"{h}.0.linear.weight"] = torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.01
        out[f"{h}.0.linear.bias"] = torch.zeros(HIDDEN)
        out[f"{h}.1.weight"] = lm_head.clone()
    return out


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    """A target with both drafters: a draft model (MineDraft's) and Medusa heads."""
    root = tmp_path_factory.mktemp("minedraft_medusa")
    out = draft_pair_bundle(root, max_seq_len=512, max_batch_size=8)
    lm_head = load_file(f"{out}/target/weights.safetensors")["lm_head"].float()
    add_medusa(out, parse_heads(shared_heads(lm_head), "shared"), "chain_2")
    return out


def loopback_engine(bundle: str):
    """An engine opened with MineDraft over the in-process link -> (engine, its planning policy)."""
    proposer, vocab = W.load_draft_proposer(bundle, EngineConfig(max_batch_size=4, threads=1))
    md = M.plugin(bundle, M.LoopbackTransport(W.DraftWorker(proposer, vocab)))
    return Engine(bundle, EngineConfig(max_batch_size=4, threads=1), **md.open_kwargs()), md.planning


def request(prompt: list[int], method: str, max_tokens: int = 40) -> Request:
    return Request(prompt_ids=prompt, speculation=SpeculationConfig.make(None, method=method, gamma=2),
                   sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_medusa_requests_draft_on_minedraft_steps(bundle):
    plain = Engine(bundle, EngineConfig(max_batch_size=4, threads=1))
    methods = ["draft", "draft", "medusa", "medusa"]
    expect = plain.generate([request(p, "none") for p in PROMPTS])
    engine, planning = loopback_engine(bundle)
    handles = [engine.submit(request(p, m)) for p, m in zip(PROMPTS, methods)]
    engine.run_until_done()
    results = [h.result() for h in handles]
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in expect]  # lossless
    assert planning.stats["minedraft_steps"] > 10, planning.stats  # the two batches alternated
    for h, method in zip(handles, methods):
        seq, stats = h.seq, h.result()["stats"]
        assert stats["drafted"] > 0, (method, stats)
        if method == "medusa":
            # every decode step after the first drafts a tree: the hidden state was there on
            # MineDraft steps too (before the fix, only ordinary steps carried it)
            drafted_steps = seq.tally.drafted_by_pos[0] if seq.tally.drafted_by_pos else 0  # tree steps with drafts
            assert drafted_steps >= seq.tally.verify_passes - 1, (drafted_steps, seq.tally.verify_passes)
    assert sum(r["stats"]["accepted"] for r, m in zip(results, methods) if m == "medusa") > 0


def test_stats_count_every_running_request_during_a_minedraft_step(bundle):
    engine, planning = loopback_engine(bundle)
    handles = [engine.submit(request(p, "draft", max_tokens=30)) for p in PROMPTS]
    seen: list[tuple[int, int]] = []

    def spy(fn):  # inside the step (planning, forward), as a lock-free reader would see it
        def wrapped(*args, **kwargs):
            admitted = sum(1 for h in handles if h.seq.tally.t_admit is not None and not h.seq.finished)
            seen.append((engine.stats()["running"], admitted))
            return fn(*args, **kwargs)
        return wrapped

    engine.model.forward = spy(engine.model.forward)
    engine.speculator.propose = spy(engine.speculator.propose)
    engine.run_until_done()
    assert all(h.result()["finish_reason"] == "length" for h in handles)
    assert planning.stats["minedraft_steps"] > 5, planning.stats
    assert seen and all(r == n for r, n in seen), [s for s in seen if s[0] != s[1]][:5]


def test_the_planning_policy_uses_only_the_declared_scheduler_interface(bundle):
    """TwoBatchPlanning runs its steps through Scheduler.begin_step, complete_step and
    speculator (engine/scheduler.py's module doc) and nothing else of the scheduler."""
    engine, planning = loopback_engine(bundle)

    class Interface:  # any other attribute is an AttributeError inside the step
        def __init__(self, scheduler) -> None:
            self.begin_step, self.complete_step = scheduler.begin_step, scheduler.complete_step
            self.speculator = scheduler.speculator

    class Narrowed:
        def step(self, scheduler):
            return planning.step(Interface(scheduler))

        def health(self):
            return planning.health()

    engine.scheduler.planning = Narrowed()
    expect = Engine(bundle, EngineConfig(max_batch_size=4, threads=1)).generate([request(p, "none") for p in PROMPTS])
    handles = [engine.submit(request(p, "draft")) for p in PROMPTS]
    engine.run_until_done()
    assert [h.result()["token_ids"] for h in handles] == [r["token_ids"] for r in expect]
    assert all(h.result()["finish_reason"] == "length" for h in handles)
    assert planning.stats["minedraft_steps"] > 5, planning.stats


def test_heads_only_bundle_is_refused_with_the_reason(tmp_path):
    """A bundle with Medusa heads and no draft model: the draft rank has nothing to run (the
    heads read the target's hidden states, so they run beside it). Both ranks refuse it at
    start, under real mpirun, with one line that says so; nothing is loaded twice."""
    hf = make_tiny_hf(str(tmp_path / "hf"), scale=8.0)
    bundle = compile_bundle(hf, str(tmp_path / "bundle"), CompileOptions(dtype="float32", max_seq_len=64,
                                                                         max_batch_size=2))
    lm_head = load_file(f"{bundle}/target/weights.safetensors")["lm_head"].float()
    add_medusa(bundle, parse_heads(shared_heads(lm_head), "shared"), "chain_2")
    reason = "has no draft model, the only drafter the draft rank runs"
    with pytest.raises(BundleError, match=reason + r".*\(this bundle has medusa\) read the target's hidden states"):
        W.load_draft_proposer(bundle, EngineConfig(max_batch_size=2, threads=1))
    with pytest.raises(BundleError, match=reason):
        M.plugin(bundle, M.LoopbackTransport(None))
    need_mpi()
    proc = subprocess.run([MPIRUN, "-disable-auto-cleanup", "-n", "2", *CLI, "serve", bundle, "--port", "0",
                           "--parallel-draft"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    # no --threads: the two ranks share this host's cores instead of each taking all of them
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    for rank in (0, 1):
        assert f"rank {rank}: {share} thread" in proc.stderr and "2 ranks on this host (MPI_LOCALNRANKS)" in proc.stderr
    assert "error: draft rank: bundle" in proc.stderr and proc.stderr.count(reason) == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "KeyError" not in proc.stderr


class FakeLink:
    """A draft link (speculation/proposers/remote.py's interface) answering from a script."""

    def __init__(self, replies: list) -> None:
        self.replies = replies
        self.reason = None
        self.codec_seconds = 0.0
        self.posted: list = []

    @property
    def healthy(self) -> bool:
        return self.reason is None

    def post(self, step, orders, releases, prob_rows):
        self.posted.append((step, [o.seq_id for o in orders], list(releases)))
        return len(self.posted) - 1

    def collect(self, ticket, deadline, sampled):
        reply = self.replies[ticket]
        if reply is None:
            self.reason = "gone"
            return None
        return reply, W.ReplyTiming(0.01, 0.0, 0.0)

    def send_ahead(self, step, orders, releases):
        self.posted.append((step, [o.seq_id for o in orders], list(releases)))

    def notify(self, step, releases):
        self.posted.append((step, [], list(releases)))


def test_remote_proposer_never_raises_and_keeps_its_books(bundle):
    """The remote drafter over a scripted link: drafts land where they belong, a reply naming a
    sequence it was not asked about is ignored, a failed sequence is decoded plainly from then
    on, and a lost link means no drafts (never an exception)."""
    from specbuild.speculation.proposers.remote import FAILED, OK, RemoteDraftProposer

    engine = Engine(bundle, EngineConfig(max_batch_size=4, threads=1))
    seqs = [engine._new_sequence(request(p, "draft")) for p in PROMPTS[:2]]
    a, b = seqs
    link = FakeLink([{a.seq_id: (OK, [1, 2, 3], None), b.seq_id: (FAILED, [], None), 999: (OK, [4], None)}, None])
    remote = RemoteDraftProposer(link, VOCAB)
    drafts = remote.propose(seqs, [3, 3])
    assert drafts[0].tokens == [1, 2, 3] and drafts[1] is None
    assert remote.failed(b) and remote.stats["failed_sequences"] == 1
    assert remote.propose([a, b], [2, 2]) == [None, None]  # the link is lost now: plain decoding
    assert not remote.healthy and remote.propose([a], [2]) == [None] and len(link.posted) == 2
    remote.release(a)
    assert remote.releases == [a.seq_id]
