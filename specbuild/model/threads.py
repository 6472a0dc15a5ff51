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
the cores count as free.

The thread count is torch's (or --threads) at load; while serving, ThreadGovernor (below) moves
the kernels' loops onto their own pool when others' load appears (SPECBUILD_POOL=auto, the
default; cpu_kernels.pool_contended), or with SPECBUILD_POOL=0 lowers the count when a trial finds
fewer threads faster, and undoes either when the load goes (docs/cpu-kernels.md, "The thread
governor" and "The kernels' own pool under others' load"). One thread beside a busy neighbour has
measured 2-4x slower than two that sleep (AMD EPYC, eager) and 1.8x faster than two (Intel Xeon,
compiled int4), which is why it is a trial and not a rule.
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


def rank_threads(world_size: int, environ=None, cores: int | None = None) -> tuple[int, str]:
    """(threads, why) for one of `world_size` MPI ranks when --threads is not given: this host's
    usable cores shared among the ranks on this host (MPICH's MPI_LOCALNRANKS, Open MPI's
    OMPI_COMM_WORLD_LOCAL_SIZE, else all ranks), at least 1. Two ranks of two threads each on
    two cores would spin against each other at every parallel region."""
    environ = os.environ if environ is None else environ
    cores = len(allowed_cpus()) if cores is None else cores
    local, source = world_size, "ranks in the world"
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if environ.get(key, "").strip().isdigit() and int(environ[key]) > 0:
            local, source = int(environ[key]), key
            break
    n = max(1, cores // max(1, local))
    return n, f"{cores} usable cores / {local} ranks on this host ({source}); --threads to choose"


# ---- the thread count while serving -----------------------------------------------------------
# Beside a CPU-bound neighbour, fewer threads can beat more (compiled int4-a8 SmolLM2, 2-core
# Xeon, 2026-12-03: 1 thread 23.7 ms/token loaded against 42.3 for 2 spinning and 31.6 for 2
# passive), and elsewhere the opposite was measured (float32 eager: one thread 2-4x slower than two
# sleeping ones). So the count is not chosen by a rule: when others' load appears on this
# process's cores, the governor runs a trial, alternating steps between the candidate counts, and
# keeps the faster for a while; when the load is gone it goes back to the full count.
CHECK_S = 0.1       # how often others' CPU use is read (/proc/stat minus this process's own)
TRIAL_STEPS = 6     # steps per candidate in a trial (alternating, so both see the same mix of widths)
HOLD_S = 10.0       # how long a trial's winner holds while the load stays before the next trial
STALE_S = 4 * CHECK_S  # a reading older than this (the engine was idle) is a new baseline
RESAMPLE_S = 0.05   # ... and the next check this soon (5 jiffies of 10 ms a CPU: a short phase of load is seen early)
BUSY_ENTER = 0.6    # cores' worth of others' use at which the cores count as contended
BUSY_LEAVE = 0.35   # ... and below which they count as free again


def busy_jiffies(cpus: list[int], reader=read_cpu_times) -> int:
    """Busy jiffies (total minus idle and I/O wait; steal counts as busy) summed over `cpus`."""
    times = reader()
    return sum(times[c][1] - times[c][0] for c in cpus if c in times)


class ThreadGovernor:
    """The torch thread count of an engine's steps, adapted to the cores others leave free.

    before() is called before each step, after(seconds) with the step's wall time. Candidate
    counts: the full count, and the cores left after others' use (at least 1). A trial
    alternates them step by step (TRIAL_STEPS each) and keeps the one with the lower median step
    time; the winner holds for HOLD_S, then, if the load is still there, a new trial runs.

    With `pool` (a callable taking a bool: cpu_kernels.pool_contended, under SPECBUILD_POOL=auto
    or 1) there is no trial: under others' load the kernels' loops move onto their own pool
    (cpu_kernels.cpp: the caller never waits for a helper that is off the CPU) at the full
    count, which beat one thread there (Intel Xeon, compiled int4-a8, 2026-12-05: 10.9 ms/token
    against 13.1 beside a 2-thread neighbour, scripts/bench_threads.py), and move back when the
    load goes.

    Only for models whose results do not depend on the thread count (the engine checks this at
    load): the thread count must never change a token. Clock, /proc/stat reader, own-CPU clock
    and setter are injectable (tests drive it without timing anything)."""

    def __init__(self, max_threads: int, cpus: list[int] | None = None, clock=time.monotonic,
                 reader=read_cpu_times, own_cpu=time.process_time, set_threads=None, tick_s: float | None = None,
                 pool=None):
        if max_threads < 1:
            raise ValueError(f"max_threads={max_threads} must be at least 1")
        self.max_threads = max_threads
        self.cpus = allowed_cpus() if cpus is None else cpus
        self.clock, self.reader, self.own_cpu = clock, reader, own_cpu
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.set_threads = set_threads
        self.tick_s = tick_s if tick_s is not None else 1.0 / os.sysconf("SC_CLK_TCK")
        self.threads = max_threads
        self.pool = pool
        self.pooled = False  # whether pool(True) is in force
        self.pool_switches = 0
        self.state = "free"  # free | trial | hold | pool
        self.others = 0.0  # cores' worth of others' use at the last check
        self.trials = 0
        self.changes = 0
        self.hold_until = 0.0
        self.candidates: list[int] = [max_threads]
        self.samples: dict[int, list[float]] = {}
        self._last: tuple[float, int, float] | None = None  # (wall, busy jiffies, own cpu) at the last check
        self._next_check = 0.0
        self._primed = False
        self.broken: str | None = None  # why /proc/stat could not be read (the governor then stays put)

    def _read_others(self, now: float) -> float | None:
        try:
            sample = (now, busy_jiffies(self.cpus, self.reader), self.own_cpu())
        except (OSError, ValueError, IndexError, KeyError) as e:
            self.broken = f"{type(e).__name__}: {e}"
            return None
        last, self._last = self._last, sample
        if last is None or sample[0] <= last[0]:
            return None
        if sample[0] - last[0] > STALE_S:  # after an idle gap: measure from now, not over the gap
            self._next_check = now + RESAMPLE_S
            return None
        wall = sample[0] - last[0]
        busy = (sample[1] - last[1]) * self.tick_s
        return max(0.0, (busy - (sample[2] - last[2])) / wall)

    def _use(self, n: int) -> None:
        if n != self.threads:
            self.set_threads(n)
            self.threads = n
            self.changes += 1

    def _set_pool(self, on: bool) -> None:
        if self.pool is not None and on != self.pooled:
            self.pool(on)
            self.pooled = on
            self.pool_switches += 1

    def before(self) -> int:
        """Set the thread count for the next step; returns it."""
        now = self.clock()
        if not self._primed:  # the step thread's own count (OpenMP's is per thread)
            self.set_threads(self.threads)
            self._primed = True
        if self.broken is None and now >= self._next_check:
            self._next_check = now + CHECK_S
            others = self._read_others(now)
            if others is not None:
                self.others = others
                self._on_load(now, others)
        if self.state == "trial":
            counts = {n: len(self.samples[n]) for n in self.candidates}
            self._use(min(self.candidates, key=lambda n: (counts[n], -n)))  # the arm with fewer samples
        return self.threads

    def _on_load(self, now: float, others: float) -> None:
        if self.state == "trial":
            return  # a trial finishes before the load is looked at again
        if others < BUSY_LEAVE or (self.state == "free" and others < BUSY_ENTER):
            self.state = "free"
            self._use(self.max_threads)
            self._set_pool(False)
            return
        if self.pool is not None:
            self.state = "pool"
            self._use(self.max_threads)
            self._set_pool(True)
            return
        if self.state == "hold" and now < self.hold_until:
            return
        left = max(1, min(self.max_threads, int(len(self.cpus) - others + 0.5)))
        if left >= self.max_threads:
            self.state = "free"
            self._use(self.max_threads)
            return
        self.candidates = [self.max_threads, left]
        self.samples = {n: [] for n in self.candidates}
        self.state = "trial"
        self.trials += 1

    def after(self, seconds: float) -> None:
        """The wall time of the step that ran at the current count."""
        if self.state != "trial" or self.threads not in self.samples:
            return
        self.samples[self.threads].append(seconds)
        if all(len(v) >= TRIAL_STEPS for v in self.samples.values()):
            best = min(self.candidates, key=lambda n: (sorted(self.samples[n])[len(self.samples[n]) // 2], -n))
            self._use(best)
            self.state = "hold"
            self.hold_until = self.clock() + HOLD_S

    def describe(self) -> dict:
        out = {"threads": self.threads, "adaptive": True, "max_threads": self.max_threads, "state": self.state,
               "others_cores": round(self.others, 2), "trials": self.trials, "changes": self.changes}
        if self.pool is not None:
            out.update(pool=self.pooled, pool_switches=self.pool_switches)
        if self.broken:
            out["broken"] = self.broken
        return out
