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
   clients) loses at most ``MAX_VAL_LOSS`` points against the received model;
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

The choice is what each method declares (``Algorithm.safeguard``): ``python -m lab.safeguard_choice`` prints
it and writes ``docs/results/safeguard-choice.json`` (with the nested check of this criterion and of the
earlier one); after the declarations follow it, ``python -m lab.safeguard_choice --rescore`` scores every raw
seed file again with the declared rules (from the clients stored there, nothing trains again) and rewrites
the table and docs/RESULTS.md. The lab's tests check the declarations against the file. The test conditions
are never read by the choice.
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
LINEAR_MARGINS = (0.0, 1.0, 2.0)  # a fitted rule's score must exceed this margin (standardised units) to adapt
DEVICE_FEATURES = tuple(EVIDENCE)
HOLDOUT_FEATURES = tuple(f"holdout_{n}" for n in EVIDENCE if n != "shift_consistency_change")
HOLDOUT = "holdout+"  # the name prefix of candidates that read held-out evidence (compared, not declarable)


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


def candidates() -> list[Candidate]:
    """(name, build from training clients) in order of preference on ties: the simple rules first, each one
    rolling back and (``+partial``) keeping both models partially where it judges adaptation harmful; then the
    rules over held-out evidence too (``holdout``), compared but never declared (:class:`HeldOutRule`)."""
    out: list[Candidate] = [("off", lambda _clients: SafeguardRule("off"))]
    for partial in (False, True):
        fixed = [SafeguardRule("rollback", partial=partial),
                 *(SafeguardRule("disagreement", threshold=t, partial=partial) for t in THRESHOLDS)]
        out += [(r.name, (lambda rule: lambda _clients: rule)(r)) for r in fixed]
        for margin in LINEAR_MARGINS:
            out.append((f"linear(margin={margin:g})" + ("+partial" if partial else ""),
                        (lambda m, p: lambda cl: fit_linear(cl, DEVICE_FEATURES, m, partial=p))(margin, partial)))
    for margin in LINEAR_MARGINS:
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


def _fitted(name: str) -> bool:
    return name.startswith(("linear", HOLDOUT))


def choose(clients: list[Client], cands: Iterable[Candidate] | None = None, max_loss: float = MAX_VAL_LOSS,
           splits: tuple[str, ...] = tuple(SPLITS), simple_margin: float = SIMPLE_MARGIN
           ) -> tuple[SafeguardRule, list[dict]]:
    """The chosen rule for one method's validation clients, and every candidate's validation scores (see the
    module docstring; the defaults are the declared criterion, :data:`PREVIOUS` the earlier one)."""
    table: list[dict[str, Any]] = []
    builders = dict(cands or candidates())
    best: dict[bool, tuple[float, str]] = {}  # fitted? -> (mean gain, name) of the best admissible declarable
    for name, build in builders.items():
        scored = []
        for split in (splits if _fitted(name) else splits[:1]):  # a fixed rule scores the same on every split
            actions = cross_validated(clients, build, split) if _fitted(name) else \
                [build(clients).action(c.evidence) for c in clients]
            if actions is not None:
                gains = cell_gains(clients, actions)
                scored.append((float(np.mean(list(gains.values()))), min(gains.values())))
        mean, worst = min(m for m, _ in scored), min(w for _, w in scored)
        ok = worst >= -max_loss
        declarable = not name.startswith(HOLDOUT)
        table.append({"candidate": name, "val_mean_gain": round(mean, 3), "val_worst_cell": round(worst, 3),
                      "admissible": ok, "declarable": declarable})
        kind = _fitted(name)
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
    cells, those more than ``loss`` points below the received model, the worst one, and the share of
    personalisation's positive gain over those cells that the chosen rules keep."""
    out: dict[str, Any] = {}
    for split in ("family", "dataset"):
        key, cells = SPLITS[split], []
        for method, clients in sorted(by_method.items()):
            for held in sorted({key(c) for c in clients}):
                rest = [c for c in clients if key(c) != held]
                test = [c for c in clients if key(c) == held]
                rule, _ = choose(rest, **criterion)
                on = cell_gains(test, [rule.action(c.evidence) for c in test])
                off = cell_gains(test, ["personalised"] * len(test))
                cells += [(on[k], off[k], f"{method}/{k[0]}/{k[1]}") for k in on]
        positive = sum(max(0.0, o) for _, o, _ in cells)
        worst = min(cells)
        out[f"hold out one {split}"] = {
            "cells": len(cells), "below": sum(g < -loss for g, _, _ in cells),
            "worst": [round(worst[0], 3), worst[2]],
            "gain_kept": round(sum(max(0.0, g) for g, _, _ in cells) / positive, 3) if positive > 0 else 1.0}
    return out


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
    result: dict[str, Any] = {"max_val_loss": MAX_VAL_LOSS, "simple_margin": SIMPLE_MARGIN,
                              "splits": list(SPLITS), "methods": {},
                              "procedure_check": {"declared": procedure_check(by_method),
                                                  "previous": procedure_check(by_method, **PREVIOUS)}}
    for method, clients in sorted(by_method.items()):
        rule, table = choose(clients)
        result["methods"][method] = {"rule": rule.to_manifest(), "candidates": table,
                                     "val_clients": len(clients)}
        print(f"{method:12s} -> {rule.name:22s} {json.dumps(rule.to_manifest())}")
    for name, check in result["procedure_check"].items():
        print(f"nested check, {name} criterion: {json.dumps(check)}")
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
