"""`bench --plot FILE.png`: each row's speedup over its engine's plain row, by task group
(matplotlib, no display needed)."""

from __future__ import annotations


def plot_speedups(report: dict, path: str) -> str:
    """One group of bars per task group (overall last), one bar per row that has a speedup;
    a line at 1.0x (plain decoding). Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if any(g.get("speedup") is not None for g in r["groups"].values())]
    if not rows:
        raise ValueError("the report has no speedups to plot")
    groups = [g for g in rows[0]["groups"] if g != "overall"] + ["overall"]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) + 2), 4.0))
    for i, r in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(groups))]
        ys = [r["groups"].get(g, {}).get("speedup") or 0.0 for g in groups]
        ax.bar(xs, ys, width, label=r["name"])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    ax.set_ylabel("speedup over the engine's plain decoding")
    env = report.get("env", {})
    ax.set_title(f"specbuild bench: {report.get('config', {}).get('split', '')} split, "
                 f"{env.get('cpu', '')}"[:90], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
