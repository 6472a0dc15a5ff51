"""The OpenMP wait policy chosen from the cores free at start (specbuild/model/threads.py)."""

import subprocess
import sys

import pytest

from specbuild.model import threads as T


def stat_lines(per_cpu: dict[int, tuple[int, int, int]]) -> str:
    """/proc/stat text with per-CPU (user, idle, steal) jiffies."""
    total = [sum(v[i] for v in per_cpu.values()) for i in range(3)]
    lines = [f"cpu  {total[0]} 0 0 {total[1]} 0 0 0 {total[2]} 0 0"]
    lines += [f"cpu{c} {u} 0 0 {i} 0 0 0 {s} 0 0" for c, (u, i, s) in per_cpu.items()]
    return "\n".join(lines + ["intr 1 2 3", "procs_running 3"]) + "\n"


def test_read_cpu_times_parses_per_cpu_lines(tmp_path):
    path = tmp_path / "stat"
    path.write_text(stat_lines({0: (100, 50, 5), 1: (10, 200, 0)}))
    assert T.read_cpu_times(str(path)) == {0: (50, 155), 1: (200, 210)}


def test_free_cores_counts_idle_share_and_steal_as_busy():
    samples = iter([{0: (0, 0), 1: (0, 0)}, {0: (25, 100), 1: (100, 100)}])
    slept = []
    free = T.free_cores(0.05, cpus=[0, 1], reader=lambda: next(samples), sleep=slept.append)
    assert free == pytest.approx(1.25) and slept == [0.05]
    # only the CPUs this process may use count
    samples = iter([{0: (0, 0), 1: (0, 0)}, {0: (0, 100), 1: (100, 100)}])
    assert T.free_cores(0.0, cpus=[0], reader=lambda: next(samples), sleep=lambda s: None) == 0.0


def test_free_cores_unknown_where_proc_stat_is_unreadable():
    def broken():
        raise OSError("no /proc here")

    assert T.free_cores(0.0, cpus=[0], reader=broken, sleep=lambda s: None) is None
    assert T.free_cores(0.0, cpus=[7], reader=lambda: {0: (0, 0)}, sleep=lambda s: None) is None


def test_spincount_from_free_cores():
    assert T.choose_spincount(2, 2.0)[0] == T.QUIET_SPINCOUNT
    assert T.choose_spincount(2, 1.6)[0] == T.QUIET_SPINCOUNT
    assert T.choose_spincount(2, 1.0)[0] == T.BUSY_SPINCOUNT
    assert T.choose_spincount(2, 0.0)[0] == T.BUSY_SPINCOUNT
    assert T.choose_spincount(16, 8.0)[0] == T.BUSY_SPINCOUNT
    spin, reason = T.choose_spincount(2, None)
    assert spin == T.QUIET_SPINCOUNT and "unknown" in reason
    with pytest.raises(ValueError, match="cores=0"):
        T.choose_spincount(0, 1.0)


def test_wait_policy_sets_the_spin_count_unless_the_user_chose():
    env = {}
    got = T.wait_policy(env, free=0.2)
    assert env == {"GOMP_SPINCOUNT": T.BUSY_SPINCOUNT} and "0.2" in got["reason"] and T.CHOSEN == got
    env = {}
    T.wait_policy(env, free=float(len(T.allowed_cpus())))
    assert env == {"GOMP_SPINCOUNT": T.QUIET_SPINCOUNT}
    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5"}):
        env = dict(user)
        got = T.wait_policy(env, free=0.0, measure=lambda: pytest.fail("measured despite the user's choice"))
        assert env == user and got["reason"] == "set by the user"


def test_import_sets_the_policy_before_torch_loads():
    """`import specbuild` in a fresh process leaves a GOMP_SPINCOUNT of the two choices."""
    code = ("import os; os.environ.pop('GOMP_SPINCOUNT', None); os.environ.pop('OMP_WAIT_POLICY', None)\n"
            "import specbuild, sys; from specbuild.model.threads import CHOSEN\n"
            "assert 'torch' not in sys.modules\n"
            "print(os.environ['GOMP_SPINCOUNT'], CHOSEN['policy'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    spin, policy = out.stdout.split()
    assert spin in (T.QUIET_SPINCOUNT, T.BUSY_SPINCOUNT) and policy == f"GOMP_SPINCOUNT={spin}"


# ---- the thread governor (no timing: a fake clock, /proc/stat and own-CPU clock) ---------------
class FakeMachine:
    """Two CPUs; `others` cores' worth of another process's use and `own` of ours per second."""

    def __init__(self, others: float = 0.0, own: float = 2.0):
        self.now, self.others, self.own = 0.0, others, own
        self.busy, self.cpu = 0.0, 0.0  # busy jiffies (100 per s per core), own CPU seconds
        self.set_calls: list[int] = []

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.busy += (self.others + self.own) * seconds * 100
        self.cpu += self.own * seconds

    def reader(self):  # cpu -> (idle, total); all busy time on cpu 0 (the governor sums the CPUs)
        total = int(self.now * 100)
        return {0: (total - int(self.busy), total), 1: (total, total)}

    def governor(self, max_threads: int = 2) -> T.ThreadGovernor:
        return T.ThreadGovernor(max_threads, cpus=[0, 1], clock=lambda: self.now, reader=self.reader,
                                own_cpu=lambda: self.cpu, set_threads=self.set_calls.append, tick_s=0.01)


def run_steps(m: FakeMachine, g: T.ThreadGovernor, n: int, step_s) -> list[int]:
    """n steps; step_s(threads) is a step's wall time at that count. Returns the counts used."""
    used = []
    for _ in range(n):
        t = g.before()
        used.append(t)
        m.advance(step_s(t))
        g.after(step_s(t))
    return used


def test_governor_keeps_the_full_count_on_free_cores():
    m = FakeMachine(others=0.1)
    g = m.governor()
    used = run_steps(m, g, 200, lambda t: 0.01)
    assert set(used) == {2} and g.trials == 0 and g.state == "free"
    assert m.set_calls == [2]  # the step thread's count, set once


def test_under_load_a_trial_picks_the_faster_count_and_both_arms_run():
    m = FakeMachine(others=1.2)
    g = m.governor()
    used = run_steps(m, g, 200, lambda t: 0.02 if t == 1 else 0.04)  # one thread faster under load
    assert g.trials >= 1 and used.count(2) >= T.TRIAL_STEPS and used.count(1) >= T.TRIAL_STEPS
    assert used[-1] == 1 and g.state == "hold" and g.describe()["others_cores"] == pytest.approx(1.2, abs=0.1)
    # where the full count is faster under load, the trial keeps it
    m = FakeMachine(others=1.2)
    g = m.governor()
    used = run_steps(m, g, 200, lambda t: 0.05 if t == 1 else 0.03)
    assert g.trials >= 1 and 1 in used and used[-1] == 2 and g.state == "hold"


def test_the_winner_holds_then_a_new_trial_runs_and_free_cores_restore_the_full_count():
    m = FakeMachine(others=1.2)
    g = m.governor()
    run_steps(m, g, 100, lambda t: 0.02 if t == 1 else 0.04)
    first = g.trials
    run_steps(m, g, int(T.HOLD_S / 0.02) + 50, lambda t: 0.02 if t == 1 else 0.04)
    assert g.trials == first + 1  # one more trial after HOLD_S, not one per check
    m.others = 0.0
    used = run_steps(m, g, 100, lambda t: 0.02 if t == 1 else 0.04)
    assert used[-1] == 2 and g.state == "free"


def test_an_idle_gap_is_not_read_as_load():
    """Between requests the engine does not step; the first reading after a gap is a new
    baseline, so others' load during the gap (gone now) starts no trial."""
    m = FakeMachine(others=0.0)
    g = m.governor()
    run_steps(m, g, 50, lambda t: 0.01)
    m.others, m.own = 1.5, 0.0
    m.advance(5.0)  # a neighbour ran while we were idle, and stopped
    m.others, m.own = 0.0, 2.0
    used = run_steps(m, g, 100, lambda t: 0.01)
    assert set(used) == {2} and g.trials == 0


def test_one_core_left_means_no_trial_and_unreadable_stat_leaves_the_count():
    m = FakeMachine(others=1.2)
    g = m.governor(max_threads=1)
    assert set(run_steps(m, g, 100, lambda t: 0.02)) == {1} and g.trials == 0

    def broken():
        raise OSError("no /proc here")

    m = FakeMachine(others=1.2)
    g = T.ThreadGovernor(2, cpus=[0, 1], clock=lambda: m.now, reader=broken, own_cpu=lambda: m.cpu,
                         set_threads=m.set_calls.append, tick_s=0.01)
    assert set(run_steps(m, g, 50, lambda t: 0.02)) == {2} and "no /proc" in g.describe()["broken"]
    with pytest.raises(ValueError, match="max_threads=0"):
        T.ThreadGovernor(0, cpus=[0], set_threads=lambda n: None)


def test_mpi_ranks_share_the_hosts_cores_unless_threads_is_given():
    assert T.rank_threads(2, {"MPI_LOCALNRANKS": "2"}, cores=2)[0] == 1
    n, why = T.rank_threads(2, {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, cores=16)
    assert n == 8 and "OMPI_COMM_WORLD_LOCAL_SIZE" in why and "--threads" in why
    assert T.rank_threads(2, {"MPI_LOCALNRANKS": "1"}, cores=4)[0] == 4  # the peer is on another host
    assert T.rank_threads(3, {}, cores=2)[0] == 1  # no launcher variable: every rank counts
    assert T.rank_threads(2, {"MPI_LOCALNRANKS": "junk"}, cores=2)[0] == 1
