"""`auto`'s switch for the whole batch: does speculating pay at this batch size, now, here?

The depth controller (gamma.py) and `auto`'s choice of drafter (Speculator.choose_method) work
per sequence, on costs measured at start-up: the target's forward by width. What a speculative
step really costs where the server runs it (drafting, building a wider batch, verification,
the drafters' bookkeeping, and a forward that grows with every drafted row of every sequence in
the batch) is seen only by timing the steps themselves. This module does that.

For each batch size (the buckets of engine/stepparts.py: 1, 2, 3-4, 5-8, 9-16, 17+) it keeps
two arms, plain decoding and `auto`'s speculation, and the goodput each gave: tokens chosen per
second of wall time over that arm's last WINDOW pure decode steps (steps where every decoding
sequence is under `auto` and no prompt is being prefilled: those are what the arms differ in).
Each step runs the arm with the higher goodput (speculation must beat plain decoding by
SPEC_MARGIN: never slower comes first). The other arm is probed for PROBE_STEPS steps
(and judged on those steps alone, its older ones being from other text)
after PROBE_FIRST steps, then at intervals that double (to PROBE_MAX) while probes keep losing
and start again from PROBE_FIRST when one wins, so a speculation that stopped paying is off
within a few steps and costs at most PROBE_STEPS / PROBE_MAX of the steps afterwards (3%, and
only what those steps lose), and one
that starts paying (text turned repetitive, the batch shrank) comes back. A winner whose own
window (WINDOW steps run since the last probe) falls below the rate the other arm gave at that
probe (by SPEC_MARGIN where that arm is speculation) is challenged at once instead of at the
next scheduled probe: with intervals up to
PROBE_MAX steps, served runs ended with the winner's goodput far under the loser's last one
(speculation 530 tokens/s against plain's 679 at 5-8 sequences, 574 against 683 at 3-4) and
kept it for up to 96 steps. A batch size seen for
the first time starts on plain decoding, and probes speculation at once where its nearest
neighbour that compared both arms chose speculation.

Only how much is drafted changes: every step stays lossless. The speculator does not consult
it for a lone decoding sequence (Speculator.switch_auto): the batch's fit cuts that one's draft
step by step already.
"""

from __future__ import annotations

import collections


WINDOW = 16  # an arm's goodput: its last WINDOW pure steps at this batch size
PROBE_STEPS = 3  # steps of the other arm per probe
PROBE_FIRST = 12  # steps on the winning arm before the first probe (and again after a probe that won)
# the longest interval between probes (probes that keep losing double it up to this): 384 let a
# server that had learned plain on first-time text take ~400 steps to notice repeated text paying
# 2.9x (served, 2026-12-06); at 96 a probe costs at most 3 of 96 steps
PROBE_MAX = 96
MIN_STEPS = 3  # steps an arm needs before its goodput is believed
# speculation takes over from plain decoding only when its goodput beats plain's by this much: a
# probe is 3 steps of acceptance that swings with the text, and at 5-8 sequences a served run
# still spent 159 of 405 steps on speculation, whose window ended at 400 tokens/s against
# plain's 548 (AMD EPYC, 2026-12-07); where speculation really pays (text seen before: 2-3x)
# the margin changes nothing
SPEC_MARGIN = 0.05
ARMS = ("plain", "spec")
# batch sizes grouped as the served benchmark's concurrencies (largest size, name), then the rest
BUCKET_LIMITS = ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16"))
BUCKETS = tuple(name for _, name in BUCKET_LIMITS) + ("17+",)


def batch_bucket(n: int) -> str:
    """The bucket of a batch of n sequences: 1, 2, 3-4, 5-8, 9-16, 17+ (engine/stepparts.py keys
    its rows the same way)."""
    for hi, name in BUCKET_LIMITS:
        if n <= hi:
            return name
    return BUCKETS[-1]


class Bucket:
    """One batch size's arms: recent (tokens, seconds) per arm, the arm running, the probe plan."""

    def __init__(self, arm: str) -> None:
        self.hist = {a: collections.deque(maxlen=WINDOW) for a in ARMS}
        self.arm = arm  # the arm that won (or the starting arm)
        self.probing = 0  # steps of the current probe still to run
        self.interval = PROBE_FIRST
        self.until_probe = PROBE_FIRST
        self.switches = 0
        self.probes = 0
        self.challenges = 0  # probes started early because the winner fell below the other arm
        self.since_probe = 0  # the winner's counted steps since the last probe ended
        self.ran = dict.fromkeys(ARMS, 0)  # steps run on each arm here
        self.compared = False  # a probe has compared both arms' goodput here

    def rate(self, arm: str) -> float | None:
        h = self.hist[arm]
        if len(h) < MIN_STEPS:
            return None
        seconds = sum(s for _, s in h)
        return sum(t for t, _ in h) / seconds if seconds > 0 else None

    def other(self) -> str:
        return "plain" if self.arm == "spec" else "spec"


class GoodputSwitch:
    """Chooses, per step, whether `auto`'s sequences may speculate (`choose`), and learns from the
    step that ran (`observe`)."""

    def __init__(self) -> None:
        self.buckets: dict[str, Bucket] = {}
        self.current: tuple[str, str] | None = None  # (bucket, arm) the last choose() gave

    def _bucket(self, name: str) -> Bucket:
        b = self.buckets.get(name)
        if b is None:
            # every batch size starts on plain decoding (a served run at C=8 that started on
            # speculation spent 36% of its steps on the losing arm, 2026-12-06); where the nearest
            # neighbour that compared both arms chose speculation, it is probed at once
            b = self.buckets[name] = Bucket("plain")
            i = BUCKETS.index(name)
            for d in range(1, len(BUCKETS)):
                near = [BUCKETS[j] for j in (i - d, i + d) if 0 <= j < len(BUCKETS) and BUCKETS[j] in self.buckets
                        and self.buckets[BUCKETS[j]].compared]
                if near:
                    if self.buckets[near[0]].arm == "spec":
                        b.until_probe = 1
                    break
        return b

    def choose(self, batch: int, pure: bool = True) -> str:
        """The arm this step runs for a batch of `batch` decoding sequences: "plain" or "spec".
        A step that is not pure (a prompt is being prefilled, or a neighbour runs a method of its
        own) runs the winning arm and teaches nothing: probes run on pure steps only (at C=4 a
        new prompt came in every few steps, and probes spent on such steps were a third of all
        steps, 2026-12-06)."""
        name = batch_bucket(batch)
        b = self._bucket(name)
        if not pure:
            self.current = (name, b.arm, False)
            return b.arm
        if b.probing == 0 and b.rate(b.arm) is not None:
            b.until_probe -= 1
            if b.until_probe <= 0:
                b.probing, b.probes = PROBE_STEPS, b.probes + 1
                # the probed arm is judged on this probe's steps alone: its older steps are from
                # other text (first-time text, then the same prompts again: 2.4x apart)
                b.hist[b.other()].clear()
        arm = b.other() if b.probing else b.arm
        self.current = (name, arm, True)
        return arm

    def observe(self, tokens: int, seconds: float, pure: bool = True) -> None:
        """The step that the last choose() planned ended: `tokens` chosen in `seconds`; `pure`
        False when it prefilled after all (it is then not counted)."""
        if self.current is None:
            return
        name, arm, planned_pure = self.current
        self.current = None
        b = self.buckets[name]
        b.ran[arm] += 1
        if not planned_pure:
            return
        counted = pure and seconds > 0
        if counted:
            b.hist[arm].append((tokens, seconds))
        if arm != b.arm:  # a probe step
            b.probing = max(0, b.probing - 1)
            if b.probing == 0:
                self._settle(b)
            return
        if b.probing:
            return
        mine, theirs = b.rate(b.arm), b.rate(b.other())
        if theirs is None:
            if mine is not None and b.until_probe > PROBE_FIRST:
                b.until_probe = PROBE_FIRST  # the other arm was never measured here: probe it soon
            return
        b.since_probe += counted
        # the winner's window holds only steps run since the last probe, and the other arm's
        # goodput at that probe beats it (speculation by SPEC_MARGIN): probe the other at the
        # next pure step
        if b.since_probe >= WINDOW and mine is not None and self._beats(b.other(), theirs, mine) and b.until_probe > 1:
            b.until_probe, b.challenges = 1, b.challenges + 1

    @staticmethod
    def _beats(arm: str, rate: float, other: float) -> bool:
        """Does `arm` at goodput `rate` beat the other arm's `other`? Speculation needs
        SPEC_MARGIN more; plain decoding needs only more."""
        return rate > other * (1.0 + SPEC_MARGIN) if arm == "spec" else rate > other

    def _settle(self, b: Bucket) -> None:
        """A probe ended: the arm with the higher goodput wins (speculation by SPEC_MARGIN); the
        next probe comes sooner when the winner changed, later when it did not."""
        mine, theirs = b.rate(b.arm), b.rate(b.other())
        b.compared = b.compared or (mine is not None and theirs is not None)
        if theirs is None:  # too few of the probe's steps counted: probe again soon
            b.interval = PROBE_FIRST
        elif mine is None or self._beats(b.other(), theirs, mine):
            b.arm, b.switches = b.other(), b.switches + 1
            b.interval = PROBE_FIRST
        else:
            b.interval = min(b.interval * 2, PROBE_MAX)
        b.until_probe = b.interval
        b.since_probe = 0

    def describe(self) -> dict:
        """Per batch size: the arm running, each arm's goodput (tokens/s) over the steps in its
        window (_steps), the steps run on each arm in all (_ran), the switches and probes so far
        (challenges: probes started early because the winner fell below the other arm)."""
        out = {}
        for name in BUCKETS:
            b = self.buckets.get(name)
            if b is None:
                continue
            out[name] = {"arm": b.arm, "switches": b.switches, "probes": b.probes, "challenges": b.challenges,
                         **{f"{a}_tokens_per_s": (None if b.rate(a) is None else round(b.rate(a), 1)) for a in ARMS},
                         **{f"{a}_steps": len(b.hist[a]) for a in ARMS},
                         **{f"{a}_ran": b.ran[a] for a in ARMS}}
        return out


ROW_DECAY = 0.98  # each decode step's weight in the row price halves after ~34 steps
ROW_PRIOR = 24.0  # the start-up table's slope counts as this many steps' worth of rows' spread


class _Fit:
    """Decayed sums for a least-squares line through (rows, seconds)."""

    __slots__ = ("n", "sx", "sy", "sxx", "sxy")

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = ROW_DECAY
        self.n, self.sx, self.sy = self.n * d + 1, self.sx * d + x, self.sy * d + y
        self.sxx, self.sxy = self.sxx * d + x * x, self.sxy * d + x * y

    def moments(self) -> tuple[float, float, float, float]:
        """(mean rows, mean seconds, n * var(rows), n * cov(rows, seconds))."""
        mx, my = self.sx / self.n, self.sy / self.n
        return mx, my, self.sxx - self.sx * mx, self.sxy - self.sx * my


class RowPrice:
    """What one more forward row costs in a decode step at each batch size, learned from the
    steps the server runs (wall seconds of the whole step against its rows: the forward, and
    the building, settling and emitting that grow with the rows), held toward the slope of the
    start-up table of forward cost by width until the steps' rows vary enough to tell. Steps
    that prefill are left out (a prompt's rows cost differently). `line(batch, prior)` gives
    (seconds at zero rows, seconds per row) for Speculator.fit_to_batch."""

    def __init__(self) -> None:
        self.fits: dict[str, _Fit] = {}

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        if batch <= 0 or rows <= 0 or seconds <= 0:
            return
        f = self.fits.get(batch_bucket(batch))
        if f is None:
            f = self.fits[batch_bucket(batch)] = _Fit()
        f.add(float(rows), seconds)

    def line(self, batch: int, prior: tuple[float, float]) -> tuple[float, float]:
        """(intercept, slope) in seconds for this batch size; `prior` the start-up table's line
        through the batch's widths, taken as it is until MIN_STEPS steps were seen."""
        f = self.fits.get(batch_bucket(batch))
        if f is None or f.n < MIN_STEPS:
            return prior
        mx, my, spread, co = f.moments()
        slope = max(0.0, (co + ROW_PRIOR * prior[1]) / (spread + ROW_PRIOR))
        return my - slope * mx, slope

    def describe(self) -> dict:
        out = {}
        for name in BUCKETS:
            f = self.fits.get(name)
            if f is not None and f.n >= MIN_STEPS:
                mx, my, spread, co = f.moments()
                out[name] = {"steps": round(f.n, 1), "rows_mean": round(mx, 2), "ms_mean": round(my * 1e3, 3),
                             "ms_per_row": round(co / spread * 1e3, 3) if spread > 1e-9 else None}
        return out
