"""`specbuild telemetry DB`: the questions operators ask of the recorded steps.

Acceptance here is per drafted position: accepted / positions offered (a chain offers its
length, a tree its depth); tokens per pass = tokens emitted per decode pass (accepted + 1,
1 for a plain pass). Every figure is aggregated in SQL (GROUP BY), then shaped here.
"""

from __future__ import annotations

import json

from specbuild.telemetry.store import Store

PROMPT_BUCKETS = ((0, 64), (64, 256), (256, 1024), (1024, None))

_AGG = ("COUNT(*), SUM(st.n_drafted), SUM(CASE WHEN st.n_drafted > 0 THEN st.depth ELSE 0 END), "
        "SUM(st.n_accepted), SUM(st.n_emitted), SUM(st.fallback), "
        "SUM(CASE WHEN st.n_drafted > 0 THEN 1 ELSE 0 END), SUM(st.draft_latency_ms + st.target_latency_ms)")
_JOIN = "speculation_steps st LEFT JOIN speculation_sessions ss ON ss.session_id = st.session_id"


def _bucket_sql() -> str:
    parts = [f"WHEN ss.prompt_token_count < {hi} THEN '{lo}-{hi - 1}'" for lo, hi in PROMPT_BUCKETS if hi]
    last = PROMPT_BUCKETS[-1][0]
    return f"CASE WHEN ss.prompt_token_count IS NULL THEN 'unknown' {' '.join(parts)} ELSE '{last}+' END"


def _row(values) -> dict:
    steps, drafted, depth, accepted, emitted, fallback, spec_steps, ms = (v or 0 for v in values)
    return {"steps": int(steps), "speculating_steps": int(spec_steps), "drafted": int(drafted),
            "accepted": int(accepted),
            "acceptance": round(accepted / depth, 4) if depth else None,
            "tokens_per_pass": round(emitted / steps, 4) if steps else None,
            "fallback_share": round(fallback / (spec_steps + fallback), 4) if spec_steps + fallback else None,
            "ms_per_token": round(ms / emitted, 4) if emitted else None}


class Filters:
    def __init__(self, model: str | None = None, source: str | None = None, since: float | None = None,
                 run_id: str | None = None) -> None:
        self.clauses, self.params = [], []
        for col, v in (("ss.model_id", model), ("ss.source", source), ("ss.run_id", run_id)):
            if v is not None:
                self.clauses.append(f"{col} = ?")
                self.params.append(v)
        if since is not None:
            self.clauses.append("st.recorded_at >= ?")
            self.params.append(since)

    def where(self, extra: str = "") -> str:
        clauses = self.clauses + ([extra] if extra else [])
        return (" WHERE " + " AND ".join(clauses)) if clauses else ""


def grouped(store: Store, key_sql: str, f: Filters, extra: str = "") -> dict[str, dict]:
    rows = store.query(f"SELECT {key_sql}, {_AGG} FROM {_JOIN}{f.where(extra)} GROUP BY 1 ORDER BY 1", f.params)
    return {str(r[0]): _row(r[1:]) for r in rows}


def by_position(store: Store, f: Filters) -> dict[str, list]:
    """method -> acceptance at draft position 1, 2, ... (accepted / offered at that position)."""
    rows = store.query(f"SELECT st.method, st.depth, st.n_accepted, COUNT(*) FROM {_JOIN}"
                       f"{f.where('st.n_drafted > 0')} GROUP BY st.method, st.depth, st.n_accepted", f.params)
    offered: dict[str, list[int]] = {}
    accepted: dict[str, list[int]] = {}
    for method, depth, acc, n in rows:
        o, a = offered.setdefault(method, []), accepted.setdefault(method, [])
        while len(o) < depth:
            o.append(0)
            a.append(0)
        for i in range(depth):
            o[i] += n
            a[i] += n if i < acc else 0
    return {m: [{"position": i + 1, "offered": o, "acceptance": round(accepted[m][i] / o, 4) if o else None}
                for i, o in enumerate(offered[m])] for m in sorted(offered)}


def by_source(store: Store, f: Filters) -> dict[str, list]:
    """drafter source -> acceptance at position 1, 2, ... over the steps that recorded their
    candidates' sources (schema migration 3; a JSON column, so summed here, not in SQL)."""
    rows = store.query(f"SELECT st.candidate_sources FROM {_JOIN}"
                       f"{f.where('st.candidate_sources IS NOT NULL')}", f.params)
    sums: dict[str, list[list[int]]] = {}
    for (text,) in rows:
        try:
            sources = json.loads(text)
        except (TypeError, ValueError):
            continue
        for name, positions in sources.items():
            acc = sums.setdefault(str(name), [])
            for i, (offered, accepted) in enumerate(positions):
                while len(acc) <= i:
                    acc.append([0, 0])
                acc[i][0] += int(offered)
                acc[i][1] += int(accepted)
    return {name: [{"position": i + 1, "offered": o, "accepted": a, "acceptance": round(a / o, 4) if o else None}
                   for i, (o, a) in enumerate(acc)] for name, acc in sorted(sums.items())}


def gamma_histograms(store: Store, f: Filters) -> dict[str, dict[str, int]]:
    rows = store.query(f"SELECT COALESCE(ss.method, st.method, 'unknown'), st.gamma_used, COUNT(*) FROM {_JOIN}"
                       f"{f.where()} GROUP BY 1, 2 ORDER BY 1, 2", f.params)
    out: dict[str, dict[str, int]] = {}
    for method, gamma, n in rows:
        out.setdefault(str(method), {})[str(gamma)] = int(n)
    return out


def report(store: Store, model: str | None = None, source: str | None = None, since: float | None = None,
           run_id: str | None = None) -> dict:
    f = Filters(model, source, since, run_id)
    sess_where = " WHERE " + " AND ".join(c for c in f.clauses if not c.startswith("st.")) \
        if any(not c.startswith("st.") for c in f.clauses) else ""
    sess_params = [p for c, p in zip(f.clauses, f.params) if not c.startswith("st.")]
    sessions = store.query("SELECT ss.status, COUNT(*), AVG(ss.last_ttft_ms), AVG(ss.last_tpot_ms), "
                           f"SUM(ss.generated_tokens) FROM speculation_sessions ss{sess_where} GROUP BY ss.status "
                           "ORDER BY 1", sess_params)
    events = store.query("SELECT ev.kind, COUNT(*) FROM speculation_events ev LEFT JOIN speculation_sessions ss "
                         f"ON ss.session_id = ev.session_id{sess_where} GROUP BY ev.kind ORDER BY 1", sess_params)
    overall = grouped(store, "'all'", f).get("all", _row([0] * 8))
    return {
        "store": {"schema_version": store.version(), "dialect": store.dialect},
        "sessions": {str(s): {"sessions": int(n), "mean_ttft_ms": None if t is None else round(t, 3),
                              "mean_tpot_ms": None if p is None else round(p, 3), "generated_tokens": int(g or 0)}
                     for s, n, t, p, g in sessions},
        "overall": overall,
        "by_method": grouped(store, "COALESCE(st.method, 'plain')", f),
        "by_content_type": grouped(store, "COALESCE(ss.content_type, 'unknown')", f),
        "by_prompt_length": grouped(store, _bucket_sql(), f),
        "by_hour_utc": grouped(store, "(CAST(st.recorded_at AS BIGINT) / 3600) % 24", f),
        "by_position": by_position(store, f),
        "by_source": by_source(store, f) if store.version() >= 3 else {},
        "gamma_histogram": gamma_histograms(store, f),
        "fallback_share": overall["fallback_share"],
        "events": {str(k): int(n) for k, n in events},
    }


def _table(title: str, groups: dict[str, dict], key: str) -> list[str]:
    lines = [title, f"  {key:<16} {'steps':>8} {'accept':>8} {'tok/pass':>9} {'fallback':>9} {'ms/tok':>8}"]
    for name, r in groups.items():
        def fmt(v, spec):
            return format(v, spec) if v is not None else "-"
        lines.append(f"  {name:<16} {r['steps']:>8} {fmt(r['acceptance'], '>8.3f')} {fmt(r['tokens_per_pass'], '>9.3f')} "
                     f"{fmt(r['fallback_share'], '>9.3f')} {fmt(r['ms_per_token'], '>8.3f')}")
    return lines


def format_report(rep: dict) -> str:
    lines = [f"telemetry store: {rep['store']['dialect']}, schema v{rep['store']['schema_version']}"]
    sess = ", ".join(f"{s} {v['sessions']}" for s, v in rep["sessions"].items()) or "none"
    lines.append(f"sessions: {sess}")
    o = rep["overall"]
    lines.append(f"steps: {o['steps']} (speculating {o['speculating_steps']}), acceptance {o['acceptance']}, "
                 f"tokens/pass {o['tokens_per_pass']}, fell back to plain {o['fallback_share']}")
    lines += _table("by method", rep["by_method"], "method")
    lines += _table("by content type", rep["by_content_type"], "content type")
    lines += _table("by prompt length (tokens)", rep["by_prompt_length"], "prompt")
    lines += _table("by hour (UTC)", rep["by_hour_utc"], "hour")
    lines.append("acceptance by position")
    for m, pos in rep["by_position"].items():
        lines.append(f"  {m:<16} " + " ".join(f"{p['acceptance']:.2f}" if p["acceptance"] is not None else "-"
                                                for p in pos[:16]))
    if rep.get("by_source"):
        lines.append("acceptance by drafter source and position (accepted / candidates offered there)")
        for name, pos in rep["by_source"].items():
            lines.append(f"  {name:<16} " + " ".join(f"{p['acceptance']:.2f}/{p['offered']}" if p["acceptance"] is not None
                                                    else "-" for p in pos[:16]))
    lines.append("gamma histogram (steps per gamma)")
    for m, h in rep["gamma_histogram"].items():
        lines.append(f"  {m:<16} " + " ".join(f"{g}:{n}" for g, n in sorted(h.items(), key=lambda kv: int(kv[0]))))
    lines.append("events: " + (", ".join(f"{k} {n}" for k, n in rep["events"].items()) or "none"))
    return "\n".join(lines)


def as_json(rep: dict) -> str:
    return json.dumps(rep, indent=2, sort_keys=False)
