"""The ``unseen-domain`` section of docs/RESULTS.md: one compact table per data set (conditions x methods, the
safeguard off and on at the device SDK's default threshold) and the validation rows the threshold is chosen on.

    from lab.unseen_report import unseen_section
    text = unseen_section("unseen-domain", json.loads(Path("docs/results/unseen-domain.json").read_text()))
"""
from __future__ import annotations

from typing import Any

from edge_sdk.safeguard import DEFAULT_THRESHOLD

# the columns of the test table: (heading, measure)
_COLUMNS = (("received", "received"), ("personalised (safeguard off)", "personalised"),
            ("worse off %", "worse"), ("safeguard on", "safeguard"), ("worse on %", "safeguard_worse"),
            ("kept received %", "kept"))
_TEST_ORDER = ("clean", "digits", "covariate-s3", "covariate-s5")


def _threshold(measure: str, threshold: float) -> float | None:
    """The rows of the safeguarded measures carry their threshold; the others have none."""
    return threshold if measure in ("safeguard", "safeguard_worse", "kept") else None


def _cell(rows: dict[tuple, dict[str, Any]], key: tuple) -> str:
    r = rows.get(key)
    return "-" if r is None else f"{r['mean']:.1f} +- {r['std']:.1f}"


def unseen_section(name: str, rows: list[dict[str, Any]]) -> str:
    """Markdown for the aggregated rows of ``docs/results/<name>.json`` (the unseen-domain table)."""
    from lab.experiments import EXPERIMENTS  # heavy import, only when rendering

    exp = EXPERIMENTS[name]
    by = {(r["dataset"], r["method"], r["split"], r["shift"], r["measure"], r["threshold"]): r for r in rows}
    methods = [m for m in exp.methods if any(r["method"] == m for r in rows)]
    lines = [f"## {name}", "", exp.description, ""]
    if rows:
        first = rows[0]
        lines += [f"Protocol: {first.get('note', '')}. Seeds: {max(r['seeds'] for r in rows)}; device: "
                  f"{first['device']}; command: `{first.get('command', '')}`. Mean +- sample std over seeds; "
                  f"safeguard at threshold {DEFAULT_THRESHOLD} (edge_sdk.safeguard.DEFAULT_THRESHOLD).", ""]
    t = DEFAULT_THRESHOLD
    if any(r["shift"] == "val-mean" for r in rows):
        from lab.unseen import PERSONALISING, chosen_threshold

        lines += [f"Validation shifts pick threshold {chosen_threshold(rows, PERSONALISING):g} (best mean safeguarded "
                  f"val-mean accuracy over the personalising methods and data sets; ties to the larger); the device "
                  f"SDK's default is {t:g}.", ""]
    for dataset in sorted({r["dataset"] for r in rows}):
        lines += [f"### {dataset}: new clients (test)", "",
                  "| condition | method | " + " | ".join(h for h, _ in _COLUMNS) + " | seeds |",
                  "|---|---|" + "---|" * (len(_COLUMNS) + 1)]
        shifts = [s for s in _TEST_ORDER if any(k[0] == dataset and k[3] == s for k in by)]
        for shift in shifts:
            for m in methods:
                if (dataset, m, "test", shift, "received", None) not in by:
                    continue
                cells = [_cell(by, (dataset, m, "test", shift, meas, _threshold(meas, t))) for _, meas in _COLUMNS]
                seeds = by[(dataset, m, "test", shift, "received", None)]["seeds"]
                lines.append(f"| {shift} | {m} | " + " | ".join(cells) + f" | {seeds} |")
        thresholds = sorted({k[5] for k in by if k[0] == dataset and k[3] == "val-mean" and k[5] is not None})
        lines += ["", f"### {dataset}: validation shifts (val-mean), safeguarded accuracy by threshold", "",
                  "| method | received | personalised | " + " | ".join(f"t={x:g}" for x in thresholds) + " |",
                  "|---|---|---|" + "---|" * len(thresholds)]
        for m in methods:
            if (dataset, m, "val", "val-mean", "personalised", None) not in by:
                continue
            cells = [_cell(by, (dataset, m, "val", "val-mean", "safeguard", x)) for x in thresholds]
            lines.append(f"| {m} | {_cell(by, (dataset, m, 'val', 'val-mean', 'received', None))} | "
                         f"{_cell(by, (dataset, m, 'val', 'val-mean', 'personalised', None))} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def unseen_summary(name: str, rows: list[dict[str, Any]]) -> str:
    """The compact unseen-domain section of docs/RESULTS.md: per data set one method x condition table whose
    cells read "received -> personalised (safeguard on)", seed means; every measure with its spread, the
    share of clients made worse and the validation tables are on the research page (:func:`unseen_section`)."""
    from lab.experiments import EXPERIMENTS  # heavy import, only when rendering

    exp = EXPERIMENTS[name]
    by = {(r["dataset"], r["method"], r["split"], r["shift"], r["measure"], r["threshold"]): r for r in rows}
    methods = [m for m in exp.methods if any(r["method"] == m for r in rows)]
    t = DEFAULT_THRESHOLD
    lines = [f"## {name}", "", exp.description.split(". ")[0].rstrip(".") + ".", ""]
    if rows:
        lines += [f"Protocol: {rows[0].get('note', '')}. {max(r['seeds'] for r in rows)} seeds; "
                  f"`{rows[0].get('command', '')}`. Cells: received -> personalised (safeguard on, threshold {t:g}), "
                  f"mean over seeds (FedAvg's model is TENT's received one). Spreads, the share of clients made "
                  f"worse and the validation shifts that chose "
                  f"the threshold: [research page](research/results-detail.md#{name}).", ""]

    def mean(key: tuple) -> str:
        r = by.get(key)
        return "-" if r is None else f"{r['mean']:.1f}"

    for dataset in sorted({r["dataset"] for r in rows}):
        shifts = [s for s in _TEST_ORDER if any(k[0] == dataset and k[3] == s for k in by)]
        lines += [f"**{dataset}**", "", "| method | " + " | ".join(shifts) + " |", "|---|" + "---|" * len(shifts)]
        for m in methods:
            if m == "FedAvg":  # the received model: TENT's first number in every cell
                continue
            cells = []
            for s in shifts:
                base = (dataset, m, "test", s)
                cells.append(f"{mean((*base, 'received', None))} -> {mean((*base, 'personalised', None))} "
                             f"({mean((*base, 'safeguard', t))})")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"
