"""How the kernels' threads run: OpenMP's wait policy, fixed before torch loads, and the
choice, made in the thread that runs the engine's steps, between the kernels' own pool, torch's
OpenMP and one thread.

OpenMP's wait policy. Between two parallel regions (a decode step has hundreds) an OpenMP thread
that finished its share waits for the next. libgomp spins 300,000 times before it sleeps by
default; specbuild/__init__.py sets `GOMP_SPINCOUNT=10000` (a brief spin) unless the user set
`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`. libgomp reads it once, when torch loads it, so it is fixed
for the life of the process. It used to be chosen from a 0.1 s sample of /proc/stat at import
(100 when fewer than 1.5 of 2 cores looked idle); any process starting beside specbuild, even
the reader at the other end of a pipe, tripped it and made `generate` 2-3x slower for its whole
life (issue 50). The kernels no longer depend on it: where others' load appears their loops move
onto their own pool, whose helpers sleep at once under load.

The kernels' threading (ThreadGovernor.decide and its trials): candidates are the kernels' own
pool (cpu_kernels.cpp, `pool::run`: the caller takes chunks itself and never waits at a barrier
for a thread that is off the CPU), torch's OpenMP, and one thread, all giving the same bits. The
engine times them in the thread that will run its steps (the engine loop's thread under `serve`,
Triton and MPI; the caller's under `generate` and `bench`), keeps the fastest, says so in one
line, and tries them again on real steps while it serves (every REVISIT_S), since a server's own
event loop, waking on every token, changes which is fastest. SPECBUILD_POOL=1 or 0 fixes the
choice to the pool or OpenMP.

Under others' load (read from /proc/stat: this CPU's busy time less this process's own) the
kernels move onto the pool at the full thread count with helpers that sleep at once; with
SPECBUILD_POOL=0 a trial of the full count against fewer threads runs instead (docs/cpu-kernels.md,
"The thread governor"). One thread beside a busy neighbour has measured 2-4x slower than two that
sleep (AMD EPYC, eager) and 1.8x faster than two (Intel Xeon, compiled int4), which is why it is
a trial and not a rule.
"""

from __future__ import annotations

import os
import statistics
import time

SPINCOUNT = "10000"  # GOMP_SPINCOUNT unless the user chose one (see the module doc)

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


def wait_policy(environ=None) -> dict:
    """Set GOMP_SPINCOUNT=SPINCOUNT in `environ` (default os.environ) unless the user chose a
    policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT set); returns {"policy", "reason"} (also kept in
    CHOSEN). Decided by nothing that varies from one start to the next (see the module doc)."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        chosen = {"policy": " ".join(f"{k}={environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in environ),
                  "reason": "set by the user"}
    else:
        environ["GOMP_SPINCOUNT"] = SPINCOUNT
        chosen = {"policy": f"GOMP_SPINCOUNT={SPINCOUNT}", "reason": "specbuild's default (a brief spin)"}
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
# the kernels' threading on free cores (ThreadGovernor.decide, and its trials on real steps)
REVISIT_S = 30.0    # while stepping on free cores, the candidates are tried again on real steps this often
FIRST_REVISIT_S = 3.0  # ... the first time this soon after the start-up choice (at once where others' load was seen)
MODE_STEPS = 5      # rounds of real steps in such a trial (one step per candidate in turn, all of one shape)
MODE_ROUNDS_MAX = 60  # ... rounds tried before a trial that found too few alike ends, keeping the choice
# fewer threads than the widest must be this much faster to be chosen (_fastest); on free cores the
# pool's two threads ran a one-row forward 15-25% faster than one thread in every start-up timing
# of 2026-12-07 (AMD EPYC), yet trials on real steps, beside the HTTP loop and the clients, gave one
# thread 2% and 12% wins; others' load (0.6 cores and up) moves the kernels to the pool anyway
NARROW_MARGIN = 0.20
DECIDE_ROUNDS = 7   # start-up: interleaved rounds ...
DECIDE_CALLS = 3    # ... of this many timed calls of each candidate (medians of the rounds)


POOL_LABEL = "the kernels' pool"


def choice_label(choice: tuple[str, int]) -> str:
    mode, n = choice
    if n == 1:
        return "1 thread"
    return f"{POOL_LABEL if mode == 'pool' else 'OpenMP'} x{n}"


READ_ERRORS = (OSError, ValueError, IndexError, KeyError)  # what reading /proc/stat may raise


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

    On free cores the kernels run as self.choice, one of `choices` ((mode, threads)): decide(measure)
    picks it at start-up in the calling thread (the one that then runs the steps), and every
    REVISIT_S a trial on real steps (MODE_STEPS each, taken in turn) picks again.

    Only for models whose results do not depend on the thread count (the engine checks this at
    load): the thread count must never change a token. Clock, /proc/stat reader, own-CPU clock
    and setter are injectable (tests drive it without timing anything)."""

    def __init__(self, max_threads: int, cpus: list[int] | None = None, clock=time.monotonic,
                 reader=read_cpu_times, own_cpu=time.process_time, set_threads=None, tick_s: float | None = None,
                 pool=None, set_mode=None, choices: list[tuple[str, int]] | None = None):
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
        # the kernels' threading on free cores: (mode, threads) candidates, mode "pool" (the
        # kernels' own pool) or "openmp"; set_mode(mode) switches the kernels' loops (cpu_kernels.
        # kernels_mode). One candidate: fixed (SPECBUILD_POOL=1 or 0), no start-up choice, no trials
        self.set_mode = set_mode
        self.choices = list(choices) if choices else [("openmp", max_threads)]
        for mode, n in self.choices:
            if mode not in ("pool", "openmp") or not 1 <= n <= max_threads:
                raise ValueError(f"choice {(mode, n)} must be (pool|openmp, 1..{max_threads})")
        self.choice = self.choices[0]
        self.mode: str | None = None  # what set_mode last set
        self.kernel_threads = max_threads  # ... and the kernels' width
        self.decided: dict | None = None  # decide()'s figures, and the thread it ran in
        self.mode_trials = 0
        self.revisit_at = 0.0
        self.mode_samples: dict[tuple[str, int], list[float]] = {}
        self._round: list[tuple[tuple[str, int], float, object]] = []  # this trial round's (candidate, seconds, shape)
        self._rounds_tried = 0
        self.mode_trials_inconclusive = 0
        self.last_trial_ms: dict[str, float] = {}

    def _sample(self, now: float) -> tuple[float, int, float]:
        """(wall, busy jiffies of self.cpus, this process's CPU seconds) now; raises what the
        /proc/stat reader raises."""
        return now, busy_jiffies(self.cpus, self.reader), self.own_cpu()

    def _others(self, last: tuple[float, int, float], sample: tuple[float, int, float]) -> float:
        """Cores' worth of others' use between two samples: busy time less this process's own."""
        busy = (sample[1] - last[1]) * self.tick_s
        return max(0.0, (busy - (sample[2] - last[2])) / (sample[0] - last[0]))

    def _read_others(self, now: float) -> float | None:
        try:
            sample = self._sample(now)
        except READ_ERRORS as e:
            self.broken = f"{type(e).__name__}: {e}"
            return None
        last, self._last = self._last, sample
        if last is None or sample[0] <= last[0]:
            return None
        if sample[0] - last[0] > STALE_S:  # after an idle gap: measure from now, not over the gap
            self._next_check = now + RESAMPLE_S
            return None
        return self._others(last, sample)

    def _fastest(self, ms: dict[tuple[str, int], float]) -> tuple[str, int]:
        """The candidate with the lowest ms (ties: more threads, then the pool); one of fewer
        threads than the widest only where it beats the fastest of the widest by NARROW_MARGIN.
        The timed forwards are one shape (a one-row decode at start-up, the trial's shape on real
        steps), where a near tie says little about wider steps, which fewer threads run much
        slower: served at C=4, a trial on narrow steps chose one thread at 7.57 ms against the
        pool's 7.76, and that server's steps of 16 rows then took 23.4 ms against 16.7 on its
        neighbours' pools; another trial gave one thread 6.79 ms against 7.74 at one row, and
        that server served 0.94x its neighbour of the same method (AMD EPYC, 2026-12-07)."""
        best = min(self.choices, key=lambda c: (ms[c], -c[1], c[0] != "pool"))
        widest = max(c[1] for c in self.choices)
        if best[1] < widest:
            wide = min((c for c in self.choices if c[1] == widest), key=lambda c: (ms[c], c[0] != "pool"))
            if ms[best] > ms[wide] * (1.0 - NARROW_MARGIN):
                return wide
        return best

    def _use(self, n: int) -> None:
        if n != self.threads:
            self.set_threads(n)
            self.threads = n
            self.changes += 1

    def reprime(self) -> None:
        """The next before() sets this thread's count again (a caller changed it between runs)."""
        self._primed = False

    def _apply(self, choice: tuple[str, int]) -> None:
        """The kernels on `choice`: ("pool", n) is the pool n wide with torch's own ops on one thread
        (set_mode(mode, n) sets the pool's width), ("openmp", n) torch's OpenMP at n threads."""
        mode, n = choice
        if self.set_mode is not None and (mode, n) != (self.mode, self.kernel_threads):
            self.set_mode(mode, n)
            self.mode, self.kernel_threads = mode, n
        self._use(1 if mode == "pool" and self.set_mode is not None else n)

    def decide(self, measure) -> dict:
        """Choose self.choice among the candidates by timing them in this thread: measure() runs
        one call (a decode forward) and returns its seconds; interleaved rounds, medians. Returns
        (and keeps in self.decided) {"choice", "ms": {label: median ms}, "thread", "thread_ident"}."""
        import threading

        self.set_threads(self.threads)  # this thread's own count (OpenMP's is per thread)
        self._primed = True
        try:
            start = self._sample(self.clock())
        except READ_ERRORS:
            start = None
        if len(self.choices) > 1:
            samples: dict[tuple[str, int], list[float]] = {c: [] for c in self.choices}
            for c in self.choices:  # one untimed call each: first-call set-up (pool helpers, OpenMP team)
                self._apply(c)
                measure()
            for _ in range(DECIDE_ROUNDS):
                for c in self.choices:
                    self._apply(c)
                    samples[c].append(min(measure() for _ in range(DECIDE_CALLS)))
            ms = {c: statistics.median(v) * 1e3 for c, v in samples.items()}
            self.choice = self._fastest(ms)
        else:
            ms = {}
        self._apply(self.choice)
        t = threading.current_thread()
        others = None
        if start is not None:
            try:
                end = self._sample(self.clock())
                others = self._others(start, end) if end[0] > start[0] else None
            except READ_ERRORS:
                pass
        self.decided = {"choice": choice_label(self.choice), "ms": {choice_label(c): round(v, 3) for c, v in ms.items()},
                        "thread": t.name, "thread_ident": t.ident,
                        "others_cores": None if others is None else round(others, 2)}
        # others' load while timing (another process starting beside this one) can pick the wrong
        # candidate: then the real steps try again at once; else soon (FIRST_REVISIT_S), then every REVISIT_S
        under_load = others is not None and others >= BUSY_ENTER
        self.revisit_at = self.clock() + (0.0 if under_load else FIRST_REVISIT_S)
        return self.decided

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
        if self.state == "free" and len(self.choices) > 1 and self.set_mode is not None and now >= self.revisit_at:
            self.state = "mode-trial"
            self.mode_samples = {c: [] for c in self.choices}
            self._round, self._rounds_tried = [], 0
            self.mode_trials += 1
        if self.state == "trial":
            counts = {n: len(self.samples[n]) for n in self.candidates}
            self._use(min(self.candidates, key=lambda n: (counts[n], -n)))  # the arm with fewer samples
        elif self.state == "mode-trial":
            self._apply(self.choices[len(self._round) % len(self.choices)])  # each candidate in turn
        return self.threads

    def _on_load(self, now: float, others: float) -> None:
        if self.state in ("trial", "mode-trial"):
            return  # a trial finishes before the load is looked at again
        if others < BUSY_LEAVE or (self.state == "free" and others < BUSY_ENTER):
            if self.state != "free":
                self.revisit_at = now  # the load went: the free cores' choice is tried again
            self.state = "free"
            self._apply(self.choice)
            self._set_pool(False)
            return
        if self.pool is not None:
            self.state = "pool"
            if self.set_mode is not None:  # the kernels on the pool at the full width
                self._apply(("pool", self.max_threads))
            else:
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

    @property
    def trialling(self) -> bool:
        """Whether the next step runs on a candidate under trial rather than on the choice (its
        wall time then says what that candidate costs, not what the kept one does)."""
        return self.state in ("trial", "mode-trial")

    def after(self, seconds: float, shape=None) -> None:
        """The wall time of the step that ran at the current count; `shape` (any comparable
        value: the engine gives the step's kind, batch and rows) says which steps are alike.

        A trial of the free cores' candidates runs them one step each in turn; a round counts
        only if its steps were alike (same shape), and it ends after MODE_STEPS counted rounds
        (the medians decide) or MODE_ROUNDS_MAX rounds (too few alike: the choice stays). Steps
        of unlike shapes cost unlike times: served at b=5-8, where prefill chunks come and go,
        5 steps each picked OpenMP at 28.7 ms over the pool's 32.8 for the pool's steps with
        the larger chunks, and that server's plain decoding then ran at 0.72x its neighbour's
        (AMD EPYC, 2026-12-07)."""
        if self.state == "mode-trial":
            current = (self.mode, self.kernel_threads)  # (a trial needs several choices, so set_mode)
            self._round.append((current, seconds, shape))
            if len(self._round) < len(self.choices):
                return
            rnd, self._round = self._round, []
            self._rounds_tried += 1
            if len({s for _, _, s in rnd}) == 1 and {c for c, _, _ in rnd} == set(self.mode_samples):
                for c, s, _ in rnd:
                    self.mode_samples[c].append(s)
            complete = all(len(v) >= MODE_STEPS for v in self.mode_samples.values())
            if not complete and self._rounds_tried >= MODE_ROUNDS_MAX:
                self.mode_trials_inconclusive += 1
                self.state = "free"
                self._apply(self.choice)
                self.revisit_at = self.clock() + REVISIT_S
                return
            if complete:
                ms = {c: statistics.median(v) * 1e3 for c, v in self.mode_samples.items()}
                self.choice = self._fastest(ms)
                self.last_trial_ms = {choice_label(c): round(v, 3) for c, v in ms.items()}
                self.state = "free"
                self._apply(self.choice)
                self.revisit_at = self.clock() + REVISIT_S
            return
        if self.state != "trial" or self.threads not in self.samples:
            return
        self.samples[self.threads].append(seconds)
        if all(len(v) >= TRIAL_STEPS for v in self.samples.values()):
            best = min(self.candidates, key=lambda n: (sorted(self.samples[n])[len(self.samples[n]) // 2], -n))
            self._use(best)
            self.state = "hold"
            self.hold_until = self.clock() + HOLD_S

    def describe(self) -> dict:
        out = {"threads": self.threads, "kernel_threads": self.kernel_threads if self.mode == "pool" else self.threads,
               "adaptive": True, "max_threads": self.max_threads, "state": self.state,
               "others_cores": round(self.others, 2), "trials": self.trials, "changes": self.changes}
        if self.pool is not None:
            out.update(pool=self.pooled, pool_switches=self.pool_switches)
        out.update(choice=choice_label(self.choice), choices=[choice_label(c) for c in self.choices],
                   mode_trials=self.mode_trials, mode_trials_inconclusive=self.mode_trials_inconclusive)
        if self.decided is not None:
            out["decided"] = self.decided
        if self.last_trial_ms:
            out["last_trial_ms"] = self.last_trial_ms
        if self.broken:
            out["broken"] = self.broken
        return out
