"""Measured costs kept per machine: where they live, what keys them, read-or-measure.

Kept apart from model/timing.py (which times forwards of a Decoder) so the decoder itself
can cache what it measures at load (its row-invariance probes) without an import cycle.
"""

from __future__ import annotations

import torch


def cache_dir() -> str:
    """Where measured costs are kept: $SPECBUILD_CACHE_DIR, else $XDG_CACHE_HOME/specbuild,
    else ~/.cache/specbuild."""
    import os

    return os.environ.get("SPECBUILD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "specbuild")


def machine_key(device: torch.device | str = "cpu") -> dict:
    """What a pass's cost depends on besides the model: the CPU (model name and a digest of its
    flags), the GPU when there is one, torch's version and its thread count."""
    import hashlib
    import platform

    model, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = value.strip()
    except OSError:
        pass
    out = {"cpu": model, "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16], "torch": torch.__version__,
           "threads": torch.get_num_threads(), "device": str(device)}
    if torch.device(device).type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


MAX_AGE_S = 7 * 24 * 3600  # a timing older than this is measured again ($SPECBUILD_COST_MAX_AGE_S)


def load_now() -> dict:
    """The 1-minute load average and the CPU count, recorded beside every timing."""
    import os

    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = 0.0
    return {"load1": round(load1, 2), "cpus": os.cpu_count() or 1}


def stale_reason(entry: dict, now: float, load: dict, max_age_s: float) -> str | None:
    """Why a cached timing should be measured again, or None: older than max_age_s, no record
    of when or under what load it was measured, or measured on a busy machine (more runnable
    tasks than CPUs) that is now at most half as busy (a new measurement can only be better
    then; on a machine that stays busy the old one stands, and the live check still applies)."""
    when = entry.get("measured")
    if not isinstance(when, dict) or "time" not in when or "load1" not in when:
        return "no record of when it was measured"
    age = now - float(when["time"])
    if age > max_age_s or age < 0:
        return f"measured {age / 3600:.1f} h ago (limit {max_age_s / 3600:.1f} h)"
    cpus = float(when.get("cpus") or load["cpus"])
    if float(when["load1"]) > cpus and load["load1"] <= float(when["load1"]) / 2:
        return f"measured at load {when['load1']} on {int(cpus)} CPUs, now {load['load1']}"
    return None


def cached_costs(key: dict, measure, timing: bool = False, check=None) -> tuple[dict, bool]:
    """measure() once per key (JSON-serialisable), kept under cache_dir(); returns (costs,
    whether they came from the cache). $SPECBUILD_COST_CACHE=off measures every time; an
    unreadable or unwritable cache only costs a measurement.

    Every entry records when it was measured and the load average then. `timing=True` (costs
    that are times, not facts such as which widths give the same bits): an entry that
    stale_reason() rejects is measured again, and `check(costs)` (a quick live measurement
    at load) may reject a cached entry by returning a reason string; both are logged."""
    import hashlib
    import json
    import logging
    import os
    import time

    if os.environ.get("SPECBUILD_COST_CACHE", "").lower() in ("off", "0", "no"):
        return measure(), False
    blob = json.dumps(key, sort_keys=True)
    path = os.path.join(cache_dir(), f"costs-{hashlib.sha256(blob.encode()).hexdigest()[:32]}.json")
    log = logging.getLogger("specbuild.costs")
    try:
        with open(path) as f:
            entry = json.load(f)
        if entry.get("key") == json.loads(blob):
            why = None
            if timing:
                max_age = float(os.environ.get("SPECBUILD_COST_MAX_AGE_S") or MAX_AGE_S)
                why = stale_reason(entry, time.time(), load_now(), max_age)
                if why is None and check is not None:
                    why = check(entry["costs"])
            if why is None:
                return entry["costs"], True
            log.info("cached costs at %s measured again: %s", path, why)
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        pass
    load = load_now()
    costs = measure()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"key": json.loads(blob), "costs": costs, "measured": {"time": time.time(), **load}}, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return costs, False
