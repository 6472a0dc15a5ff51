"""`specbuild telemetry policy learn DB`: gamma_default, alpha_threshold and prior_alpha per
(model, content type, method) from recorded steps.

- prior_alpha: the per-position acceptance a, by maximum likelihood under the controller's
  own model (each position accepted with probability a until the first rejection):
  a = accepted / (accepted + steps that ended in a rejection).
- cost: a least-squares line through each step's (positions offered, draft + target ms),
  per model and method: cost(g) = c0 + c1 * g (c0: a plain pass).
- gamma_default: argmax over g in [gamma_min, gamma_max] of E(a, g) / cost(g), E the
  expected tokens of gamma.expected_tokens (the controller's own choice for that prior).
- alpha_threshold: the break-even acceptance, below which no g >= 1 beats a plain pass
  (1 / c0); speculation is switched off below it (acceptance collapse).
"""

from __future__ import annotations

from specbuild.speculation.gamma import expected_tokens
from specbuild.speculation.policy import GammaPolicy
from specbuild.telemetry.store import Store

MIN_STEPS = 32


def fit_cost(points: list[tuple[int, int, float]]) -> tuple[float, float] | None:
    """points: (depth, count, mean ms) -> (c0, c1) by weighted least squares; None if degenerate."""
    n = sum(c for _, c, _ in points)
    if n == 0:
        return None
    mx = sum(d * c for d, c, _ in points) / n
    my = sum(m * c for _, c, m in points) / n
    sxx = sum(c * (d - mx) ** 2 for d, c, _ in points)
    if sxx == 0:
        return None
    c1 = sum(c * (d - mx) * (m - my) for d, c, m in points) / sxx
    c0 = my - c1 * mx
    if c0 <= 0:
        return None
    return c0, max(c1, 0.0)


def rate(alpha: float, g: int, cost: tuple[float, float]) -> float:
    return expected_tokens(alpha, g) / (cost[0] + cost[1] * g)


def break_even(cost: tuple[float, float], gamma_max: int) -> float:
    """Smallest a (to 1e-3) at which some g in [1, gamma_max] beats plain decoding."""
    plain = 1.0 / cost[0]
    lo, hi = 0.0, 1.0
    for _ in range(12):
        mid = (lo + hi) / 2
        if max(rate(mid, g, cost) for g in range(1, gamma_max + 1)) > plain:
            hi = mid
        else:
            lo = mid
    return round(hi, 3)


def learn(store: Store, model: str | None = None, gamma_min: int = 0, gamma_max: int = 8,
          min_steps: int = MIN_STEPS) -> tuple[list[GammaPolicy], list[str]]:
    """Policies fitted from the store's steps, and a line for each group left out (why)."""
    where, params = ("WHERE ss.model_id = ?", [model]) if model else ("", [])
    join = "speculation_steps st JOIN speculation_sessions ss ON ss.session_id = st.session_id"
    cost_rows = store.query(f"SELECT ss.model_id, st.method, st.depth, COUNT(*), "
                            f"AVG(st.draft_latency_ms + st.target_latency_ms) FROM {join} {where} "
                            "GROUP BY ss.model_id, st.method, st.depth", params)
    plain: dict[str, list] = {}
    by_method: dict[tuple[str, str], list] = {}
    for mid, method, depth, n, ms in cost_rows:
        if method is None:
            plain.setdefault(mid, []).append((0, int(n), float(ms)))
        else:
            by_method.setdefault((mid, method), []).append((int(depth), int(n), float(ms)))
    acc_rows = store.query(f"SELECT ss.model_id, COALESCE(ss.content_type, 'chat'), st.method, COUNT(*), "
                           "SUM(st.n_accepted), SUM(CASE WHEN st.n_accepted < st.depth THEN 1 ELSE 0 END) "
                           f"FROM {join} {where}{' AND' if where else ' WHERE'} st.n_drafted > 0 "
                           "GROUP BY ss.model_id, COALESCE(ss.content_type, 'chat'), st.method ORDER BY 1, 2, 3", params)
    out, skipped = [], []
    for mid, ctype, method, n, accepted, rejections in acc_rows:
        name = f"{mid}/{ctype}/{method}"
        if n < min_steps:
            skipped.append(f"{name}: {n} speculating steps (fewer than {min_steps})")
            continue
        cost = fit_cost(by_method.get((mid, method), []) + plain.get(mid, []))
        if cost is None:
            skipped.append(f"{name}: step costs do not vary with depth (no cost line)")
            continue
        accepted, rejections = int(accepted or 0), int(rejections or 0)
        alpha = accepted / (accepted + rejections) if accepted + rejections else 1.0
        alpha = min(alpha, 0.999)
        lo = max(gamma_min, 1)
        g = max(range(lo, gamma_max + 1), key=lambda k: rate(alpha, k, cost))
        out.append(GammaPolicy(model_id=mid, content_type=ctype, method=method, gamma_min=gamma_min,
                               gamma_max=gamma_max, gamma_default=max(g, gamma_min),
                               alpha_threshold=min(max(break_even(cost, gamma_max), 0.01), 0.99),
                               prior_alpha=round(alpha, 4), source="learned", n_steps=int(n)))
    return out, skipped
