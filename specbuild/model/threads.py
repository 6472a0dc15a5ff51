"""The wait policy of torch's OpenMP threads, chosen from the cores free when specbuild starts.

Between two parallel regions (a decode step has hundreds: every linear, every attention
call), an OpenMP thread that has finished its share waits for the next. libgomp (torch's
OpenMP on Linux) spins 300,000 times before it sleeps; on a machine whose cores are busy with
other processes the spinning threads take the cores from the thread the region is waiting
for, and a step costs 10-100x its idle time. Sleeping at once (`OMP_WAIT_POLICY=PASSIVE`) costs
a wake-up per region instead, which is what a quiet machine notices. So, unless the user set
`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`, specbuild/__init__.py sets, before torch loads OpenMP:

- `GOMP_SPINCOUNT=10000` (a brief spin) when the cores are free at start: near the spinning
  default's speed on a quiet machine (a float32 step 30 ms against 29, PASSIVE 43), and 2.0x
  its idle figure beside a 2-thread neighbour started later;
- `GOMP_SPINCOUNT=100` (hardly any spin: PASSIVE's behaviour, a little cheaper at the next
  region) when they are not: 4-10x faster than 10000 on a shared 2-core machine, idle or
  beside a neighbour (docs/cpu-kernels.md, "Threads under load").

Free cores are read from /proc/stat: the idle (and I/O wait) time of each CPU this process
may run on, over a short sample while this process sleeps. Where /proc/stat cannot be read,
the cores count as free. The thread count stays torch's (or --threads): one thread beside a
busy neighbour measured 2-4x slower than two that sleep when they wait.
"""

from __future__ import annotations

import os
import time

SAMPLE_S = 0.1  # a few scheduler ticks per CPU; paid once per process, at import
QUIET_SPINCOUNT = "10000"
BUSY_SPINCOUNT = "100"
BUSY_BELOW = 0.75  # a core counts as taken when less than this share of it is idle, on average

CHOSEN: dict = {}  # what wait_policy() chose in this process (bench scripts print it)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask), else 0..cpu_count-1."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def read_cpu_times(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """cpu index -> (idle jiffies incl. I/O wait, total jiffies) from /proc/stat's per-CPU lines."""
    out = {}
    with open(path) as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            out[int(name[3:])] = (values[3] + values[4], sum(values))
    return out


def free_cores(sample_s: float = SAMPLE_S, cpus: list[int] | None = None, reader=read_cpu_times,
               sleep=time.sleep) -> float | None:
    """Cores' worth of idle time among `cpus` (default: this process's) over `sample_s`, or None
    where it cannot be read. Steal time (a VM's host running others) counts as busy."""
    cpus = allowed_cpus() if cpus is None else cpus
    try:
        before = reader()
        sleep(sample_s)
        after = reader()
    except (OSError, ValueError, IndexError):
        return None
    free, seen = 0.0, 0
    for c in cpus:
        if c not in before or c not in after:
            continue
        seen += 1
        idle = after[c][0] - before[c][0]
        total = after[c][1] - before[c][1]
        free += idle / total if total > 0 else 1.0
    return free if seen else None


def choose_spincount(cores: int, free: float | None) -> tuple[str, str]:
    """(GOMP_SPINCOUNT, reason) for `cores` usable cores of which `free` are idle (None: unknown)."""
    if cores < 1:
        raise ValueError(f"cores={cores} must be at least 1")
    if free is None:
        return QUIET_SPINCOUNT, f"free cores unknown; {cores} usable"
    if free >= BUSY_BELOW * cores:
        return QUIET_SPINCOUNT, f"{free:.1f} of {cores} usable cores free at start"
    return BUSY_SPINCOUNT, f"only {free:.1f} of {cores} usable cores free at start"


def wait_policy(environ=None, free: float | None = None, measure=free_cores) -> dict:
    """Set GOMP_SPINCOUNT in `environ` (default os.environ) unless the user chose a policy
    (OMP_WAIT_POLICY or GOMP_SPINCOUNT set); returns {"policy", "reason"} (also kept in CHOSEN).
    `free` given: that many free cores instead of a measurement (tests)."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        chosen = {"policy": " ".join(f"{k}={environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in environ),
                  "reason": "set by the user"}
    else:
        cores = len(allowed_cpus())
        spin, reason = choose_spincount(cores, measure() if free is None else free)
        environ["GOMP_SPINCOUNT"] = spin
        chosen = {"policy": f"GOMP_SPINCOUNT={spin}", "reason": reason}
    CHOSEN.clear()
    CHOSEN.update(chosen)
    return chosen
