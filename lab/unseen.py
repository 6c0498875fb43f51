"""The ``unseen-domain`` protocol: new clients from a domain the federation never saw (issue #39).

Training: the federation trains on the *train* split of MNIST (or Fashion-MNIST), a CPU-sized version of
UPFL's pathological protocol (``Protocol`` fields; the model of best training-client validation accuracy is
the one a new client receives). New clients: two classes each, ``per_client`` samples (UPFL's new clients),
``clients`` per condition, drawn from
- ``split="test"``: the official *test* split, clean (in-domain reference) and under each of
  ``test_corruptions`` at each severity in ``severities`` (rows ``covariate-s<k>`` average the corruptions),
  and, for MNIST, scikit-learn's 8x8 digits upsampled to 28x28 (``digits``);
- ``split="val"``: the training clients' validation samples (never trained on) under ``val_corruptions`` and
  ``val_corruptions_added`` (types no test condition uses; the second list, issue #52, is drawn after the test
  conditions, so that every other condition's clients stay the draws they were) -- the only numbers the
  safeguard's rule is chosen on.
For every client: the received model's accuracy, the personalised accuracy (the method's test-time step on the
client's unlabeled set, then prediction on it), the safeguarded accuracy (edge_sdk.safeguard: each method's
declared rule, and every rule of :func:`candidate_rules`, decides from label-free evidence to keep the
personalised model, roll back to the received one or mix the two), and whether personalisation (or the
safeguarded choice) made the client worse than the received model.
Methods share trainings: TENT evaluates the FedAvg run (the run folder of the training method is reused).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from edge_sdk.safeguard import SafeguardRule, evidence, mix, shifted
from fl_server.algorithms import build_algorithm
from fl_server.data import load_dataset
from fl_server.data.corruptions import corrupt
from fl_server.data.domains import two_class_clients, upsampled_digits
from fl_server.data.federated import FederatedData

if TYPE_CHECKING:
    from lab.protocol import Protocol

# display name -> training method (the run whose received model the method personalises)
UNSEEN_METHODS: dict[str, str] = {"FedAvg": "FedAvg", "TENT": "FedAvg", "FedTTA": "FedTTA",
                                  "FedTTA-Prox": "FedTTA-Prox", "FedTTA++": "FedTTA++", "ODPFL-HN": "ODPFL-HN",
                                  "FedICON": "FedICON"}
# the methods whose device step changes the received model (the safeguard's candidates)
PERSONALISING: tuple[str, ...] = tuple(m for m in UNSEEN_METHODS if m != "FedAvg")
# safeguard thresholds scored on the validation conditions (1.0: never keeps the received model = off)
THRESHOLDS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7)
Condition = tuple[str, str, list[np.ndarray], list[np.ndarray]]  # split, shift, per-client x, per-client y


def conditions(protocol: "Protocol", fed: FederatedData, seed: int, data_root: str | None) -> list[Condition]:
    """Every evaluation condition's new clients (see the module docstring)."""
    opt = protocol.options
    n, size = opt.get("clients", 10), opt.get("per_client", 100)
    out: list[Condition] = []

    def add(split: str, shift: str, x: np.ndarray, y: np.ndarray, key: int, corruption: str | None = None,
            severity: int = 0) -> None:
        parts = two_class_clients(y, n, size, np.random.default_rng([seed, 0x39, key]))
        xs = [x[p] for p in parts]
        if corruption is not None:  # corrupt only the clients' samples; one seeded stream per condition
            rng = np.random.default_rng([seed, 0xC0, key])
            xs = [corrupt(xi, corruption, severity, rng) for xi in xs]
        out.append((split, shift, xs, [y[p] for p in parts]))

    val_idx = np.concatenate(fed.val)
    xv, yv = fed.dataset.x[val_idx], fed.dataset.y[val_idx]
    for name in opt.get("val_corruptions", ()):
        for sev in opt.get("severities", (3, 5)):
            add("val", f"{name}-{sev}", xv, yv, len(out), name, sev)
    test = load_dataset(protocol.dataset, root=data_root, split="test")
    add("test", "clean", test.x, test.y, len(out))
    for name in opt.get("test_corruptions", ()):
        for sev in opt.get("severities", (3, 5)):
            add("test", f"{name}-{sev}", test.x, test.y, len(out), name, sev)
    if protocol.dataset == "mnist" and opt.get("digits", True):
        digits = upsampled_digits(tuple(fed.dataset.x.shape[2:]))  # type: ignore[arg-type]
        add("test", "digits", digits.x, digits.y, len(out))
    for name in opt.get("val_corruptions_added", ()):  # after the test conditions: earlier draws stay the same
        for sev in opt.get("severities", (3, 5)):
            add("val", f"{name}-{sev}", xv, yv, len(out), name, sev)
    return out


def client_outcomes(algo: Any, state: dict, x: np.ndarray, y: np.ndarray, device: torch.device,
                    dtype: torch.dtype) -> dict[str, Any]:
    """One new client: received, personalised and ensemble (mean of the two models' probabilities) accuracy, and
    the label-free evidence a safeguard can decide on (:func:`edge_sdk.safeguard.evidence`, with the one-pixel
    shift): on the whole set, and ``holdout_*`` with the model adapted on every other sample judged on the rest."""
    def logits(params: Any, inputs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return algo.predict(params, torch.from_numpy(inputs).to(device, dtype)).cpu().double().numpy()

    xs = shifted(x)
    received, received_s = logits(state["params"], x), logits(state["params"], xs)
    adapted_params = algo.personalize(state, torch.from_numpy(x).to(device, dtype))
    adapted, adapted_s = logits(adapted_params, x), logits(adapted_params, xs)
    ev = evidence(received, adapted, received_s, adapted_s)
    half_params = algo.personalize(state, torch.from_numpy(x[0::2]).to(device, dtype))  # adapt on one half ...
    held = evidence(received[1::2], logits(half_params, x[1::2]))  # ... judge on the other
    ev.update({f"holdout_{k}": v for k, v in held.items()})
    return {"received": float((received.argmax(-1) == y).mean()),
            "personalised": float((adapted.argmax(-1) == y).mean()),
            "ensemble": float((mix(received, adapted).argmax(-1) == y).mean()), "evidence": ev}


def candidate_rules() -> dict[str, SafeguardRule]:
    """The rules of fixed form every condition is scored with (name -> rule): off, rollback (alone and partial:
    always the mix of both models) and the disagreement rule at each of ``THRESHOLDS``; the methods' declared
    rules are scored beside them (:func:`score`)."""
    rules = [SafeguardRule("off"), SafeguardRule("rollback"), SafeguardRule("rollback", partial=True),
             *(SafeguardRule("disagreement", threshold=t) for t in THRESHOLDS)]
    return {r.name: r for r in rules}


def client_accuracy(client: dict[str, Any], action: str) -> float:
    """A client's accuracy after the safeguard's ``action``: the received, personalised or mixed model's."""
    return client["ensemble" if action == "partial" else action]


def summarise(clients: list[dict[str, Any]], rule: SafeguardRule) -> dict[str, float]:
    """Percentages over a condition's clients: received, personalised and safeguarded accuracy (``rule``), the
    share of clients each of the last two leaves below the received model, and the share the rule did not leave
    on the personalised model (``kept``: rolled back or partially kept)."""
    rec = np.array([c["received"] for c in clients])
    per = np.array([c["personalised"] for c in clients])
    actions = [rule.action(c["evidence"]) for c in clients]
    kept = np.array([a != "personalised" for a in actions])
    safe = np.array([client_accuracy(c, a) for c, a in zip(clients, actions)])
    tol = 1e-9
    return {"received": 100 * rec.mean(), "personalised": 100 * per.mean(), "safeguard": 100 * safe.mean(),
            "worse": 100 * np.mean(per < rec - tol), "safeguard_worse": 100 * np.mean(safe < rec - tol),
            "kept": 100 * kept.mean()}


def run_unseen_seed(protocol: "Protocol", method: str, seed: int, run_dir: Path | None, device: str = "auto",
                    mode: str = "auto", progress: bool = True, data_root: str | None = None,
                    fed: FederatedData | None = None) -> dict[str, Any]:
    """Train (or reuse) the method's training run, then evaluate every new-client condition."""
    from lab.runner import build_federated, build_simulation, safe_name, seed_record

    if method not in UNSEEN_METHODS:
        raise ValueError(f"unseen-domain has no method {method!r}; choose one of {', '.join(UNSEEN_METHODS)}")
    train_name = UNSEEN_METHODS[method]
    fed = fed if fed is not None else build_federated(protocol, seed, data_root)
    train_dir = None if run_dir is None else run_dir.parent.parent / safe_name(train_name) / run_dir.name
    sim = build_simulation(protocol, train_name, seed, train_dir, device, mode, progress, data_root, fed)
    record = seed_record(protocol, train_name, seed, sim, sim.run())
    t0 = time.perf_counter()
    state = sim.best_state if sim.best_state is not None else sim.server_state
    algo = sim.algorithm if train_name == method else build_algorithm(
        method, sim.algorithm.model, fed.num_train_clients, seed=seed, **protocol.method_hp.get(method, {}))
    per_condition = {f"{split}/{shift}": [client_outcomes(algo, state, xi, yi, sim.device, sim.dtype)
                                          for xi, yi in zip(xs, ys)]
                     for split, shift, xs, ys in conditions(protocol, fed, seed, data_root)}
    results = score(per_condition, protocol.options.get("severities", (3, 5)), declared_rule(method))
    return {**record, "method": method, "trained_as": train_name, "results": results,
            "clients": per_condition,
            "wall_s": round(record["wall_s"] + time.perf_counter() - t0, 2)}


def declared_rule(method: str) -> SafeguardRule | None:
    """The safeguard rule the method's class declares (``Algorithm.safeguard``, what its bundles carry), if any."""
    from fl_server.algorithms import ALGORITHMS

    spec = ALGORITHMS[method].safeguard
    return None if spec is None else SafeguardRule.from_manifest(spec)


def rescore(record: dict[str, Any], severities: tuple[int, ...] = (3, 5)) -> dict[str, Any]:
    """A raw seed record with its ``results`` scored again from its stored per-client outcomes (after a method's
    declared rule changed; no training or adaptation runs again)."""
    return {**record, "results": score(record["clients"], severities, declared_rule(record["method"]))}


def score(per_condition: dict[str, list[dict[str, Any]]], severities: tuple[int, ...],
          declared: SafeguardRule | None = None) -> list[dict[str, Any]]:
    """Result entries from each condition's per-client outcomes (keys "split/shift"): the rule-free measures
    (received, personalised, worse; ``rule`` None) and, for every rule of :func:`candidate_rules` and the
    method's ``declared`` rule (``rule`` "declared"), the safeguarded ones (safeguard, safeguard_worse, kept),
    then the condition means (:func:`_add_means`)."""
    rules = {**candidate_rules(), **({} if declared is None else {"declared": declared})}
    results: list[dict[str, Any]] = []
    for key, clients in per_condition.items():
        split, shift = key.split("/", 1)
        free = summarise(clients, SafeguardRule("off"))
        results += [{"split": split, "shift": shift, "measure": m, "rule": None, "value": free[m]}
                    for m in ("received", "personalised", "worse")]
        for name, rule in rules.items():
            guarded = summarise(clients, rule)
            results += [{"split": split, "shift": shift, "measure": m, "rule": name, "value": guarded[m]}
                        for m in ("safeguard", "safeguard_worse", "kept")]
    _add_means(results, severities)
    return results


def _add_means(results: list[dict[str, Any]], severities: tuple[int, ...]) -> None:
    """``covariate-s<k>`` test rows (mean over the corruptions at severity k) and ``val-mean`` rows (mean over
    every validation condition), per measure and threshold."""
    groups: dict[tuple[str, str, str, str | None], list[float]] = {}
    for r in results:
        if r["split"] == "val":
            groups.setdefault(("val", "val-mean", r["measure"], r["rule"]), []).append(r["value"])
        elif r["shift"] not in ("clean", "digits"):
            sev = r["shift"].rsplit("-", 1)[1]
            if int(sev) in severities:
                groups.setdefault(("test", f"covariate-s{sev}", r["measure"], r["rule"]), []).append(r["value"])
    results += [{"split": k[0], "shift": k[1], "measure": k[2], "rule": k[3], "value": float(np.mean(v))}
                for k, v in groups.items()]
