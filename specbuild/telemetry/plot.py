"""`specbuild telemetry DB --plot FILE.png`: acceptance by position per method, tokens per
pass by content type, and gamma over one session's steps (matplotlib, no display needed)."""

from __future__ import annotations

from specbuild.telemetry.store import Store


def session_steps(store: Store, session_id: str | None = None) -> tuple[str | None, list[tuple]]:
    """(session id, [(step_num, gamma_used, n_accepted)]) of `session_id`, or of the session
    with the most speculating steps."""
    if session_id is None:
        rows = store.query("SELECT session_id, COUNT(*) FROM speculation_steps WHERE n_drafted > 0 "
                           "GROUP BY session_id ORDER BY 2 DESC, 1 LIMIT 1")
        if not rows:
            return None, []
        session_id = rows[0][0]
    steps = store.query("SELECT step_num, gamma_used, n_accepted FROM speculation_steps WHERE session_id = ? "
                        "ORDER BY step_num, step_id", (session_id,))
    return session_id, steps


def plot_report(rep: dict, steps: tuple[str | None, list[tuple]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for method, pos in rep["by_position"].items():
        xs = [p["position"] for p in pos if p["acceptance"] is not None]
        ax.plot(xs, [p["acceptance"] for p in pos if p["acceptance"] is not None], marker="o", label=method)
    ax.set(title="acceptance by draft position", xlabel="position", ylabel="accepted / offered", ylim=(0, 1.02))
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if rep["by_position"]:
        ax.legend()
    ax = axes[1]
    types = [(k, v["tokens_per_pass"]) for k, v in rep["by_content_type"].items() if v["tokens_per_pass"] is not None]
    ax.bar([k for k, _ in types], [v for _, v in types], color="tab:green")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set(title="tokens per pass by content type", ylabel="tokens / target pass")
    ax = axes[2]
    sid, rows = steps
    if rows:
        ax.step([r[0] for r in rows], [r[1] for r in rows], where="post", label="gamma")
        ax.plot([r[0] for r in rows], [r[2] for r in rows], ".", label="accepted")
        ax.legend()
    ax.set(title=f"gamma over session {sid[:8] if sid else '-'}", xlabel="decode pass", ylabel="tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
