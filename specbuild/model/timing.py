"""What a pass costs on this machine: one place for the runtime and the benchmarks.

    with scratch_sequence(cache, n) as slots: ...   a throwaway sequence in the paged cache
    forward_costs(model, cache, widths)             one forward of w rows after 64 cached ones
    copy_bandwidth(nbytes)                          memory bandwidth, for the floor of a step

The speculator's start-up cost calibration (speculation/speculator.py), `bench --formats`
(bench/formats.py) and `bench --floor` / `--verify-costs` (cli/bench.py) all measure here,
the same way.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Iterator

import torch

from specbuild.model.costcache import cache_dir, cached_costs, machine_key  # noqa: F401 (re-exported)
from specbuild.model.kv_cache import PagedKVCache

SCRATCH_SEQ_ID = -1  # throwaway sequences count down from here (engine sequences are >= 0)


@contextlib.contextmanager
def scratch_sequence(cache: PagedKVCache, length: int) -> Iterator[torch.Tensor]:
    """A sequence with blocks for `length` tokens that no request owns, released on exit
    (also on error); yields its slots [length] int64 on the cache's device. Nests: each
    takes the next free negative id."""
    seq_id = SCRATCH_SEQ_ID
    while seq_id in cache.seqs:
        seq_id -= 1
    cache.add(seq_id)
    try:
        cache.reserve(seq_id, length)
        yield cache.slots(seq_id, 0, length).to(cache.device)
    finally:
        cache.release(seq_id)


def verify_batch(slots: torch.Tensor, context: int, width: int, token: int = 100):
    """The ForwardBatch of a chain verify pass of `width` rows after `context` cached ones
    (width 1: a decode step, no mask), on scratch slots [>= context + width]."""
    from specbuild.model.decoder import ForwardBatch

    n, dev = context + width, slots.device
    mask = None
    if width > 1:
        mask = torch.ones(width, n, dtype=torch.bool)
        mask[:, context:] = torch.ones(width, width, dtype=torch.bool).tril()
        mask = mask.to(dev)
    return ForwardBatch(torch.arange(width, device=dev) + token, torch.arange(context, n, device=dev),
                        slots[context:n], slots[:n], mask, torch.arange(width, device=dev))


def thread_count_changes_results(model, cache: PagedKVCache, threads: int) -> bool:
    """Whether `threads` and one thread give different logits: a 24-row prefill, then a one-row
    step and a 5-row verify pass after it, on a scratch sequence (model/threads.ThreadGovernor
    adapts the thread count only where this is False). Restores torch's thread count."""
    before = torch.get_num_threads()
    try:
        with torch.inference_mode(), scratch_sequence(cache, 32) as slots:
            outs = {}
            for n in (threads, 1):
                torch.set_num_threads(n)
                outs[n] = [model.forward(verify_batch(slots, c, w), cache).logits.clone()
                           for c, w in ((0, 24), (24, 1), (24, 5))]
        return not all(torch.equal(a, b) for a, b in zip(outs[threads], outs[1]))
    finally:
        torch.set_num_threads(before)


def warm_up_compiled(model, cache, aux_layer_sets=((),)) -> float:
    """Compile every graph a forward of a compiling Decoder (model/compiled.py) can take, at
    load (a compile inside a request would cost it tens of seconds): a one-row decode step,
    a two-row verify pass, each with and without the aux layers an EAGLE head reads.
    Returns the seconds it took."""
    t0 = time.perf_counter()
    context = fit_context(model, cache, 8, 2)
    with scratch_sequence(cache, context + 2) as slots:
        for aux in aux_layer_sets:
            for width in (1, 2):
                batch = verify_batch(slots, context, width)
                rows = torch.arange(width, device=slots.device) if aux else None
                model.forward(batch, cache, aux_layers=tuple(aux), aux_rows=rows)
    return time.perf_counter() - t0


def fit_context(model, cache: PagedKVCache, context: int, width: int) -> int:
    """`context`, shortened where the model's positions (its rope table) or the cache's blocks
    cannot hold context + width tokens (a bundle compiled with a short max_seq_len)."""
    positions = getattr(model, "cos", None)
    room = positions.shape[0] if positions is not None else context + width
    room = min(room, cache.num_blocks * cache.block_size)
    return max(0, min(context, room - width))


def forward_costs(model, cache: PagedKVCache, widths, context: int = 64, repeats: int = 7) -> dict[int, dict]:
    """One forward of w new rows after `context` cached ones (a verify pass of width w; w = 1
    is a decode step), per width, after one untimed warm-up: median wall ms (`wall_ms`), best
    wall ms (`min_ms`: what other load on a shared machine can only make worse) and median
    CPU ms of this process (`cpu_ms`: with one thread, what descheduling cannot inflate).
    A model or cache too small for `context` gets a shorter one (fit_context)."""
    widths = sorted(set(widths))
    context = fit_context(model, cache, context, max(widths))
    sync = torch.cuda.synchronize if cache.device.type == "cuda" else (lambda: None)
    out = {}
    with scratch_sequence(cache, context + max(widths)) as slots:
        for w in widths:
            batch = verify_batch(slots, context, w)
            model.forward(batch, cache)
            walls, cpus = [], []
            for _ in range(repeats):
                sync()
                t0, c0 = time.perf_counter(), time.process_time()
                model.forward(batch, cache)
                sync()
                walls.append((time.perf_counter() - t0) * 1e3)
                cpus.append((time.process_time() - c0) * 1e3)
            out[w] = {"wall_ms": statistics.median(walls), "min_ms": min(walls), "cpu_ms": statistics.median(cpus)}
    return out


def best_seconds(fn, repeats: int = 5, before=None) -> float:
    """One untimed call of fn() (kernel set-up), then the best of `repeats` timed calls, in
    seconds (other load on a shared machine can only make a call slower); `before()`, untimed,
    ahead of each timed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


COLD_BYTES = 96 << 20  # what a decode step of the default bundle streams through the caches


def best_cold_seconds(fn, repeats: int = 5, evict_bytes: int = COLD_BYTES) -> float:
    """best_seconds with `evict_bytes` read before each timed call: what fn costs right after a
    target's forward has streamed its weights through the caches, as a drafter's work runs in a
    served step (a hot loop measured an EAGLE level at a third of its in-step cost, and the depth
    controller then drafted deeper than paid)."""
    buf = torch.ones(evict_bytes // 4, dtype=torch.float32)
    # every line of the buffer read: the caches hold it, not fn's data
    return best_seconds(fn, repeats, before=lambda: float(buf.sum()))


def warm_up(model, cache: PagedKVCache, widths, context: int = 16) -> None:
    """One untimed forward per width, so kernels' first-call set-up (oneDNN primitives,
    packed layouts, allocator pools) happens at load and not in the first request."""
    widths = sorted(set(widths))
    context = fit_context(model, cache, context, max(widths))
    with scratch_sequence(cache, context + max(widths)) as slots:
        for w in widths:
            model.forward(verify_batch(slots, context, w), cache)


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, device: str = "cpu") -> dict:
    """Memory bandwidth from copying an nbytes float32 tensor into a preallocated one (a
    fresh clone would time page faults, not memory), well above the CPU caches: the best of
    `repeats` (other load can only slow a copy down; the floor is what the machine can do)
    and the median. GB/s counts read + write (2 * nbytes)."""
    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)  # touched: its pages exist before the timing
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    moved = 2 * src.numel() * 4
    best, median = min(times), statistics.median(times)
    return {"bytes": src.numel() * 4, "seconds": best, "median_seconds": median,
            "gb_per_s": moved / best / 1e9, "median_gb_per_s": moved / median / 1e9}


# ---- measured costs, cached per machine and model ------------------------------------------
def model_fingerprint(model) -> str:
    """A digest of a Decoder's config, every weight's name, layout and format, and a sample of
    its values (the first and last 64 of each stored tensor): a different bundle or format
    gives another fingerprint without reading every byte."""
    import hashlib

    # a compiled layer stack costs another amount than the eager one (model/compiled.py)
    h = hashlib.sha256(repr((model.config, str(model.dtype), getattr(model, "compiled", None) is not None)).encode())
    for name in sorted(model.w):
        t = model.w[name]
        parts = [t] if isinstance(t, torch.Tensor) else [
            v for impl in t.formats.values() for v in vars(impl).values() if isinstance(v, torch.Tensor)]
        h.update(f"{name}:{type(t).__name__}:{sorted(getattr(t, 'formats', {}))}".encode())
        for p in parts:
            flat = p.t() if p.dim() == 2 and not p.is_contiguous() and p.t().is_contiguous() else p
            flat = flat.reshape(-1)  # a view (no copy) for the layouts weights are stored in
            h.update(f"{tuple(p.shape)}{p.dtype}{tuple(p.stride())}".encode())
            for piece in (flat[:64], flat[-64:]):
                h.update(piece.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
