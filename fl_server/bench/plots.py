"""PNG figures of result tables (matplotlib, headless), written next to docs/RESULTS.md by ``fl-server report``."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_data_size(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """UPFL Fig. 3 style: new-client test accuracy vs the fraction a of data kept, one line per
    (dataset, method), error bars = std over seeds. None when the rows hold no fraction."""
    curves: dict[str, list[tuple[float, float, float]]] = {}
    for r in rows:
        if r.get("split") == "test" and "fraction" in r:
            curves.setdefault(f"{r['method']} ({r['dataset']})" if len({x['dataset'] for x in rows}) > 1
                              else r["method"], []).append((float(r["fraction"]), r["mean"], r["std"]))
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in sorted(curves.items()):
        a, mean, std = zip(*sorted(points))
        ax.errorbar(a, mean, yerr=std, marker="o", capsize=3, label=label)
    seeds = sorted({r["seeds"] for r in rows})
    ax.set(xlabel="fraction a of each new client's data kept", ylabel="new-client test accuracy (%)",
           title=f"{rows[0]['experiment']} ({', '.join(sorted({r['dataset'] for r in rows}))}; "
                 f"seeds {'/'.join(map(str, seeds))})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_odpfl_dp(rows: list[dict[str, Any]], out: Path) -> Path | None:
    from fl_server.bench.odpfl import plot_dp

    return plot_dp(rows, out)


# experiment name -> figure (written to docs/<experiment>.png)
PLOTS = {"upfl-data-size": plot_data_size, "odpfl-dp": plot_odpfl_dp}
