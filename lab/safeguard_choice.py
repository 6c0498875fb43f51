"""Choose each method's safeguard rule on the unseen-domain experiment's validation shifts only.

The ``unseen-domain`` raw seed files (``docs/results/raw/unseen-domain/<dataset>/<method>/seed<k>.json``) hold,
for every new client of every condition, the received and personalised accuracy and the label-free evidence of
:func:`edge_sdk.safeguard.evidence`. This module reads the clients of the *validation* conditions only (the
training clients' validation samples under corruptions no test condition uses) and, per method:

1. scores every candidate rule: off, rollback, the disagreement rule at each threshold, and logistic rules of
   "adaptation helped" over the device's evidence (fitted on the other validation conditions: leave one
   condition out, so a fitted rule is never scored on the clients it was fitted on), each both rolling back
   and keeping the two models partially (the mean of their probabilities) where it judges adaptation harmful;
   rules over held-out evidence (adapt on half the set, judge on the other half) are scored for comparison
   but not declarable (the device would adapt twice);
2. keeps the declarable candidates whose worst validation cell (data set x condition, mean over seeds and clients) loses at
   most ``MAX_VAL_LOSS`` points against the received model (a margin under the one-point promise);
3. chooses the one of best mean validation gain (ties: the earlier, simpler candidate), refitting a linear
   rule on every validation client.

The choice is what each method declares (``Algorithm.safeguard``): ``python -m lab.safeguard_choice`` prints
it and writes ``docs/results/safeguard-choice.json``; after the declarations follow it, ``python -m
lab.safeguard_choice --rescore`` scores every raw seed file again with the declared rules (from the clients
stored there, nothing trains again) and rewrites the table and docs/RESULTS.md. The lab's tests check the
declarations against the file. The test conditions are never read by the choice.
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
MAX_VAL_LOSS = 0.5  # points: the worst validation cell a chosen rule may leave below the received model
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


def cross_validated(clients: list[Client], build: Callable[[list[Client]], Any]) -> list[str]:
    """The action per client, each condition's clients decided by a rule built without that condition."""
    actions = [""] * len(clients)
    for held in sorted({c.condition for c in clients}):
        rule = build([c for c in clients if c.condition != held])
        for i, c in enumerate(clients):
            if c.condition == held:
                actions[i] = rule.action(c.evidence)
    return actions


def choose(clients: list[Client], cands: Iterable[Candidate] | None = None) -> tuple[SafeguardRule, list[dict]]:
    """The chosen rule for one method's validation clients, and every candidate's validation scores."""
    table: list[dict[str, Any]] = []
    best: tuple[float, int, str] | None = None
    builders = dict(cands or candidates())
    for order, (name, build) in enumerate(builders.items()):
        gains = cell_gains(clients, cross_validated(clients, build))
        worst, mean = min(gains.values()), float(np.mean(list(gains.values())))
        ok = worst >= -MAX_VAL_LOSS
        table.append({"candidate": name, "val_mean_gain": round(mean, 3), "val_worst_cell": round(worst, 3),
                      "admissible": ok, "declarable": not name.startswith(HOLDOUT)})
        if ok and not name.startswith(HOLDOUT) and (best is None or mean > best[0] + 1e-9):
            best = (mean, order, name)
    name = "rollback" if best is None else best[2]
    for row in table:
        row["chosen"] = row["candidate"] == name
    return _rounded(builders[name](clients)), table


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
    result: dict[str, Any] = {"max_val_loss": MAX_VAL_LOSS, "methods": {}}
    for method, clients in sorted(by_method.items()):
        if all(c.personalised == c.received for c in clients) and method == "FedAvg":
            continue  # FedAvg's device step changes nothing
        rule, table = choose(clients)
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
