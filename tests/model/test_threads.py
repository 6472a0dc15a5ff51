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
