"""PNG figures of result tables (matplotlib, headless), written next to docs/RESULTS.md by ``python -m lab report``."""
from __future__ import annotations

import math
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
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in sorted(curves.items()):
        a, mean, std = zip(*sorted(points))
        ax.errorbar(a, mean, yerr=std, marker="o", capsize=3, label=label)
    seeds = sorted({r["seeds"] for r in rows})
    ax.set(xlabel="fraction a of each new client's data kept", ylabel="new-client test accuracy (%)",
           title=f"{rows[0]['experiment']} ({', '.join(sorted({r['dataset'] for r in rows}))}; "
                 f"seeds {'/'.join(map(str, seeds))})")
    return _save(fig, ax, out)


def plot_odpfl_dp(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """ODPFL-HN Sec. 7: new-client accuracy vs |D| (log axis), one line per epsilon, FedAvg's global model
    dashed; error bars = std over seeds. None when the rows hold no (|D|, eps) results."""
    from lab.odpfl import DP_DELTA

    dp_rows = [r for r in rows if r["method"] == "ODPFL-HN" and r["split"] == "test" and "set_size" in r]
    if not dp_rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for eps in sorted({r["epsilon"] for r in dp_rows}):
        n, mean, std = zip(*sorted((r["set_size"], r["mean"], r["std"]) for r in dp_rows if r["epsilon"] == eps))
        ax.errorbar(n, mean, yerr=std, marker="o", capsize=3,
                    label=f"ODPFL-HN eps={eps:g}" if math.isfinite(eps) else "ODPFL-HN no noise")
    for r in rows:
        if r["method"] == "FedAvg" and r["split"] == "test":
            ax.axhline(r["mean"], ls="--", color="gray", label="FedAvg (global model)")
    ax.set_xscale("log")
    ax.set(xlabel="|D| (samples in the new client's embedding set)", ylabel="new-client accuracy (%)",
           title=f"odpfl-dp ({dp_rows[0]['dataset']}, delta={DP_DELTA}; seeds {max(r['seeds'] for r in dp_rows)})")
    return _save(fig, ax, out)


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, out: Path) -> Path:  # type: ignore[no-untyped-def]
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    _pyplot().close(fig)
    return out


# experiment name -> figure (written to docs/<experiment>.png)
PLOTS = {"upfl-data-size": plot_data_size, "odpfl-dp": plot_odpfl_dp}
