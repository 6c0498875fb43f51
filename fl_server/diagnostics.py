"""Warnings about a trained run that look fine in its numbers but are not: weights that became NaN or infinite
(training diverged), new-client predictions collapsed to one class, or an accuracy at chance.
:func:`nonfinite_warning` and :func:`collapse_warning` are the rules (one line or None); the train summary
(``fl-server train``, :func:`fl_server.recipes.train`'s record and ``run.json``), the coordinator's job status
and ``fl-server export`` show them, and export refuses a best state with non-finite weights
(:func:`nonfinite_weights`).

>>> collapse_warning([0, 0, 97, 3], num_classes=4, accuracy=0.26)
'warning: new-client predictions collapsed to one class (class 2 takes 97% of them; accuracy 26.0%, chance 25.0%): the model learnt no classifier; lower the learning rate or check the labels, and do not ship this bundle'
>>> collapse_warning([30, 25, 25, 20], num_classes=4, accuracy=0.9) is None
True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from fl_server import rundir
from fl_server.algorithms.base import NotApplicable

if TYPE_CHECKING:
    from fl_server.engine import Simulation

NONFINITE_FIX = "lower the learning rate or clip the gradients (hyper clip_norm)"


def scored_model(test_of: str | None, safeguard: str | None, method: str,
                 labeled: float | None = None) -> str | None:
    """Whose model a run's new-client ``test`` scores where it is not each device's personalised one (the record's
    ``test_of`` and ``safeguard``, :func:`fl_server.recipes.train`), in the words the train summary and the
    dashboard both print; None where it is each device's. ``labeled``: a device's accuracy after its labeled
    personalisation, where measured (a coordinator's job: ``labeled_device_accuracy``).

    >>> scored_model("device", "rollback", "FedTTA++")
    "the received model: FedTTA++'s safeguard rule 'rollback' keeps it on every device; edge_sdk.open_bundle(..., safeguard=False) personalises"
    >>> scored_model("device", "disagreement<=0.5", "TENT") is None
    True
    """
    if test_of == "received":
        device = ("fl-server export measures a device's" if labeled is None else
                  f"a device after it: {100 * labeled:.1f}% (learning on a labeled random half of each new client, "
                  "scored on the other)")
        return f"the received model, before each device's labeled personalisation; {device}"
    if safeguard == "rollback":
        return (f"the received model: {method}'s safeguard rule 'rollback' keeps it on every device; "
                "edge_sdk.open_bundle(..., safeguard=False) personalises")
    return None


def nonfinite_weights(state: dict[str, Any]) -> list[str]:
    """The tensors of ``state`` (nested dicts of tensors or arrays, e.g. a run's best state) holding a NaN or an
    infinity, by their ``group/name`` paths."""
    found = []
    for name, value in state.items():
        if isinstance(value, dict):
            found += [f"{name}/{inner}" for inner in nonfinite_weights(value)]
        elif isinstance(value, (torch.Tensor, np.ndarray)):
            tensor = torch.as_tensor(value)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                found.append(name)
    return found


def describe_nonfinite(names: Sequence[str]) -> str:
    """``NaN or inf in params/head.weight and 3 more tensors``: which weights of a state are not finite."""
    more = f" and {len(names) - 1} more tensor{'s' if len(names) > 2 else ''}" if len(names) > 1 else ""
    return f"NaN or inf in {names[0]}{more}"


def nonfinite_warning(state: dict[str, Any]) -> str | None:
    """One line when ``state`` (the run's best state, what a bundle ships) holds a NaN or an infinity, else None.

    >>> nonfinite_warning({"params": {"head.weight": torch.tensor([1.0, float("nan")])}})
    "warning: the run's weights are not finite (NaN or inf in params/head.weight): training diverged and its accuracies mean nothing; lower the learning rate or clip the gradients (hyper clip_norm), and do not ship this bundle (fl-server export refuses it)"
    """
    names = nonfinite_weights(state)
    if not names:
        return None
    return (f"warning: the run's weights are not finite ({describe_nonfinite(names)}): training diverged and its "
            f"accuracies mean nothing; {NONFINITE_FIX}, and do not ship this bundle (fl-server export refuses it)")


ONE_CLASS_SHARE = 0.9  # more of the predictions than this in one class: collapsed
OVER_LABEL_SHARE = 0.05  # ... and that class's share of the labels is lower by more than this
CHANCE_MARGIN = 0.05  # accuracy at most 1/C + this: chance
FEW_CLIENTS = 5  # fewer new clients than this: their mean may sit at chance by the draw of which clients are new


# a method whose devices personalise on labeled data (Algorithm.device_labels): what training scores is the model
# a device receives, before that
RECEIVED_SUBJECT = "the received model's (before each device's labeled personalisation) new-client"


def collapse_warning(counts: Sequence[int] | np.ndarray, num_classes: int, accuracy: float | None = None,
                     labels: Sequence[int] | np.ndarray | None = None, subject: str = "new-client",
                     validation: float | None = None, clients: int | None = None) -> str | None:
    """One line when the new clients' predictions collapsed, else None (``subject``: whose predictions, as the
    line names them). ``validation`` (the run's best validation accuracy) and ``clients`` (how many new clients):
    an accuracy at chance where validation is well above it says the new clients differ, not that the model
    learnt nothing.

    ``counts``: how many of the new clients' samples were predicted as each class; ``accuracy``: their mean
    accuracy in [0, 1] (None: not checked); ``labels``: how many samples of each class they hold (None: not
    known).

    Thresholds. *One class*: more than 90% of the predictions (:data:`ONE_CLASS_SHARE`) in one class is a model
    that ignores its input: with C >= 2 balanced classes no working classifier comes near that, and a run that
    collapsed (FedICON's encoder, every sample mapped to one point) sits at ~100%. When the labels are known the
    class must also take 5 points more than its share of the labels (:data:`OVER_LABEL_SHARE`), so data where one
    class really is 90% of the samples does not warn. *Chance*: an accuracy within 5 points of 1/C
    (:data:`CHANCE_MARGIN`; 15% for 10 classes, 55% for 2) is what guessing gives: the model learnt (almost)
    nothing. Both are checked on the pooled predictions of all new clients."""
    pred = np.asarray(counts, dtype=np.float64)
    total = pred.sum()
    if total <= 0 or num_classes < 2:
        return None
    top = int(pred.argmax())
    share = pred[top] / total
    label_share = 0.0
    if labels is not None and np.asarray(labels).sum() > 0:
        label_counts = np.asarray(labels, dtype=np.float64)
        label_share = float(label_counts[top] / label_counts.sum()) if top < len(label_counts) else 0.0
    chance = 1 / num_classes
    acc = "" if accuracy is None else f"accuracy {100 * accuracy:.1f}%, "
    if share > ONE_CLASS_SHARE and share > label_share + OVER_LABEL_SHARE:
        return (f"warning: {subject} predictions collapsed to one class (class {top} takes {100 * share:.0f}% of "
                f"them; {acc}chance {100 * chance:.1f}%): the model learnt no classifier; lower the learning rate "
                f"or check the labels, and do not ship this bundle")
    if accuracy is not None and accuracy <= chance + CHANCE_MARGIN:
        at_chance = (f"{subject} accuracy {100 * accuracy:.1f}% is at chance ({100 * chance:.1f}% for {num_classes} "
                     "classes)")
        if validation is not None and validation > chance + 2 * CHANCE_MARGIN:
            few = "" if clients is None or clients >= FEW_CLIENTS else f", or too few new clients to tell: {clients}"
            return (f"warning: {at_chance} while validation reached {100 * validation:.1f}%: what validation "
                    f"scored does not carry over to the new clients (another domain, classes training rarely saw, "
                    f"models of the training clients' own{few}); check them before shipping this bundle")
        return (f"warning: {at_chance}: the model learnt (almost) nothing; train longer, lower the learning rate "
                f"or check the labels before shipping this bundle")
    return None


@dataclass(frozen=True)
class NewClientPredictions:
    """The new clients' predictions pooled (per-class counts of predictions and of labels) and each client's
    accuracy."""

    counts: np.ndarray
    labels: np.ndarray
    accuracies: np.ndarray

    @property
    def accuracy(self) -> float:
        """The mean over new clients (what training reports)."""
        return float(np.mean(self.accuracies))


def new_client_predictions(sim: Simulation, state: dict | None = None) -> NewClientPredictions | None:
    """What :meth:`Simulation.evaluate_new` scores, with the predicted classes kept
    (:meth:`Simulation.personalized_predictions`, the device's semantics): each new client's model personalised
    on its own data from ``state`` (default: the run's best state, else its last). None when the run has no new
    clients or its method cannot personalise."""
    if not sim.fed.new:
        return None
    state = _best_state(sim, state)
    try:
        with torch.random.fork_rng(devices=[]):  # a method's random views leave the global RNG as it was
            preds = sim.personalized_predictions(sim.fed.new, state)
    except NotApplicable:
        return None
    num_classes = sim.algorithm.model.num_classes
    counts, labels, accs = np.zeros(num_classes, np.int64), np.zeros(num_classes, np.int64), []
    for pred, idx in zip(preds, sim.fed.new):
        y = sim.y[torch.from_numpy(idx)]
        counts += np.bincount(pred.cpu().numpy(), minlength=num_classes)[:num_classes]
        labels += np.bincount(y.cpu().numpy(), minlength=num_classes)[:num_classes]
        accs.append(float((pred == y).double().mean()))
    return NewClientPredictions(counts, labels, np.asarray(accs))


ADAPTATION_COST = 0.01  # a new client that personalising costs more than a point of accuracy


def adaptation_note(sim: Simulation, state: dict, seen: NewClientPredictions) -> dict[str, Any] | None:
    """What personalising did to each new client against the model it received (``state``'s; ``seen``: the
    clients' personalised predictions from it): ``received`` (the mean accuracy of the received model, a
    fraction), ``clients``, ``worse`` (how many lost more than a point, :data:`ADAPTATION_COST`), ``worst`` (the
    largest loss, a fraction) and ``line`` (one line saying so, None when no client lost more than a point). The
    declared safeguard bounds a validation shift's mean over clients, not each device; this is how far each device
    of this run got. None for a method that does not personalise."""
    rule = sim.device_safeguard
    kept = rule is not None and rule.keeps_received
    if not (sim.algorithm.adapts_at_test_time or kept) or "params" not in state:
        return None
    received = _received_accuracies(sim, state, sim.fed.new)
    personalised = seen.accuracies
    loss = received - personalised
    worse = int((loss > ADAPTATION_COST + 1e-9).sum())
    line = None if worse == 0 else (
        f"note: personalising cost {worse} of {len(loss)} new clients more than a point against the model they "
        f"received (worst {100 * loss.max():.1f} points; mean {100 * np.mean(personalised):.1f}% personalised, "
        f"{100 * np.mean(received):.1f}% received); the safeguard bounds a shift's mean over clients, not each "
        f"device: check the method's learning rate on your data, or open the bundle with method='none'")
    if kept:  # no device adapts: what adapting would do, on validation data
        line = kept_received_note(sim, state)
    return {"received": float(np.mean(received)), "clients": len(loss), "worse": worse,
            "worst": float(loss.max()), "line": line}


def _received_accuracies(sim: Simulation, state: dict, clients: list[np.ndarray]) -> np.ndarray:
    with torch.no_grad(), sim.device_semantics(state):
        return np.asarray([sim.accuracy(state["params"], idx) for idx in clients])


def kept_received_note(sim: Simulation, state: dict) -> str | None:
    """For a method whose safeguard rule keeps the received model on every device (``rollback``: its adaptation
    hurt on the lab's validation shifts), what adapting without the rule would do on this run's own validation data
    (its validation clients, else the training clients' held-out splits; never the new clients): one line, so that
    a deployment can choose ``edge_sdk.open_bundle(..., safeguard=False)`` on evidence. None without validation
    data (every split empty)."""
    clients = [c for c in (sim.fed.val_clients or sim.fed.val) if len(c)]
    if not clients:
        return None
    where = (f"this run's {len(clients)} validation clients" if sim.fed.val_clients else
             f"the held-out validation splits of this run's {len(clients)} training clients")
    with torch.random.fork_rng(devices=[]):  # a method's random views leave the global RNG as it was
        adapted = np.asarray(sim.personalized_accuracies(clients, state, safeguard=False))
    received = _received_accuracies(sim, state, clients)
    loss = received - adapted
    worse = int((loss > ADAPTATION_COST + 1e-9).sum())
    losers = (f"{worse} of {len(loss)} lose more than a point, worst {100 * loss.max():.1f} points" if worse else
              f"none of the {len(loss)} loses more than a point")
    advice = ("where that holds on your data, open the bundle with edge_sdk.open_bundle(..., safeguard=False)"
              if np.mean(adapted) > np.mean(received) else "the rule holds here too")
    return (f"note: {sim.algorithm.name}'s safeguard rule 'rollback' keeps the received model on every device; on "
            f"{where}, adapting without it gives {100 * np.mean(adapted):.1f}% against "
            f"{100 * np.mean(received):.1f}% received ({losers}); {advice}")


def _best_state(sim: Simulation, state: dict | None) -> dict | None:
    """``state``, else the run's best state (in memory, else from its run directory: a finished run, resumed)."""
    if state is None:
        state = sim.best_state
    if state is None and sim.out_dir is not None and (sim.out_dir / rundir.BEST).is_file():
        state = rundir.load_state(sim.out_dir / rundir.BEST, sim.device)
    return state


def run_report(sim: Simulation, state: dict | None = None,
               validation: float | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """(warning, adaptation) of a finished simulation's best state (or ``state``), its new clients personalised
    once: the warning is :func:`nonfinite_warning`, else :func:`collapse_warning` of the new clients (None when it
    has none; ``validation``: the run's best validation accuracy); the adaptation is :func:`adaptation_note` (None
    for a diverged run or one without new clients)."""
    best = _best_state(sim, state)
    diverged = nonfinite_warning(best) if best is not None else None
    if diverged:
        return diverged, None  # its predictions (NaN logits) would only add a misleading "collapsed" line
    seen = new_client_predictions(sim, best)
    if seen is None or best is None:
        return None, None
    warning = collapse_warning(seen.counts, len(seen.counts), seen.accuracy, seen.labels, subject=
                               RECEIVED_SUBJECT if type(sim.algorithm).device_labels else "new-client",
                               validation=validation, clients=len(seen.accuracies))
    return warning, adaptation_note(sim, best, seen)
