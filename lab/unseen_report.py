"""The ``unseen-domain`` section of docs/RESULTS.md and its research page: per data set, received ->
personalised (safeguard off) -> safeguarded (each method's declared rule), the headline promise (no cell more
than a point below the received model) and the validation candidates each rule was chosen among.

    from lab.unseen_report import unseen_section
    text = unseen_section("unseen-domain", json.loads(Path("docs/results/unseen-domain.json").read_text()))
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

CHOICE = Path("docs/results/safeguard-choice.json")
# the columns of the test table: (heading, measure)
_COLUMNS = (("received", "received"), ("personalised (safeguard off)", "personalised"),
            ("worse off %", "worse"), ("safeguarded", "safeguard"), ("worse on %", "safeguard_worse"),
            ("kept received %", "kept"))
_TEST_ORDER = ("clean", "digits", "covariate-s3", "covariate-s5")
_GUARDED = ("safeguard", "safeguard_worse", "kept")


def _key(r: dict[str, Any]) -> tuple:
    return r["dataset"], r["method"], r["split"], r["shift"], r["measure"], r.get("rule")


def _rule(measure: str) -> str | None:
    """The safeguarded measures are read at each method's declared rule; the others have no rule."""
    return "declared" if measure in _GUARDED else None


def headline(rows: list[dict[str, Any]], loss: float = 1.0) -> dict[str, Any]:
    """The promise on the test conditions (each single shift, not the covariate means), mean over seeds, at each
    method's declared rule: cells more than ``loss`` points below the received model without and with the
    safeguard, the worst cell of each, and the share of the unguarded total positive gain the safeguard keeps."""
    by = {_key(r): r["mean"] for r in rows}
    off, on = [], []
    for (dataset, method, split, shift, measure, rule), rec in by.items():
        if split != "test" or measure != "received" or shift.startswith("covariate-"):
            continue
        per, safe = by.get((dataset, method, split, shift, "personalised", None)), \
            by.get((dataset, method, split, shift, "safeguard", "declared"))
        if per is None or safe is None:
            continue
        off.append((per - rec, f"{dataset}/{method}/{shift}"))
        on.append((safe - rec, f"{dataset}/{method}/{shift}"))
    if not on:
        return {}
    positive = sum(max(0.0, g) for g, _ in off)
    return {"cells": len(on), "worse_off": sum(g < -loss for g, _ in off), "worse_on": sum(g < -loss for g, _ in on),
            "worst_off": min(off), "worst_on": min(on),
            "gain_kept": (sum(max(0.0, g) for g, _ in on) / positive) if positive > 0 else 1.0,
            "mean_gain_off": float(np.mean([g for g, _ in off])), "mean_gain_on": float(np.mean([g for g, _ in on]))}


def _headline_lines(rows: list[dict[str, Any]]) -> list[str]:
    h = headline(rows)
    if not h:
        return []
    return [f"Over the {h['cells']} test cells (method x data set x condition, mean over seeds): personalisation "
            f"alone leaves {h['worse_off']} more than a point below the received model (worst "
            f"{h['worst_off'][0]:+.1f}, {h['worst_off'][1]}); with each method's declared safeguard rule "
            f"{h['worse_on']} (worst {h['worst_on'][0]:+.1f}, {h['worst_on'][1]}), keeping "
            f"{100 * h['gain_kept']:.0f}% of personalisation's total positive gain (mean gain per cell "
            f"{h['mean_gain_off']:+.2f} -> {h['mean_gain_on']:+.2f} points).", ""]


def _missed_lines(rows: list[dict[str, Any]], loss: float = 1.0) -> list[str]:
    """The test cells the declared rules still leave more than ``loss`` points below the received model, with
    what the rule did there (the share of clients it did not leave on the personalised model)."""
    by = {_key(r): r["mean"] for r in rows}
    missed = []
    for (dataset, method, split, shift, measure, _), rec in by.items():
        safe = by.get((dataset, method, split, shift, "safeguard", "declared"))
        if split == "test" and measure == "received" and not shift.startswith("covariate-") and safe is not None \
                and safe - rec < -loss:
            kept = by.get((dataset, method, split, shift, "kept", "declared"), float("nan"))
            missed.append(f"{dataset}/{method}/{shift} {safe - rec:+.1f} (received {rec:.1f}, personalised "
                          f"{by[(dataset, method, split, shift, 'personalised', None)]:.1f}, safeguarded {safe:.1f}; "
                          f"the rule rolled back or mixed the two models for {kept:.0f}% of clients)")
    if not missed:
        return []
    return [f"Test cells still more than {loss:g} point below the received model: " + "; ".join(sorted(missed)) + ".",
            ""]


def _choice_lines(methods: list[str]) -> list[str]:
    if not CHOICE.is_file():
        return []
    data = json.loads(CHOICE.read_text())
    choice = data["methods"]
    lines = ["### Rules chosen on the validation shifts", "",
             "Each method's candidates, scored on the validation conditions only; a fitted rule is scored on "
             "clients it was not fitted on, leaving out in turn one condition, one corruption type (both "
             "severities) and one data set, and keeps the lowest mean gain and worst cell of the three. "
             "Admissible = no validation cell (its mean over seeds; less the seeds' standard error where the "
             f"criterion below has a seed margin) more than {data['max_val_loss']:g} points below the received model; "
             "the admissible fixed-form rule (off, rollback, disagreement, each alone or partial) of best mean gain "
             f"is declared unless an admissible linear rule beats it by more than {data['simple_margin']:g} "
             "point (`python -m lab.safeguard_choice`; the criterion, and why, is in that module's docstring). It "
             "was fixed before the test table above was read.", ""]
    variants = {v["variant"]: v for v in data.get("variants", [])}
    if data.get("criterion") in variants:
        lines += [f"The criterion is the variant `{data['criterion']}` ({variants[data['criterion']]['why']}), chosen "
                  "among the variants below by the nested check on validation alone: fewest held-out cells more "
                  "than a point below the received model over both ways of holding out, then the best held-out "
                  "mean gain, then the simpler variant.", ""]
    checks = data.get("procedure_check", {})
    if checks:
        lines += ["The choice itself checked on validation shifts it did not see (per method: hold out one "
                  "corruption type or one data set, choose on the rest, score the chosen rule on the held-out "
                  "cells; `previous` is the first criterion this choice used, `PREVIOUS` in "
                  "lab/safeguard_choice.py, not a variant):", "",
                  "| criterion | held out | cells | more than 1 point below received | worst | gain kept |",
                  "|---|---|---|---|---|---|"]
        for crit, by in checks.items():
            for how, c in by.items():
                lines.append(f"| {crit} | {how.removeprefix('hold out one ')} | {c['cells']} | {c['below']} | "
                             f"{c['worst'][0]:+.2f} ({c['worst'][1]}) | {100 * c['gain_kept']:.0f}% |")
        lines.append("")
    lines += ["| method | candidate | val mean gain | val worst cell | admissible |", "|---|---|---|---|---|"]
    for m in methods:
        if m not in choice:
            continue
        chosen = choice[m]["rule"]
        for c in choice[m]["candidates"]:
            mark = " (declared)" if c.get("chosen") else ""
            lines.append(f"| {m} | {c['candidate']}{mark} | {c['val_mean_gain']:+.2f} | {c['val_worst_cell']:+.2f} | "
                         f"{'yes' if c['admissible'] else 'no'} |")
        lines.append(f"| {m} | declared: `{json.dumps(chosen)}` | | | |")
    return [*lines, ""]


def _cell(rows: dict[tuple, dict[str, Any]], key: tuple) -> str:
    r = rows.get(key)
    return "-" if r is None else f"{r['mean']:.1f} +- {r['std']:.1f}"


def unseen_section(name: str, rows: list[dict[str, Any]]) -> str:
    """Markdown for the aggregated rows of ``docs/results/<name>.json`` (the research page's full tables)."""
    from lab.experiments import EXPERIMENTS  # heavy import, only when rendering

    exp = EXPERIMENTS[name]
    by = {_key(r): r for r in rows}
    methods = [m for m in exp.methods if any(r["method"] == m for r in rows)]
    lines = [f"## {name}", "", exp.description, ""]
    if rows:
        first = rows[0]
        lines += [f"Protocol: {first.get('note', '')}. Seeds: {max(r['seeds'] for r in rows)}; device: "
                  f"{first['device']}; command: `{first.get('command', '')}`. Mean +- sample std over seeds; "
                  "safeguarded = each method's declared rule.", "", *_headline_lines(rows), *_missed_lines(rows)]
    for dataset in sorted({r["dataset"] for r in rows}):
        lines += [f"### {dataset}: new clients (test)", "",
                  "| condition | method | " + " | ".join(h for h, _ in _COLUMNS) + " | seeds |",
                  "|---|---|" + "---|" * (len(_COLUMNS) + 1)]
        shifts = [s for s in _TEST_ORDER if any(k[0] == dataset and k[3] == s for k in by)]
        for shift in shifts:
            for m in methods:
                if (dataset, m, "test", shift, "received", None) not in by:
                    continue
                cells = [_cell(by, (dataset, m, "test", shift, meas, _rule(meas))) for _, meas in _COLUMNS]
                seeds = by[(dataset, m, "test", shift, "received", None)]["seeds"]
                lines.append(f"| {shift} | {m} | " + " | ".join(cells) + f" | {seeds} |")
        lines += ["", f"### {dataset}: validation shifts (val-mean)", "",
                  "| method | " + " | ".join(h for h, _ in _COLUMNS) + " |", "|---|" + "---|" * len(_COLUMNS)]
        for m in methods:
            if (dataset, m, "val", "val-mean", "personalised", None) in by:
                cells = [_cell(by, (dataset, m, "val", "val-mean", meas, _rule(meas))) for _, meas in _COLUMNS]
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += _choice_lines(methods)
    return "\n".join(lines) + "\n"


def unseen_summary(name: str, rows: list[dict[str, Any]]) -> str:
    """The compact unseen-domain section of docs/RESULTS.md: per data set one method x condition table whose
    cells read "received -> personalised (safeguarded)", seed means, and the headline promise; every measure
    with its spread and the validation choice of the rules are on the research page (:func:`unseen_section`)."""
    from lab.experiments import EXPERIMENTS  # heavy import, only when rendering

    exp = EXPERIMENTS[name]
    by = {_key(r): r for r in rows}
    methods = [m for m in exp.methods if any(r["method"] == m for r in rows)]
    lines = [f"## {name}", "", exp.description.split(". ")[0].rstrip(".") + ".", ""]
    if rows:
        lines += [f"Protocol: {rows[0].get('note', '')}. {max(r['seeds'] for r in rows)} seeds; "
                  f"`{rows[0].get('command', '')}`. Cells: received -> personalised (safeguarded with the method's "
                  f"declared rule), mean over seeds (FedAvg's model is TENT's received one). Spreads, the share of "
                  f"clients made worse and the validation shifts that chose each rule: "
                  f"[research page](research/results-detail.md#{name}).", "", *_headline_lines(rows)]

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
                             f"({mean((*base, 'safeguard', 'declared'))})")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"
