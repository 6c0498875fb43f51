"""Choose each method's safeguard rule on the unseen-domain experiment's validation shifts only.

The ``unseen-domain`` raw seed files (``docs/results/raw/unseen-domain/<dataset>/<method>/seed<k>.json``) hold,
for every new client of every condition, the received and personalised accuracy and the label-free evidence of
:func:`edge_sdk.safeguard.evidence`. This module reads the clients of the *validation* conditions only (the
training clients' validation samples under corruptions no test condition uses) and, per method:

1. scores every candidate rule: off, rollback, the disagreement rule at each threshold, and logistic rules of
   "adaptation helped" over the device's evidence, each both rolling back and keeping the two models partially
   (the mean of their probabilities) where it judges adaptation harmful. A fitted rule is scored three times,
   each time on clients it was not fitted on: leave one condition out, leave one corruption type out (both
   severities), leave one data set out (fitted on the other data set's clients only); its mean gain and worst
   cell are the lowest of the three. Rules over held-out evidence (adapt on half the set, judge on the other
   half) are scored for comparison but not declarable (the device would adapt twice);
2. keeps the declarable candidates whose worst validation cell (data set x condition, mean over seeds and
   clients; in the declared ``seed-margin`` criterion that mean minus the standard error of the seeds' means)
   loses at most ``MAX_VAL_LOSS`` points against the received model;
3. declares the admissible fixed-form rule (off, rollback, disagreement, each alone or partial) of best mean
   validation gain, unless an admissible fitted linear rule beats it by more than ``SIMPLE_MARGIN`` points (ties:
   the earlier, simpler candidate); a declared linear rule is refitted on every validation client.

Why this criterion (fixed before the test table was read; issue #52): the test conditions include a shift of
another kind (scikit-learn's digits, a different data set) than the corruptions validation holds. A nested
check on validation alone (:func:`procedure_check`: hold out a whole corruption type, or a whole data set, run
the choice on the rest, score its rule on what was held out) showed the earlier criterion (leave one condition
out, 0.5-point margin, best mean gain) leaving held-out cells more than a point below the received model, all
through fitted linear rules whose evidence weights do not carry over to another data set, while fixed-form
rules chosen with no validation loss did not. Requiring each seed's cell (not just the mean) above -0.5 was
tried in the same exploratory nested check and rejected: ten clients per seed make those cells so noisy that it
kept under 60% of the gain and still left cells of a held-out data set below -1.

The validation pool (issue #52): first the four corruption types of issue #39 (impulse noise, zoom blur, snow,
pixelate); a choice made on them left test cells of shift kinds it never saw more than a point below the received
model, so the pool now holds every implemented corruption no test condition uses (adding shot noise, defocus
blur, glass blur, brightness, elastic transform, JPEG compression; the same severities). Criterion and candidates
stayed as they were: with more kinds of shift, a fixed-form rule's worst validation cell bounds its harm on a kind
it has not seen better. The nested check on the enlarged pool shows the need: holding out brightness, FedTTA's
choice on the other nine types is its earlier rule (disagreement<=0.05, partial), which leaves brightness-5 four
points below the received model (as that rule left the test's contrast-5); held-out data sets still leave
brightness cells below -1 for FedTTA and TENT.

The criterion itself is chosen the same way (issue #52, after the enlarged pool): :data:`VARIANTS` declares a
few criterion variants, each with its rationale, before any of their results was read; :func:`compare_variants`
runs the nested check of every one and :func:`meta_choice`, declared with them, keeps the variant leaving the
fewest held-out validation cells more than a point below the received model (both ways of holding out summed),
ties broken by held-out mean gain, then declaration order. On the ten-type pool it picked ``seed-margin``: 2
held-out cells below -1 (0 holding out a type, 2 holding out a data set) against 5 for the criterion above
without the seed margin, 4 without partial rules, 5 without linear rules or with the disagreement threshold
scored on held-out shifts, 7 with all three restrictions; its price, visible on validation already, is gain:
the held-out rules keep 25% (type held out) and 54% (data set held out) of personalisation's positive gain,
against 96% and 98%. Read only after the choice (``--rescore``): on the test conditions the declared rules
leave none of the 114 cells more than a point below the received model (worst -0.6) but keep 23% of
personalisation's positive gain, short of the 80% issue #52 asks for.

The choice is what each method declares (``Algorithm.safeguard``): ``python -m lab.safeguard_choice`` prints
the nested comparison and the choice and writes ``docs/results/safeguard-choice.json`` (with the nested check of
every variant and of the earlier criterion); after the declarations follow it,
``python -m lab.safeguard_choice --rescore`` scores every raw seed file again with the declared rules (from the
clients stored there, nothing trains again) and rewrites the table and docs/RESULTS.md. The lab's tests check
the declarations against the file. The test conditions are never read by the choice (:func:`load_val_clients`
keeps the ``val/`` conditions only; nothing else reaches :func:`choose`).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.safeguard import EVIDENCE, SafeguardRule

from lab.unseen import THRESHOLDS  # the disagreement rule's thresholds, as the table scores them

RAW = Path("docs/results/raw/unseen-domain")
MAX_VAL_LOSS = 0.0  # points: the worst validation cell a chosen rule may leave below the received model
# points of mean validation gain a fitted linear rule must add over the best admissible fixed-form rule
SIMPLE_MARGIN = 1.0
# the earlier criterion (issue #52's first choice), kept for the nested comparison (:func:`procedure_check`)
PREVIOUS = {"max_loss": 0.5, "splits": ("condition",), "simple_margin": 0.0}
# the criterion variants the nested check chooses among (declared before any of their results was read):
# (name, keyword arguments of :func:`choose`, why it might fail less on a held-out shift)
VARIANTS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("current", {}, "the criterion declared so far (worst validation cell >= 0; fitted rules scored on held-out "
                    "conditions, types and data sets; a linear rule must add 1 point)"),
    ("no-partial", {"partial": False}, "no mixture rules: the mix of two models is not bounded by the better one, "
                                       "and the one failing test cell is a mixture rule"),
    ("fixed-only", {"linear": False}, "no fitted linear rules: their evidence weights did not carry over to "
                                      "another data set in the earlier nested check"),
    ("tuned-threshold", {"tune": True}, "the disagreement threshold is fitted too: scored like a fitted rule, on "
                                        "corruption types and data sets it was not chosen on"),
    ("seed-margin", {"seed_margin": True}, "stricter per-cell bound: a cell's mean minus its standard error over "
                                           "seeds must be >= 0, so a rule at zero by seed noise is not admissible"),
    ("conservative", {"partial": False, "linear": False, "tune": True},
     "the three structural restrictions together: fixed form, no mixture, threshold scored on held-out shifts"),
)
LINEAR_MARGINS = (0.0, 1.0, 2.0)  # a fitted rule's score must exceed this margin (standardised units) to adapt
DEVICE_FEATURES = tuple(EVIDENCE)
HOLDOUT_FEATURES = tuple(f"holdout_{n}" for n in EVIDENCE if n != "shift_consistency_change")
HOLDOUT = "holdout+"  # the name prefix of candidates that read held-out evidence (compared, not declarable)
TUNED = "disagreement(tuned)"  # the disagreement rule whose threshold is fitted (:func:`tune_threshold`)


@dataclass(frozen=True)
class Client:
    dataset: str
    condition: str
    seed: int
    received: float
    personalised: float
    evidence: dict[str, float]
    partial: float = 0.0  # the accuracy of the mix of both models (the "partial" decision)

    def accuracy(self, action: str) -> float:
        return {"received": self.received, "personalised": self.personalised, "partial": self.partial}[action]


def load_val_clients(raw: Path = RAW) -> dict[str, list[Client]]:
    """Every validation client per method (the ``val/`` conditions of the raw seed files; nothing else)."""
    out: dict[str, list[Client]] = {}
    for path in sorted(raw.glob("*/*/seed*.json")):
        record = json.loads(path.read_text())
        for key, clients in record["clients"].items():
            split, condition = key.split("/", 1)
            if split != "val":
                continue
            out.setdefault(record["method"], []).extend(
                Client(path.parts[-3], condition, record["seed"], c["received"], c["personalised"], c["evidence"],
                       c["ensemble"])
                for c in clients)
    return out


def cell_gains(clients: list[Client], actions: list[str]) -> dict[tuple[str, str], float]:
    """Safeguarded minus received accuracy in points per (data set, condition), mean over seeds and clients."""
    gains: dict[tuple[str, str], list[float]] = {}
    for c, action in zip(clients, actions):
        gains.setdefault((c.dataset, c.condition), []).append(100 * (c.accuracy(action) - c.received))
    return {k: float(np.mean(v)) for k, v in gains.items()}


def cell_floors(clients: list[Client], actions: list[str], seed_margin: bool = False,
                gains: dict[tuple[str, str], float] | None = None) -> dict[tuple[str, str], float]:
    """The per-cell score a rule's worst cell is judged on: :func:`cell_gains` (``gains`` where the caller has them
    already), or with ``seed_margin`` the cell's mean over seeds minus its standard error over seeds (each seed's
    gain a mean over its clients)."""
    if not seed_margin:
        return gains if gains is not None else cell_gains(clients, actions)
    per_seed: dict[tuple[str, str], dict[int, list[float]]] = {}
    for c, action in zip(clients, actions):
        per_seed.setdefault((c.dataset, c.condition), {}).setdefault(c.seed, []).append(
            100 * (c.accuracy(action) - c.received))
    out = {}
    for k, seeds in per_seed.items():
        means = np.array([np.mean(v) for v in seeds.values()])
        out[k] = float(means.mean() - (means.std(ddof=1) / np.sqrt(len(means)) if len(means) > 1 else 0.0))
    return out


def tune_threshold(clients: list[Client], partial: bool, max_loss: float = MAX_VAL_LOSS,
                   seed_margin: bool = False) -> SafeguardRule:
    """The disagreement rule of best mean gain over ``clients`` among those of every threshold whose worst cell
    (:func:`cell_floors`) loses at most ``max_loss`` points (ties: the lower threshold); rollback if none does."""
    best: tuple[float, SafeguardRule] = (-np.inf, SafeguardRule("rollback"))
    for t in THRESHOLDS:
        rule = SafeguardRule("disagreement", threshold=t, partial=partial)
        actions = [rule.action(c.evidence) for c in clients]
        gains = cell_gains(clients, actions)
        gain = float(np.mean(list(gains.values())))
        if min(cell_floors(clients, actions, seed_margin, gains).values()) >= -max_loss and gain > best[0] + 1e-9:
            best = (gain, rule)
    return best[1]


def fit_linear(clients: list[Client], features: tuple[str, ...], margin: float = 0.0, l2: float = 1.0,
               partial: bool = False) -> SafeguardRule | HeldOutRule:
    """A logistic model of "the personalised model beat the received one" over ``features``, each client
    weighted by how much it gained or lost (ties carry no weight), L2-regularised on standardised features;
    returned as a ``"linear"`` rule in raw units whose score must exceed ``margin`` standardised units."""
    x = np.array([[c.evidence[f] for f in features] for c in clients], dtype=np.float64)
    gain = np.array([c.personalised - c.received for c in clients])
    mean, std = x.mean(0), x.std(0) + 1e-9
    z = np.hstack([(x - mean) / std, np.ones((len(x), 1))])
    y, w = (gain > 0).astype(np.float64), np.abs(gain)
    if w.sum() == 0:  # nothing gained or lost anywhere: never adapt
        return SafeguardRule("rollback", partial=partial)
    w = w / w.mean()
    beta = np.zeros(z.shape[1])
    reg = np.full(z.shape[1], l2)
    reg[-1] = 0.0  # the intercept is not shrunk
    for _ in range(50):  # Newton steps on the weighted, regularised log-likelihood
        p = 1 / (1 + np.exp(-np.clip(z @ beta, -30, 30)))
        grad = z.T @ (w * (p - y)) + reg * beta
        hess = (z * (w * p * (1 - p))[:, None]).T @ z + np.diag(reg + 1e-9)
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.abs(step).max() < 1e-10:
            break
    coef = beta[:-1] / std
    bias = float(beta[-1] - (beta[:-1] * mean / std).sum() - margin)
    weights = {f: float(v) for f, v in zip(features, coef)}
    if set(features) <= set(EVIDENCE):
        return SafeguardRule("linear", weights=weights, bias=bias, partial=partial)
    return HeldOutRule(weights, bias, partial)


@dataclass(frozen=True)
class HeldOutRule:
    """A linear rule over held-out evidence too (``holdout_*``: the model adapted on every other sample, judged
    on the rest). Compared on validation, never declared: the device would adapt twice, and the SDK does not
    compute that evidence."""

    weights: dict[str, float]
    bias: float
    partial: bool = False

    def action(self, ev: dict[str, float]) -> str:
        if self.bias + sum(w * ev[k] for k, w in self.weights.items()) > 0:
            return "personalised"
        return "partial" if self.partial else "received"


Candidate = tuple[str, Callable[[list[Client]], Any]]  # builds a SafeguardRule (or a HeldOutRule)


def candidates(partial: bool = True, linear: bool = True, tune: bool = False, max_loss: float = MAX_VAL_LOSS,
               seed_margin: bool = False, compare: bool = True) -> list[Candidate]:
    """(name, build from training clients) in order of preference on ties: the simple rules first, each one
    rolling back and (``+partial``, if ``partial``) keeping both models partially where it judges adaptation
    harmful; with ``tune`` the disagreement rules are one candidate whose threshold is chosen on the clients it is
    built from (:func:`tune_threshold`, ``disagreement(tuned)``); the linear rules if ``linear``; then, if
    ``compare``, the rules over held-out evidence too (``holdout``), never declared (:class:`HeldOutRule`)."""
    out: list[Candidate] = [("off", lambda _clients: SafeguardRule("off"))]
    for part in (False, True) if partial else (False,):
        fixed = [SafeguardRule("rollback", partial=part),
                 *(() if tune else (SafeguardRule("disagreement", threshold=t, partial=part) for t in THRESHOLDS))]
        out += [(r.name, (lambda rule: lambda _clients: rule)(r)) for r in fixed]
        if tune:
            out.append((TUNED + ("+partial" if part else ""),
                        (lambda p: lambda cl: tune_threshold(cl, p, max_loss, seed_margin))(part)))
        for margin in LINEAR_MARGINS if linear else ():
            out.append((f"linear(margin={margin:g})" + ("+partial" if part else ""),
                        (lambda m, p: lambda cl: fit_linear(cl, DEVICE_FEATURES, m, partial=p))(margin, part)))
    for margin in LINEAR_MARGINS if compare else ():
        out.append((f"{HOLDOUT}linear(margin={margin:g})",
                    (lambda m: lambda cl: fit_linear(cl, DEVICE_FEATURES + HOLDOUT_FEATURES, m))(margin)))
    return out


def family(c: Client) -> str:
    """The corruption type of a client's condition (``snow-5`` -> ``snow``): both severities held out together."""
    return c.condition.rsplit("-", 1)[0]


# how a fitted rule is kept off the clients it is scored on: the group held out per fold
SPLITS: dict[str, Callable[[Client], str]] = {"condition": lambda c: c.condition, "family": family,
                                              "dataset": lambda c: c.dataset}


def cross_validated(clients: list[Client], build: Callable[[list[Client]], Any],
                    split: str = "condition") -> list[str] | None:
    """The action per client, each group of ``split`` (:data:`SPLITS`) decided by a rule built without it;
    None where the clients form a single group (nothing to fit on)."""
    key = SPLITS[split]
    groups = sorted({key(c) for c in clients})
    if len(groups) < 2:
        return None
    actions = [""] * len(clients)
    for held in groups:
        rule = build([c for c in clients if key(c) != held])
        for i, c in enumerate(clients):
            if key(c) == held:
                actions[i] = rule.action(c.evidence)
    return actions


def _linear(name: str) -> bool:
    return name.startswith(("linear", HOLDOUT))


def _fitted(name: str) -> bool:
    return _linear(name) or name.startswith(TUNED)


def choose(clients: list[Client], cands: Iterable[Candidate] | None = None, max_loss: float = MAX_VAL_LOSS,
           splits: tuple[str, ...] = tuple(SPLITS), simple_margin: float = SIMPLE_MARGIN, partial: bool = True,
           linear: bool = True, tune: bool = False, seed_margin: bool = False, compare: bool = True
           ) -> tuple[SafeguardRule, list[dict]]:
    """The chosen rule for one method's validation clients, and every candidate's validation scores (see the
    module docstring; the defaults are the ``current`` criterion of :data:`VARIANTS`, whose other keyword
    arguments are the other variants; :data:`PREVIOUS` is the earlier one)."""
    table: list[dict[str, Any]] = []
    builders = dict(cands or candidates(partial, linear, tune, max_loss, seed_margin, compare))
    best: dict[bool, tuple[float, str]] = {}  # linear? -> (mean gain, name) of the best admissible declarable
    for name, build in builders.items():
        scored = []
        for split in (splits if _fitted(name) else splits[:1]):  # a fixed rule scores the same on every split
            actions = cross_validated(clients, build, split) if _fitted(name) else \
                [build(clients).action(c.evidence) for c in clients]
            if actions is not None:
                gains = cell_gains(clients, actions)
                scored.append((float(np.mean(list(gains.values()))),
                               min(cell_floors(clients, actions, seed_margin, gains).values())))
        mean, worst = min(m for m, _ in scored), min(w for _, w in scored)
        ok = worst >= -max_loss
        declarable = not name.startswith(HOLDOUT)
        table.append({"candidate": name, "val_mean_gain": round(mean, 3), "val_worst_cell": round(worst, 3),
                      "admissible": ok, "declarable": declarable})
        kind = _linear(name)
        if ok and declarable and (kind not in best or mean > best[kind][0] + 1e-9):
            best[kind] = (mean, name)
    fixed = best.get(False, (0.0, "rollback"))
    name = best[True][1] if True in best and best[True][0] > fixed[0] + simple_margin else fixed[1]
    for row in table:
        row["chosen"] = row["candidate"] == name
    return _rounded(builders[name](clients)), table


def procedure_check(by_method: dict[str, list[Client]], loss: float = 1.0, **criterion: Any) -> dict[str, Any]:
    """The choice itself scored on validation shifts it did not see: per method, hold out one corruption type
    (both severities, both data sets) or one data set, :func:`choose` on the rest (``criterion``: its keyword
    arguments), and score the chosen rule, fitted on the rest, on the held-out cells. Per way of holding out: the
    cells, those more than ``loss`` points below the received model, the worst one, their mean gain and the share
    of personalisation's positive gain over those cells that the chosen rules keep."""
    out: dict[str, Any] = {}
    for split in ("family", "dataset"):
        key, cells = SPLITS[split], []
        for method, clients in sorted(by_method.items()):
            for held in sorted({key(c) for c in clients}):
                rest = [c for c in clients if key(c) != held]
                test = [c for c in clients if key(c) == held]
                rule, _ = choose(rest, **criterion, compare=False)  # the compared-only rules cannot be chosen
                on = cell_gains(test, [rule.action(c.evidence) for c in test])
                off = cell_gains(test, ["personalised"] * len(test))
                cells += [(on[k], off[k], f"{method}/{k[0]}/{k[1]}") for k in on]
        positive = sum(max(0.0, o) for _, o, _ in cells)
        worst = min(cells)
        out[f"hold out one {split}"] = {
            "cells": len(cells), "below": sum(g < -loss for g, _, _ in cells),
            "worst": [round(worst[0], 3), worst[2]], "mean_gain": round(float(np.mean([g for g, _, _ in cells])), 3),
            "gain_kept": round(sum(max(0.0, g) for g, _, _ in cells) / positive, 3) if positive > 0 else 1.0}
    return out


def meta_choice(rows: list[dict[str, Any]]) -> str:
    """The winning variant of a nested comparison (rows in declaration order, each with ``variant``, ``below``:
    held-out validation cells more than a point below the received model summed over both ways of holding out,
    and ``mean_gain``: their mean held-out gain): the fewest cells below, then the best mean gain, then the
    earlier (simpler) variant."""
    return min(enumerate(rows), key=lambda ir: (ir[1]["below"], -ir[1]["mean_gain"], ir[0]))[1]["variant"]


def compare_variants(by_method: dict[str, list[Client]],
                     variants: tuple[tuple[str, dict[str, Any], str], ...] = VARIANTS) -> list[dict[str, Any]]:
    """The nested check (:func:`procedure_check`) of every criterion variant, in declaration order: per variant
    the check of each way of holding out, and the summed ``below`` and cell-weighted ``mean_gain``
    :func:`meta_choice` ranks on."""
    rows = []
    for name, criterion, why in variants:
        check = procedure_check(by_method, **criterion)
        cells = sum(c["cells"] for c in check.values())
        rows.append({"variant": name, "criterion": criterion, "why": why, "check": check,
                     "below": sum(c["below"] for c in check.values()),
                     "mean_gain": round(sum(c["mean_gain"] * c["cells"] for c in check.values()) / cells, 3)})
    return rows


def _rounded(rule: SafeguardRule) -> SafeguardRule:
    """A fitted rule with its coefficients at 6 significant digits (what a method declares, written by hand)."""
    if rule.kind != "linear":
        return rule
    r6 = lambda v: float(f"{v:.6g}")  # noqa: E731
    return SafeguardRule("linear", weights={k: r6(v) for k, v in rule.weights.items()}, bias=r6(rule.bias),
                         partial=rule.partial)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.safeguard_choice", description=__doc__.split("\n\n")[0])
    ap.add_argument("--raw", default=str(RAW))
    ap.add_argument("--out", default="docs/results/safeguard-choice.json")
    ap.add_argument("--rescore", action="store_true",
                    help="score the raw seed files again with the methods' declared rules, rewrite the table and "
                         "docs/RESULTS.md (after the declarations follow the choice)")
    args = ap.parse_args(argv)
    if args.rescore:
        return rescore_all(Path(args.raw))
    by_method = load_val_clients(Path(args.raw))
    by_method.pop("FedAvg", None)  # FedAvg's device step changes nothing
    rows = compare_variants(by_method)
    winner = meta_choice(rows)
    for r in rows:
        print(f"nested check, {r['variant']:16s} below -1: {r['below']:2d}  held-out mean gain {r['mean_gain']:+.3f}  "
              + "  ".join(f"{how.removeprefix('hold out one ')}: {c['below']} below, worst {c['worst'][0]:+.2f} "
                          f"({c['worst'][1]}), kept {100 * c['gain_kept']:.0f}%" for how, c in r["check"].items()))
    print(f"criterion -> {winner}")
    criterion = dict(next(r["criterion"] for r in rows if r["variant"] == winner))
    result: dict[str, Any] = {"criterion": winner, "max_val_loss": MAX_VAL_LOSS, "simple_margin": SIMPLE_MARGIN,
                              "splits": list(SPLITS), "variants": rows, "methods": {},
                              "procedure_check": {**{r["variant"]: r["check"] for r in rows},
                                                  "previous": procedure_check(by_method, **PREVIOUS)}}
    for method, clients in sorted(by_method.items()):
        rule, table = choose(clients, **criterion)
        result["methods"][method] = {"rule": rule.to_manifest(), "candidates": table,
                                     "val_clients": len(clients)}
        print(f"{method:12s} -> {rule.name:22s} {json.dumps(rule.to_manifest())}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def rescore_all(raw: Path = RAW) -> int:
    """Every raw unseen-domain seed file scored again (:func:`lab.unseen.rescore`), then the table and report."""
    from lab.experiments import get_experiment
    from lab.report import write_report
    from lab.rows import write_atomic
    from lab.runner import aggregate_experiment
    from lab.unseen import rescore

    exp = get_experiment("unseen-domain")
    for path in sorted(raw.glob("*/*/seed*.json")):
        record = json.loads(path.read_text())
        severities = tuple(exp.protocols[path.parts[-3]].options.get("severities", (3, 5)))
        write_atomic(path, json.dumps(rescore(record, severities), indent=1))
    aggregate_experiment(exp, raw.parent.parent)
    print(f"wrote {write_report(raw.parent.parent.parent)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
