"""Words for a measured change that cannot contradict its numbers.

    change_phrase(1.457, 1.117)                         -> "30% higher"
    compare("mean e2e latency", 1.457, 1.117, "s", better="lower")
        -> "mean e2e latency 1.457 s vs 1.117 s: 30% higher (worse)"

The direction word comes from the sign of (value - baseline), the percentage is its
magnitude relative to the baseline, and better/worse from which direction is good for the
quantity: a load report built from these can never print "-30% lower" for a rise.
"""

from __future__ import annotations

import math


def change_phrase(value: float, baseline: float, digits: int = 0) -> str:
    """`value` against `baseline` (both finite, baseline > 0): "N% higher", "N% lower", or
    "the same" when the change rounds to 0 at `digits` decimals."""
    if not (math.isfinite(value) and math.isfinite(baseline)) or baseline <= 0:
        raise ValueError(f"cannot compare {value!r} with baseline {baseline!r} (need finite numbers, baseline > 0)")
    pct = 100.0 * (value - baseline) / baseline
    text = f"{abs(pct):.{digits}f}"
    if float(text) == 0.0:
        return "the same"
    return f"{text}% {'higher' if pct > 0 else 'lower'}"


def ratio_phrase(value: float, baseline: float) -> str:
    """value / baseline as "1.24x" (two decimals)."""
    if not (math.isfinite(value) and math.isfinite(baseline)) or baseline <= 0:
        raise ValueError(f"cannot compare {value!r} with baseline {baseline!r} (need finite numbers, baseline > 0)")
    return f"{value / baseline:.2f}x"


def compare(what: str, value: float, baseline: float, unit: str = "", better: str = "lower",
            digits: int = 0, fmt: str = ".4g") -> str:
    """One line: both numbers, the change in words and whether it is an improvement.
    better: "lower" (latencies) or "higher" (throughput)."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better={better!r} is not one of lower, higher")
    phrase = change_phrase(value, baseline, digits)
    verdict = "" if phrase == "the same" else (" (better)" if phrase.endswith(better) else " (worse)")
    u = f" {unit}" if unit else ""
    return f"{what} {value:{fmt}}{u} vs {baseline:{fmt}}{u}: {phrase}{verdict}"
