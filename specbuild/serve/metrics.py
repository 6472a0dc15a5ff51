"""Prometheus metrics for the HTTP server, in the text exposition format (version 0.0.4).

Written by hand (no dependency): counters, gauges and histograms with labels, and
`ServerMetrics`, the set the server exports. Counters for finished requests are updated
once per request when it ends (so they never go backwards); queue depth, running
requests, KV blocks and the current gamma are read from the engine's `stats()` at scrape
time (a gauge the backend cannot report, such as TensorRT-LLM's KV blocks, has no sample).

Units: seconds for times, tokens for counts.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def label_text(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{escape_label(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labelnames: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, Any]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"metric {self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def lines(self) -> list[str]:
        raise NotImplementedError

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self.lines()]


class Counter(Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Iterable[str] = ()) -> None:
        assert name.endswith("_total"), name
        super().__init__(name, help_text, labelnames)
        self.values: dict[tuple[str, ...], float] = {} if self.labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: Any) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc by {amount})")
        key = self._key(labels)
        with self._lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: Any) -> float:
        return self.values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        with self._lock:
            items = sorted(self.values.items())
        return [f"{self.name}{label_text(self.labelnames, k)} {format_value(v)}" for k, v in items]


class Gauge(Metric):
    """A gauge whose value comes from a callback at scrape time (no labels); a callback that
    returns None (not known) gives the family without a sample."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        super().__init__(name, help_text)
        self.read = read

    def lines(self) -> list[str]:
        value = self.read()
        return [] if value is None else [f"{self.name} {format_value(float(value))}"]


class ReadCounter(Metric):
    """A counter kept elsewhere (no labels), read by a callback at scrape time; None: no sample."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, read: Callable[[], float | None]) -> None:
        assert name.endswith("_total"), name
        super().__init__(name, help_text)
        self.read = read

    def lines(self) -> list[str]:
        value = self.read()
        return [] if value is None else [f"{self.name} {format_value(float(value))}"]


class Histogram(Metric):
    """Cumulative buckets (upper bounds, seconds), a sum and a count; no labels."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        super().__init__(name, help_text)
        self.bounds = tuple(sorted(float(b) for b in buckets)) + (math.inf,)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    self.counts[i] += 1
                    break
            self.sum += value
            self.count += 1

    def lines(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self.counts), self.sum, self.count
        out, running = [], 0
        for bound, c in zip(self.bounds, counts):
            running += c
            out.append(f'{self.name}_bucket{{le="{format_value(bound)}"}} {running}')
        out += [f"{self.name}_sum {format_value(total)}", f"{self.name}_count {count}"]
        return out


class ServerMetrics:
    """Everything `/metrics` shows. `engine.stats()` (the backend interface) supplies the live gauges."""

    def __init__(self, engine) -> None:
        self.engine = engine
        p = "specbuild_"
        self.requests = Counter(p + "requests_total", "Finished requests by endpoint and finish reason "
                                "(stop, length, abort, error).", ("endpoint", "finish_reason"))
        self.rejected = Counter(p + "requests_rejected_total", "Requests refused before queueing "
                                "(invalid body, queue full, shutting down).", ("reason",))
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Generated tokens of finished requests.")
        self.drafted = Counter(p + "draft_tokens_total", "Draft tokens proposed (finished requests).")
        self.accepted = Counter(p + "accepted_tokens_total", "Draft tokens accepted by the target (finished requests).")
        self.verify_passes = Counter(p + "verify_passes_total", "Decode passes of the target; each yields the "
                                     "accepted drafts plus one token.")
        self.gamma_steps = Counter(p + "gamma_steps_total", "Speculation steps (finished requests).")
        self.gamma_sum = Counter(p + "gamma_sum_total", "Sum of gamma over speculation steps (finished requests).")
        self.ttft = Histogram(p + "ttft_seconds", "Time to first token (submission to first token).", TTFT_BUCKETS)
        self.tpot = Histogram(p + "tpot_seconds", "Mean time per output token after the first, per request.",
                              TPOT_BUCKETS)
        self.e2e = Histogram(p + "e2e_seconds", "Request latency, submission to last token.", E2E_BUCKETS)
        gauges = [
            Gauge(p + "queue_depth", "Requests waiting for admission.", lambda: engine.stats()["queue_depth"]),
            Gauge(p + "running_requests", "Requests admitted and generating.", lambda: engine.stats()["running"]),
            Gauge(p + "kv_blocks_used", "KV cache blocks in use (no sample: the backend does not report them).",
                  lambda: engine.stats()["kv_blocks_used"]),
            Gauge(p + "kv_blocks_total", "KV cache blocks in the pool (no sample: the backend does not report them).",
                  lambda: engine.stats()["kv_blocks_total"]),
            Gauge(p + "acceptance_rate", "Accepted / drafted tokens over finished requests (0 before any draft).",
                  self.acceptance_rate),
            Gauge(p + "mean_accepted_tokens", "Tokens per target decode pass over finished requests "
                  "(accepted drafts + 1; 1.0 without speculation).", self.mean_accepted_tokens),
            Gauge(p + "gamma", "Mean current gamma (draft length) over running requests that speculate.",
                  lambda: engine.stats()["gamma"]),
            Gauge(p + "threads", "CPU threads the engine's kernels run with now (the start-up timing and the "
                  "trials on real steps choose; no sample: the backend does not say).",
                  lambda: (lambda t: t.get("kernel_threads", t.get("threads")))(engine.stats().get("threads") or {})),
            Gauge(p + "kernels_on_pool", "1 while the kernels' loops run on their own pool (chosen as fastest, or "
                  "others' load), 0 on torch's OpenMP (no sample: no thread governor).",
                  lambda: (lambda t: None if "choice" not in t else int(bool(t.get("pool")) or
                           t["choice"].startswith("the kernels' pool")))(engine.stats().get("threads") or {})),
            Gauge(p + "gamma_mean", "Mean gamma per speculation step over finished requests.",
                  lambda: self.gamma_sum.get() / self.gamma_steps.get() if self.gamma_steps.get() else 0.0),
        ]
        gauges.append(ReadCounter(p + "telemetry_rows_dropped_total", "Telemetry rows dropped because the "
                                  "store's writer queue was full or a write failed (no sample: telemetry off).",
                                  lambda: engine.stats().get("telemetry_rows_dropped")))
        gauges.append(ReadCounter(p + "step_failures_total", "Engine steps that failed outside any one request; "
                                  "the requests of that step failed with 500 (see the server log for their ids).",
                                  lambda: engine.stats().get("step_failures")))
        gauges.append(ReadCounter(p + "sequence_failures_total", "Requests failed alone inside an engine step "
                                  "(their sampling, grammar or numerics); the rest of the batch went on.",
                                  lambda: engine.stats().get("sequence_failures")))
        gauges += [
            Gauge(p + "suffix_store_tokens", "Tokens held by the suffix drafter's store of earlier requests "
                  "(no sample: no suffix drafter).", lambda: engine.stats().get("suffix_store_tokens")),
            Gauge(p + "suffix_store_max_tokens", "The suffix store's cap in tokens (whole requests are evicted, "
                  "least recently used first).", lambda: engine.stats().get("suffix_store_max_tokens")),
            Gauge(p + "suffix_store_requests", "Earlier requests held by the suffix store.",
                  lambda: engine.stats().get("suffix_store_requests")),
            ReadCounter(p + "suffix_store_evictions_total", "Requests evicted from the suffix store.",
                        lambda: engine.stats().get("suffix_store_evictions")),
            Gauge(p + "suffix_store_warm_tokens", "Tokens the warm corpus (--suffix-corpus) put into the suffix "
                  "store at start (counted in suffix_store_tokens while they are not evicted).",
                  lambda: engine.stats().get("suffix_store_warm_tokens")),
        ]

        def prefix(key: str):
            return lambda: (engine.stats().get("prefix_cache") or {}).get(key)

        gauges += [
            ReadCounter(p + "prefix_cache_queried_tokens_total", "Prompt tokens looked up in the prefix cache "
                        "(no sample: the backend has none).", prefix("queried_tokens")),
            ReadCounter(p + "prefix_cache_hit_tokens_total", "Prompt tokens whose K/V came from the prefix cache.",
                        prefix("hit_tokens")),
            Gauge(p + "prefix_cache_hit_rate", "Hit tokens / queried tokens of the prefix cache since start.",
                  prefix("hit_rate")),
            Gauge(p + "prefix_cache_blocks", "KV blocks recorded in the prefix cache now (held by requests or not).",
                  prefix("cached_blocks")),
            Gauge(p + "prefix_cache_evictable_blocks", "Recorded KV blocks no request holds (reused, least "
                  "recently released first, when the cache needs room).", prefix("evictable_blocks")),
            ReadCounter(p + "prefix_cache_evictions_total", "Recorded KV blocks evicted for room.",
                        prefix("evicted_blocks")),
        ]
        self.all: list[Metric] = [self.requests, self.rejected, self.prompt_tokens, self.generation_tokens,
                                  self.drafted, self.accepted, self.verify_passes, self.gamma_steps,
                                  self.gamma_sum, self.ttft, self.tpot, self.e2e, *gauges]

    def acceptance_rate(self) -> float:
        drafted = self.drafted.get()
        return self.accepted.get() / drafted if drafted else 0.0

    def mean_accepted_tokens(self) -> float:
        passes = self.verify_passes.get()
        return (self.accepted.get() + passes) / passes if passes else 1.0

    def observe_request(self, endpoint: str, finish_reason: str | None, seq) -> None:
        """Record one finished request from its engine Sequence (stats read once, here)."""
        stats = seq.stats()
        self.requests.inc(endpoint=endpoint, finish_reason=finish_reason or "unknown")
        self.prompt_tokens.inc(stats["prompt_tokens"])
        self.generation_tokens.inc(stats["generated_tokens"])
        self.drafted.inc(stats["drafted"])
        self.accepted.inc(stats["accepted"])
        t = seq.tally
        self.verify_passes.inc(t.verify_passes)
        gammas = t.gammas
        if gammas:
            self.gamma_steps.inc(len(gammas))
            self.gamma_sum.inc(sum(gammas))
        if stats["generated_tokens"] > 0:
            self.ttft.observe(stats["ttft_ms"] / 1e3)
            if stats["generated_tokens"] > 1:
                self.tpot.observe(stats["tpot_ms"] / 1e3)
            if t.t_last is not None:
                self.e2e.observe(max(t.t_last - t.t_submit, 0.0))

    def render(self) -> str:
        return "\n".join(line for m in self.all for line in m.render()) + "\n"
