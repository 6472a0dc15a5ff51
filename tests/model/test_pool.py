"""The kernels' own thread pool (cpu_kernels.cpp, namespace pool): its contract (every item run
exactly once, none after its job returned, at any thread count and under contention, and after a
fork), the same bits as OpenMP for every kernel, the SPECBUILD_POOL setting, and the thread
governor moving the kernels onto the pool under others' load."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import pytest
import torch

from specbuild.compiler.quantize import quantize_int4, quantize_int8
from specbuild.errors import BundleError
from specbuild.model import cpu_kernels
from specbuild.model import threads as T

from kernel_skip import kernels_or_skip

X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason="specbuild's CPU kernels are x86-64 only")


@pytest.fixture
def threads2():
    kernels_or_skip()
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    # An engine earlier in the same process may have left the kernels on a pool of fixed width
    # (kernels_mode("pool", n)); these tests size the pool by torch's thread count.
    torch.ops.specbuild_cpu.pool_threads(0)
    yield
    torch.set_num_threads(saved)
    torch.ops.specbuild_cpu.pool_threads(0)
    cpu_kernels.pool_config(mode=cpu_kernels.pool_mode(), spin_us=cpu_kernels.pool_spin_us())
    cpu_kernels.pool_contended(False)


def check_until_a_helper_took_part(items: int, grain: int, reps: int, tries: int = 200) -> dict:
    """pool_check until the helpers have run some chunks (they may all be off the CPU for a while
    on a busy machine: that is the pool's point, and no error); every try must be exact."""
    helper = 0
    for _ in range(tries):
        got = cpu_kernels.pool_check(items, grain, reps)
        assert got["early"] == 0 and got["late"] == 0, got
        helper += got["helper_chunks"]
        if helper > 0:
            return got
    pytest.fail(f"no helper ran a chunk in {tries} x {reps} jobs")


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("items,grain", [(1000, 1), (37, 3), (2, 1)])
def test_every_item_runs_exactly_once_and_never_after_its_job(threads2, threads, items, grain):
    """More threads than cores too (4 on a 2-core machine): helpers preempted mid-chunk, stale
    helpers waking in a later job. The claim word's epoch keeps a stale helper out."""
    torch.set_num_threads(threads)
    check_until_a_helper_took_part(items, grain, 500)
    assert cpu_kernels.pool_stats()["helpers"] >= threads - 1


def test_the_pool_holds_beside_busy_neighbours(threads2):
    """Two spinning processes on the same cores: the contract still holds."""
    spin = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 60\nwhile time.time() < t: pass"])
            for _ in range(2)]
    try:
        for _ in range(5):
            got = cpu_kernels.pool_check(64, 1, 2000)
            assert got["early"] == 0 and got["late"] == 0, got
    finally:
        for p in spin:
            p.kill()
            p.wait()


def test_a_forked_child_gets_a_pool_of_its_own(threads2):
    """The helpers are threads of the parent: a forked child starts fresh ones instead of waiting
    for helpers it does not have."""
    check_until_a_helper_took_part(200, 1, 50)
    pid = os.fork()
    if pid == 0:  # the child: exact results, its helpers take part, then leave without cleanup
        code = 1
        try:
            for _ in range(200):
                got = cpu_kernels.pool_check(200, 1, 50)
                if got["early"] or got["late"]:
                    break
                if got["helper_chunks"] > 0:
                    code = 0
                    break
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120  # a bound on a hang, not a timing assertion
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in the pool")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def kernel_calls():
    """(name, call) for every kernel on every path this CPU runs, 17 rows of input."""
    gen = torch.Generator().manual_seed(3)
    n, k = 200, 576
    calls = []
    q, s, z = quantize_int4(torch.randn(n, k, generator=gen), 32, torch.bfloat16)
    st = cpu_kernels.status()
    for act in (torch.bfloat16, torch.float32):
        packed4 = cpu_kernels.repack_int4(q, s, z, 32, act != torch.bfloat16)
        q8, s8 = quantize_int8(torch.randn(n, k, generator=gen), act)
        packed8 = cpu_kernels.repack_int8(q8, s8)
        x = torch.randn(17, k, generator=gen).to(act)
        for level in [lv for lv in (1, 2, 3) if min(lv, 2) <= st["isa"]] + [4] * cpu_kernels.has_isa4():
            calls.append((f"int4 {act} level {level}", lambda x=x, p=packed4, lv=level, a=act:
                          cpu_kernels.int4_mm(x, p, n, 32, a != torch.bfloat16, lv)))
            calls.append((f"int8 {act} level {level}", lambda x=x, p=packed8, lv=level: cpu_kernels.int8_mm(x, p, n, lv)))
    xf = torch.randn(17, k, generator=gen)
    f16 = cpu_kernels.q8_fp16_exact(s, z)
    packed_q8 = cpu_kernels.repack_int4_q8(q, s, z, 32, f16)
    for path in cpu_kernels.q8_paths():
        calls.append((f"int4_q8 path {path}", lambda p=path: cpu_kernels.int4_q8_mm(xf, packed_q8, n, 32, f16, p)))
    if cpu_kernels.int8_q8_available():
        q8, s8 = quantize_int8(torch.randn(n, k, generator=gen), torch.float32)
        packed = cpu_kernels.repack_int8_q8(q8, s8)
        calls.append(("int8_q8", lambda: cpu_kernels.int8_q8_mm(xf, packed, n)))
    from specbuild.model.attention import rows_index

    kc, vc = torch.randn(700, 3, 64, generator=gen), torch.randn(700, 3, 64, generator=gen)
    read = torch.randperm(700, generator=gen)[:400]
    mask = torch.zeros(17, 400, dtype=torch.bool)
    for t in range(17):
        mask[t, :60 + 20 * t] = True
    qa = torch.randn(17, 9, 64, generator=gen)
    calls.append(("rows_attention", lambda: cpu_kernels.rows_attention(qa, kc, vc, rows_index(read, mask, 17), 0.125)))
    return calls


def test_every_kernel_gives_openmps_bits_on_the_pool(threads2):
    calls = kernel_calls()
    assert len(calls) >= 4
    cpu_kernels.pool_config(mode=0)
    want = {name: call() for name, call in calls}
    cpu_kernels.pool_config(mode=1)
    for _ in range(3):  # different helpers take different chunks each time
        jobs = cpu_kernels.pool_stats()["jobs"]
        for name, call in calls:
            assert torch.equal(call(), want[name]), name
        assert cpu_kernels.pool_stats()["jobs"] > jobs  # the loops really ran on the pool


def test_the_pool_keeps_its_width_while_torch_runs_one_thread(threads2):
    """kernels_mode("pool", 2) with torch at one thread in the caller (the governor's pool choice:
    the step's small torch ops pay no OpenMP wake-up): the kernels still run 2 wide on the pool,
    helpers taking chunks, with OpenMP's bits."""
    calls = kernel_calls()
    cpu_kernels.pool_config(mode=0)
    want = {name: call() for name, call in calls}
    torch.set_num_threads(1)
    try:
        cpu_kernels.kernels_mode("pool", 2)
        before = cpu_kernels.pool_stats()
        for _ in range(200):  # a helper may be off the CPU for a while on a busy machine
            for name, call in calls:
                assert torch.equal(call(), want[name]), name
            if cpu_kernels.pool_stats()["helper_chunks"] > before["helper_chunks"]:
                break
        after = cpu_kernels.pool_stats()
        assert after["jobs"] > before["jobs"] and after["helper_chunks"] > before["helper_chunks"]
        cpu_kernels.kernels_mode("openmp")  # width back to torch's count: one thread, no pool job
        jobs = cpu_kernels.pool_stats()["jobs"]
        for name, call in calls:
            assert torch.equal(call(), want[name]), name
        assert cpu_kernels.pool_stats()["jobs"] == jobs
    finally:
        torch.set_num_threads(2)
        cpu_kernels.kernels_mode("openmp")
    with pytest.raises(ValueError, match="'gpu'"):
        cpu_kernels.kernels_mode("gpu")


def test_auto_follows_the_contended_flag(threads2):
    cpu_kernels.pool_config(mode=2)
    cpu_kernels.pool_contended(False)
    assert cpu_kernels.pool_stats()["on"] == 0
    cpu_kernels.pool_contended(True)
    st = cpu_kernels.pool_stats()
    assert st["on"] == 1 and st["contended"] == 1
    cpu_kernels.pool_config(mode=0)
    assert cpu_kernels.pool_stats()["on"] == 0


def test_bad_settings_name_the_value(monkeypatch):
    monkeypatch.setenv("SPECBUILD_POOL", "sometimes")
    with pytest.raises(BundleError, match="SPECBUILD_POOL='sometimes'"):
        cpu_kernels.pool_mode()
    monkeypatch.setenv("SPECBUILD_POOL", "ON")
    assert cpu_kernels.pool_mode() == 1
    monkeypatch.setenv("SPECBUILD_POOL_SPIN_US", "-3")
    with pytest.raises(BundleError, match="SPECBUILD_POOL_SPIN_US='-3'"):
        cpu_kernels.pool_spin_us()
    monkeypatch.setenv("SPECBUILD_POOL_SPIN_US", "200001")
    with pytest.raises(BundleError, match="0..100000"):
        cpu_kernels.pool_spin_us()
    monkeypatch.delenv("SPECBUILD_POOL")
    monkeypatch.delenv("SPECBUILD_POOL_SPIN_US")
    kernels_or_skip()
    with pytest.raises(RuntimeError, match="mode must be -1..2"):
        torch.ops.specbuild_cpu.pool_config(7, -1)
    with pytest.raises(RuntimeError, match="items \\* reps must be at most"):
        cpu_kernels.pool_check(1 << 20, 1, 100)


class FakeMachine:
    """/proc/stat and the clock of a 2-CPU machine whose other processes use `others` cores."""

    def __init__(self):
        self.now, self.busy, self.others = 0.0, 0.0, 0.0

    def reader(self):
        total = int(self.now * 200)
        return {0: (total - int(self.busy), total), 1: (total, total)}

    def advance(self, seconds):
        self.now += seconds
        self.busy += self.others * seconds * 100


def test_the_governor_moves_the_kernels_onto_the_pool_under_load_and_back():
    m = FakeMachine()
    counts, pool = [], []
    gov = T.ThreadGovernor(2, cpus=[0, 1], clock=lambda: m.now, reader=m.reader, own_cpu=lambda: 0.0,
                           set_threads=counts.append, tick_s=0.01, pool=pool.append)
    for _ in range(20):
        gov.before()
        m.advance(0.03)
        gov.after(0.03)
    assert gov.state == "free" and pool == [] and gov.threads == 2
    m.others = 1.5
    for _ in range(40):
        gov.before()
        m.advance(0.03)
        gov.after(0.03)
    # no trial: the full count stays, the kernels' loops go onto the pool
    assert gov.state == "pool" and pool == [True] and gov.threads == 2 and gov.trials == 0
    assert set(counts) == {2}
    assert gov.describe()["pool"] is True
    m.others = 0.0
    for _ in range(40):
        gov.before()
        m.advance(0.03)
        gov.after(0.03)
    assert gov.state == "free" and pool == [True, False] and gov.describe()["pool_switches"] == 2
