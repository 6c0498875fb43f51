"""The issues' acceptance criteria, checked against the result tables (``docs/results/*.json``).

``python -m lab report`` puts the verdicts at the top of docs/RESULTS.md, so what reproduces and what does not is
read off the measured rows, never typed in. A criterion is *met* when it holds on the means and every row it
reads has at least ``SEEDS`` seeds; *not met* when it fails with that many seeds; *partial* when a row has
fewer seeds (the verdict so far is shown); *missing* when a row it needs is absent. Thresholds are the issues'
(papers' numbers minus the stated tolerance), comparisons are "at or above" on the mean over seeds.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lab.experiments import EXPERIMENTS

Row = dict[str, Any]
Results = dict[str, list[Row]]

SEEDS = 3  # every criterion asks for 3 seeds


@dataclass(frozen=True)
class Verdict:
    status: str  # "met" | "not met" | "partial" | "missing"
    measured: str  # the numbers the verdict rests on, from the rows


@dataclass(frozen=True)
class Criterion:
    issue: int
    text: str
    check: Callable[[Results], Verdict]
    diagnosis: str = ""  # a docs-relative page on why it fails, shown while the verdict is not "met"


# the research pages that explain a failing criterion (relative to docs/)
FEDTTAPP_FMNIST = ("research/fedttapp-diagnosis.md"
                   "#fashion-mnist-seed-0-finished-most-of-the-gap-to-950-is-in-the-shared-training")
ODPFL_NOTES, BTGFL_NOTES, MAP_NOTES = ("research/odpfl-hn-diagnosis.md", "research/btgfl-diagnosis.md",
                                      "research/map-diagnosis.md")
FEDICON_NOTES = "research/results-detail.md#fedicon-shift"  # the experiment's description: rates, budget, CNN


def find(results: Results, experiment: str, dataset: str, method: str, split: str = "test",
         **fields: Any) -> Row | None:
    """The row of ``experiment`` for (dataset, method, split) whose extra fields (column, shift, ...) match."""
    for r in results.get(experiment, []):
        if (r["dataset"], r["method"], r["split"]) == (dataset, method, split) and \
                all(r.get(k) == v for k, v in fields.items()):
            return r
    return None


def _show(row: Row) -> str:
    return f"{row['method']} {row['mean']:.2f} ({row['seeds']} seed{'s' if row['seeds'] != 1 else ''})"


def _verdict(ok: bool, rows: Iterable[Row], measured: str, comparison: bool = True) -> Verdict:
    fewest = min(r["seeds"] for r in rows)
    if fewest >= SEEDS:
        return Verdict("met" if ok else "not met", measured)
    so_far = f", {'passing' if ok else 'failing'} so far" if comparison else ""
    return Verdict("partial", f"{measured}; {fewest} of {SEEDS} seeds{so_far}")


def _missing(what: str) -> Verdict:
    return Verdict("missing", f"no row for {what}")


def at_least(experiment: str, dataset: str, method: str, threshold: float, **fields: Any) -> Callable[[Results], Verdict]:
    def check(results: Results) -> Verdict:
        row = find(results, experiment, dataset, method, **fields)
        if row is None:
            return _missing(f"{experiment} {dataset} {method}")
        return _verdict(row["mean"] >= threshold, [row], f"{_show(row)} vs >= {threshold:.2f}")
    return check


def beats(experiment: str, dataset: str, method: str, others: tuple[str, ...], margin: float = 0.0,
          strict: bool = False, splits: tuple[str, ...] = ("test",),
          fields: tuple[dict[str, Any], ...] = ({},)) -> Callable[[Results], Verdict]:
    """``method`` at or above (``strict``: above) each of ``others`` plus ``margin``, on every (split, fields)."""
    def check(results: Results) -> Verdict:
        ok, rows, parts = True, [], []
        for split in splits:
            for f in fields:
                mine = find(results, experiment, dataset, method, split, **f)
                if mine is None:
                    return _missing(f"{experiment} {dataset} {method} {split} {f or ''}")
                rows.append(mine)
                label = " ".join(str(v) for v in f.values())
                for other in others:
                    theirs = find(results, experiment, dataset, other, split, **f)
                    if theirs is None:
                        return _missing(f"{experiment} {dataset} {other} {split} {f or ''}")
                    rows.append(theirs)
                    gap = mine["mean"] - theirs["mean"] - margin
                    ok &= gap > 0 if strict else gap >= 0
                    parts.append(f"{label + ': ' if label else ''}{mine['mean']:.2f} vs {other} {theirs['mean']:.2f}"
                                 + (f" + {margin:g}" if margin else ""))
        return _verdict(ok, rows, f"{method}: " + "; ".join(parts))
    return check


def within(experiment: str, dataset: str, a: str, b: str, tol: float, **fields: Any) -> Callable[[Results], Verdict]:
    def check(results: Results) -> Verdict:
        ra, rb = (find(results, experiment, dataset, m, **fields) for m in (a, b))
        if ra is None or rb is None:
            return _missing(f"{experiment} {dataset} {a if ra is None else b}")
        gap = abs(ra["mean"] - rb["mean"])
        return _verdict(gap <= tol, [ra, rb], f"{_show(ra)}, {_show(rb)}: gap {gap:.2f} vs <= {tol:g}")
    return check


def table_complete(experiment: str) -> Callable[[Results], Verdict]:
    """Every method the experiment defines has rows, all with at least SEEDS seeds."""
    methods = EXPERIMENTS[experiment].methods

    def check(results: Results) -> Verdict:
        rows = results.get(experiment, [])
        absent = [m for m in methods if not any(r["method"] == m for r in rows)]
        if not rows or absent:
            return _missing(f"{experiment} {', '.join(absent) if rows else '(no table)'}")
        seeds = {m: min(r["seeds"] for r in rows if r["method"] == m) for m in methods}
        return _verdict(True, rows, "seeds per method: " + ", ".join(f"{m} {s}" for m, s in seeds.items()),
                        comparison=False)
    return check


SDK_BENCHMARK = "benchmark:edge-sdk"  # the key under which status_section gets docs/benchmarks/edge-sdk.json


def sdk_parity(what: str, tol: float = 0.1) -> Callable[[Results], Verdict]:
    """Every edge-sdk parity row whose ``what`` starts with ``what``: |SDK - torch| mean accuracy <= ``tol``
    points. A parity row is one run, not a mean over seeds, so there is no partial verdict."""
    def check(results: Results) -> Verdict:
        rows = [r for r in results.get(SDK_BENCHMARK, []) if str(r.get("what", "")).startswith(what)]
        if not rows:
            return _missing(f"edge-sdk {what}")
        ok = all(abs(float(r["value"])) <= tol for r in rows)
        parts = [f"{r['what'][len(what):].strip() or r['what']}"
                 + (f" ({r['protocol_rounds']}-round run)" if "protocol_rounds" in r else "")
                 + f": {float(r['value']):+.3f}" for r in rows]
        return Verdict("met" if ok else "not met", f"SDK - torch (points): {'; '.join(parts)}; abs diff <= {tol:g}")
    return check


VMAP_BENCHMARK = "benchmark:vmap-engine"  # docs/benchmarks/vmap-engine.json
# docs/benchmarks/<name>.json files that criteria read, by the key status_section gets them under
BENCHMARK_INPUTS = {"edge-sdk": SDK_BENCHMARK, "vmap-engine": VMAP_BENCHMARK}


def vmap_engine(what: str, device: str, min_speedup: float) -> Callable[[Results], Verdict]:
    """The vmap-engine row ``what`` on devices starting with ``device`` (the newest such row): vmap at least
    ``min_speedup`` x the per-client loop, parameters equal within 1e-10 in float64 and 1e-4 in float32. FedTTA's
    float32 parity is read after 1 and 5 local iterations: its g/||g|| step amplifies rounding over 20
    (benchmarks/vmap_engine.py, SHORT_PARITY_ITERATIONS; the 20-iteration figure stays in the row)."""
    def check(results: Results) -> Verdict:
        rows = [r for r in results.get(VMAP_BENCHMARK, [])
                if r.get("what") == what and str(r.get("device", "")).startswith(device)]
        if not rows:
            return _missing(f"vmap-engine {what!r} on {device}")
        r = rows[-1]
        short = [v for k, v in r.items() if k.startswith("max_abs_diff_float32_")]
        f32 = max(short or [r["max_abs_diff_float32"]])
        ok = r["value"] >= min_speedup and r["max_abs_diff_float64"] <= 1e-10 and f32 <= 1e-4
        return Verdict("met" if ok else "not met",
                       f"{r['device']}: {r['value']:.2f}x vs >= {min_speedup:g}x; float64 diff "
                       f"{r['max_abs_diff_float64']:.1e}, float32 diff {f32:.1e}"
                       + (" (after 1 and 5 local iterations)" if short else ""))
    return check


def safeguard_promise(part: str) -> Callable[[Results], Verdict]:
    """The unseen-domain table at each method's declared safeguard rule (lab.unseen_report.headline): ``"harm"``,
    no test cell more than a point below the received model; ``"gain"``, at least 80% of personalisation's total
    positive gain kept."""
    def check(results: Results) -> Verdict:
        from lab.unseen_report import headline

        rows = results.get("unseen-domain", [])
        h = headline(rows)
        if not h:
            return Verdict("missing", "no unseen-domain rows with a declared rule")
        if part == "harm":
            ok, measured = h["worse_on"] == 0, (f"{h['worse_on']} of {h['cells']} cells below -1 "
                                                f"(worst {h['worst_on'][0]:+.2f}, {h['worst_on'][1]})")
        else:
            ok, measured = h["gain_kept"] >= 0.8, f"{100 * h['gain_kept']:.0f}% of the positive gain kept"
        fewest = min(r["seeds"] for r in rows)
        return Verdict(("met" if ok else "not met") if fewest >= SEEDS else "partial", measured)
    return check


_COVARIATE = tuple({"shift": f"covariate-s{s}"} for s in (1, 3, 5))

CRITERIA: tuple[Criterion, ...] = (
    Criterion(2, "UPFL Table 1 MNIST: FedAvg new clients >= paper 94.69 - 2", at_least("upfl-table1", "mnist", "FedAvg", 92.69)),
    Criterion(2, "UPFL Table 1 Fashion-MNIST: FedAvg new clients >= paper 86.99 - 2",
              at_least("upfl-table1", "fashion_mnist", "FedAvg", 84.99)),
    Criterion(2, "UPFL Table 1 MNIST: TENT new clients >= 97.0", at_least("upfl-table1", "mnist", "TENT", 97.0)),
    Criterion(2, "UPFL Table 1 Fashion-MNIST: TENT new clients >= 93.0", at_least("upfl-table1", "fashion_mnist", "TENT", 93.0)),
    *(Criterion(2, f"vmap-engine {what} on the {name}: vmap >= {x:g}x the per-client loop, parity in float64 "
                   "and float32", vmap_engine(what, device, x))
      for what, device, name, x in (("FedAvg round, MLP 2x200", "cpu", "CPU", 0.9),
                                    ("FedTTA round, MLP 2x200", "cpu", "CPU", 0.9),
                                    ("FedAvg round, MLP 2x200", "cuda", "GPU", 10.0),
                                    ("FedTTA round, MLP 2x200", "cuda", "GPU", 10.0))),
    Criterion(3, "UPFL Table 1 MNIST: FedTTA++ new clients >= 98.0", at_least("upfl-table1", "mnist", "FedTTA++", 98.0)),
    Criterion(3, "UPFL Table 1 Fashion-MNIST: FedTTA++ new clients >= 95.0",
              at_least("upfl-table1", "fashion_mnist", "FedTTA++", 95.0), FEDTTAPP_FMNIST),
    *(Criterion(3, f"UPFL Table 1 {name}: {m} >= FedAvg + 3 on new clients",
                beats("upfl-table1", ds, m, ("FedAvg",), margin=3.0))
      for ds, name in (("mnist", "MNIST"), ("fashion_mnist", "Fashion-MNIST"))
      for m in ("FedTTA", "FedTTA-Prox", "FedTTA++")),
    Criterion(3, "upfl-concept-shift table with 3 seeds",
              table_complete("upfl-concept-shift")),
    Criterion(3, "upfl-data-size table with 3 seeds",
              table_complete("upfl-data-size")),
    Criterion(3, "upfl-hetero table (lambda in {0, 0.1, 1}) with 3 seeds", table_complete("upfl-hetero")),
    Criterion(4, "UPFL Table 1 MNIST: ODPFL-HN new clients >= paper 95.67 - 2",
              at_least("upfl-table1", "mnist", "ODPFL-HN", 93.67)),
    Criterion(4, "UPFL Table 1 Fashion-MNIST: ODPFL-HN new clients >= paper 85.27 - 2",
              at_least("upfl-table1", "fashion_mnist", "ODPFL-HN", 83.27)),
    *(Criterion(4, f"odpfl-dirichlet Fashion-MNIST Dir({a}): ODPFL-HN >= FedAvg on new clients",
                beats("odpfl-dirichlet", f"fashion_mnist-a{a}", "ODPFL-HN", ("FedAvg",)), ODPFL_NOTES)
      for a in ("0.1", "1")),
    Criterion(4, "odpfl-dp table with 3 seeds", table_complete("odpfl-dp")),
    Criterion(5, "btgfl Fashion-MNIST average: BTFL >= FedTHE and FedAvg+FT (batch 32)",
              beats("btgfl", "fashion_mnist", "BTFL (bs=32)", ("FedTHE (bs=32)", "FedAvg+FT"),
                    fields=({"column": "avg"},)), BTGFL_NOTES),
    Criterion(5, "btgfl Fashion-MNIST average: BTFL at batch 1 and 32 within 0.5",
              within("btgfl", "fashion_mnist", "BTFL (bs=1)", "BTFL (bs=32)", 0.5, column="avg")),
    *(Criterion(6, f"fedicon-shift {ds}: FedICON above FedAvg and TENT under covariate shift (severity 1/3/5)",
                beats("fedicon-shift", ds, "FedICON", ("FedAvg", "TENT"), strict=True, fields=_COVARIATE),
                FEDICON_NOTES)
      for ds in ("mnist", "fashion_mnist")),
    *(Criterion(6, f"fedicon-shift {ds}: FedICON above FedICON w/o TTA under covariate shift (the TTA gain)",
                beats("fedicon-shift", ds, "FedICON", ("FedICON w/o TTA",), strict=True, fields=_COVARIATE),
                FEDICON_NOTES)
      for ds in ("mnist", "fashion_mnist")),
    # the same with a batch-normalised encoder (the papers' kind of CNN), where a TTA gain can come from statistics
    *(Criterion(6, f"fedicon-shift {ds}: FedICON above FedAvg, TENT and FedICON w/o TTA under covariate shift",
                beats("fedicon-shift", ds, "FedICON", ("FedAvg", "TENT", "FedICON w/o TTA"), strict=True,
                      fields=_COVARIATE), FEDICON_NOTES)
      for ds in ("mnist-bn", "fashion_mnist-bn")),
    # MAP = Algorithm 1; MAP (code) = the client procedure of the authors' released code (docs/architecture.md)
    *(Criterion(6, f"map-incomplete {ds}: {method} personalization >= FedAvg and FedPHP",
                beats("map-incomplete", ds, method, ("FedAvg", "FedPHP"), splits=("personalization",)), MAP_NOTES)
      for method in ("MAP", "MAP (code)") for ds in ("fashion_mnist-paper", "fashion_mnist-lenet-paper")),
    *(Criterion(6, f"map-incomplete {ds}: {method} aggregation >= FedAvg",
                beats("map-incomplete", ds, method, ("FedAvg",), splits=("aggregation",)), MAP_NOTES)
      for method in ("MAP", "MAP (code)") for ds in ("fashion_mnist-paper", "fashion_mnist-lenet-paper")),
    *(Criterion(7, f"edge_sdk new-client parity with torch within 0.1 point: {name}", sdk_parity(what))
      for what, name in (("new-client parity SDK vs torch, FedTTA++ mnist", "FedTTA++ MNIST"),
                         ("new-client parity SDK vs torch, FedTTA++ fashion_mnist", "FedTTA++ Fashion-MNIST"),
                         ("new-client parity SDK vs torch, TENT mnist", "TENT MNIST"),
                         ("new-client parity SDK vs torch, TENT fashion_mnist", "TENT Fashion-MNIST"),
                         ("BTFL parity SDK vs torch, btgfl fashion_mnist", "BTFL Fashion-MNIST (btgfl)"))),
    Criterion(52, "unseen-domain, declared safeguard rules: no test cell more than 1 point below the received model",
              safeguard_promise("harm"), "research/results-detail.md#unseen-domain"),
    Criterion(52, "unseen-domain, declared safeguard rules: at least 80% of personalisation's positive gain kept",
              safeguard_promise("gain")),
)


def status_section(results: Results, criteria: Iterable[Criterion] = CRITERIA) -> str:
    """The markdown table of verdicts for docs/RESULTS.md."""
    lines = ["## Reproduction status", "",
             "Each issue's measurable acceptance criteria, checked by `lab/criteria.py` against the "
             f"tables of docs/RESULTS.md (means over seeds; met = holds with {SEEDS} seeds; partial = fewer seeds so far; "
             "the vmap-engine rows of #2 and the device-parity rows of #7 are single runs from "
             "docs/benchmarks/vmap-engine.json and edge-sdk.json). A criterion not met links the page that says why.",
             "", "| issue | criterion | status | measured |", "|---|---|---|---|"]
    for c in criteria:
        v = c.check(results)
        why = f" ([why]({c.diagnosis}))" if c.diagnosis and v.status != "met" else ""
        lines.append(f"| #{c.issue} | {c.text} | {v.status}{why} | {v.measured.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
