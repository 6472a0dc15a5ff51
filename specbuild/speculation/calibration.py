"""What speculation costs on this machine: the target's verify pass by width and each drafter's
drafting, measured once per machine and bundle and kept in the cost cache; and the drafters'
models compiled beside the target's stack (`compile=True`).

The drafters are reached through their contract (proposers/base.DrafterBase): `models()` (the
(Decoder, cache) pairs a drafter steps per drafted token: timed, warmed up, compiled),
`cost_key()` / `level_cost()` (a head's per-depth cost: EAGLE, Medusa) and
`set_verify_cost(verify)` (drafters that size their trees by the verify cost). The speculator
asks `calibrate` once, at engine load (Speculator.controller).
"""

from __future__ import annotations

import logging
import os
import time

from specbuild.speculation.gamma import CostModel

log = logging.getLogger("specbuild.speculator")
# a cached width-1 verify cost more than this many times the best of a few live forwards was
# measured under a load that has gone (466 ms cached against a 108 ms step was seen; 6.68 ms
# cached, measured while a compiler ran, against a live 3.4-3.7 ms, 2026-12-05): measured again
LIVE_CHECK_FACTOR = 1.5


def monotone_costs(costs: dict[int, float]) -> dict[str, float]:
    """Verify costs by width made nondecreasing from above: a width costs at most what any wider
    pass was measured at (more rows never cost less; a narrower pass measured above a wider one
    was slowed by something else). Keys become strings, as the cost cache stores them."""
    out, cap = {}, float("inf")
    for w in sorted(costs, reverse=True):
        cap = min(cap, float(costs[w]))
        out[str(w)] = cap
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def stack_plan(model) -> dict:
    """How a target's forward runs, for the cost cache's key: its compiled stack (fused C++,
    torch.compile or none), the layers' and the lm_head's formats, the kernel level or path
    the layers run at, and which build of specbuild's kernels (its source digest) loaded."""
    from specbuild.model import cpu_kernels

    stack = type(model.compiled).__name__ if getattr(model, "compiled", None) is not None else "eager"
    w = getattr(model, "w", {}).get("layers.0.qkv")
    impl = w.formats.get(w.primary) if hasattr(w, "formats") else None
    plan = {"stack": stack, "layers": getattr(w, "primary", "dense"), "kernel": int(getattr(impl, "kernel", 0) or 0)}
    head = getattr(model, "lm_head", None)
    if hasattr(head, "primary"):
        plan["lm_head"] = head.primary
    path = cpu_kernels.status().get("path") if plan["kernel"] or plan.get("lm_head") else None
    if path:
        plan["build"] = os.path.basename(os.path.dirname(path))  # a kernel change re-measures the costs
    return plan


def model_step_cost(prop) -> float:
    """Seconds one drafted token costs a drafter in steps of its own models (0: it runs none)."""
    from specbuild.model.timing import forward_costs

    return float(sum(forward_costs(model, cache, [1], repeats=3)[1]["wall_ms"] / 1e3 for model, cache in prop.models()))


def model_key(prop):
    """A drafter's models' fingerprints for the cost cache's key (one model: its fingerprint)."""
    from specbuild.model.timing import model_fingerprint

    prints = [model_fingerprint(model) for model, _ in prop.models()]
    return prints[0] if len(prints) == 1 else prints


class MeasuredCosts(dict):
    """method -> CostModel; a drafter added after calibration (at load) gets the measured
    verify costs and its own step measured on first use."""

    def __init__(self, verify: dict[int, float], speculator) -> None:
        super().__init__()
        self.verify, self.speculator = verify, speculator

    def __missing__(self, method: str) -> CostModel:
        self[method] = CostModel(self.verify, model_step_cost(self.speculator.proposers[method]))
        return self[method]


def calibrate(speculator) -> MeasuredCosts:
    """Verify cost by width (and each drafter model's step, each head's depth), measured once
    per machine and bundle and kept in the cost cache (model/timing.cached_costs: keyed by CPU,
    flags, torch version, threads and the models' fingerprints), so a fresh process reads them
    instead of timing ~20 forwards; then each drafter is handed the verify costs
    (set_verify_cost). `speculator`: its target, cache, max_draft_len and proposers."""
    from specbuild.model.timing import cached_costs, forward_costs, machine_key, model_fingerprint, warm_up

    t0 = time.perf_counter()
    target, cache, proposers = speculator.target, speculator.cache, speculator.proposers
    widths = sorted({1, 2, 3, 5, speculator.max_draft_len + 1})
    drafters = {name: prop for name, prop in proposers.items() if prop.models()}
    levels = {name: prop for name, prop in proposers.items() if prop.cost_key() is not None}

    def measure() -> dict:
        verify = forward_costs(target, cache, widths, repeats=5)
        drafts = {name: model_step_cost(prop) for name, prop in drafters.items()}
        drafts.update({name: prop.level_cost() for name, prop in levels.items()})  # EAGLE, Medusa: per depth
        return {"verify": monotone_costs({w: c["min_ms"] / 1e3 for w, c in verify.items()}), "draft": drafts}

    # v2: best of 5 with a monotone lower envelope (v1's medians of 3 read a width-1 pass at
    # 19.4 ms beside a width-2 one at 13.2 on a 2-core Xeon whose step takes 9), and keyed by
    # how the target's stack runs (a fused stack or kernel level changes every cost)
    key = {"what": "speculation costs v2 (best seconds, 64 cached tokens)", "widths": widths,
           "machine": machine_key(target.device), "target": model_fingerprint(target),
           "stack": stack_plan(target),
           "drafters": {name: model_key(prop) for name, prop in drafters.items()},
           "levels": {name: prop.cost_key() for name, prop in levels.items()}}

    def check(cached: dict) -> str | None:  # one live width-1 forward against the cached cost
        live = forward_costs(target, cache, [1], repeats=3)[1]["min_ms"] / 1e3
        then = float(cached["verify"]["1"])
        return f"cached width-1 cost {then * 1e3:.2f} ms, live {live * 1e3:.2f} ms" \
            if then > LIVE_CHECK_FACTOR * live else None

    measured, cached = cached_costs(key, measure, timing=True, check=check)
    if cached:  # no forwards ran: set the kernels up now, not in the first request
        warm_up(target, cache, widths)
        for prop in drafters.values():
            for model, model_cache in prop.models():
                warm_up(model, model_cache, [1])
    verify = {int(w): float(c) for w, c in measured["verify"].items()}
    costs = MeasuredCosts(verify, speculator)
    costs.update({name: CostModel(verify, float(measured["draft"].get(name, 0.0))) for name in proposers})
    for name, prop in proposers.items():
        prop.set_verify_cost(costs[name].verify)  # tree drafters' node budgets (EAGLE, suffix, hybrid)
    log.info("speculation costs %s in %.2fs: verify %s", "read from the cache" if cached else "calibrated",
             time.perf_counter() - t0, {k: round(v * 1e3, 2) for k, v in verify.items()})
    return costs


def compile_drafters(proposers: dict) -> float:
    """Compile the drafters' models that run eagerly (Decoder.compile) and warm them up; their
    proposals only decide speed, the target's pass decides tokens. Returns the seconds spent."""
    from specbuild.model.decoder import Decoder
    from specbuild.model.timing import warm_up_compiled

    seconds = 0.0
    for prop in proposers.values():
        for model, cache in prop.models():
            if isinstance(model, Decoder) and model.compiled is None:
                model.compile()
                seconds += warm_up_compiled(model, cache)
    return seconds
