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


def cached_costs(key: dict, measure) -> tuple[dict, bool]:
    """measure() once per key (JSON-serialisable), kept under cache_dir(); returns (costs,
    whether they came from the cache). $SPECBUILD_COST_CACHE=off measures every time; an
    unreadable or unwritable cache only costs a measurement."""
    import hashlib
    import json
    import os

    if os.environ.get("SPECBUILD_COST_CACHE", "").lower() in ("off", "0", "no"):
        return measure(), False
    blob = json.dumps(key, sort_keys=True)
    path = os.path.join(cache_dir(), f"costs-{hashlib.sha256(blob.encode()).hexdigest()[:32]}.json")
    try:
        with open(path) as f:
            entry = json.load(f)
        if entry.get("key") == json.loads(blob):
            return entry["costs"], True
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    costs = measure()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"key": json.loads(blob), "costs": costs}, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return costs, False
