"""A label-free safeguard for test-time personalisation: keep the received model when adaptation moved too far.

A device personalises the received model on its unlabeled data (TENT, FedTTA, FedTTA++, FedICON ...). On a
domain the federation never saw, that adaptation can lower accuracy with no label to tell. The safeguard
compares the two models' predictions on the same unlabeled set: when the adapted model changes the predicted
class of more than ``threshold`` of the samples, it keeps the received model.

    import numpy as np
    from edge_sdk.safeguard import guard

    received = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    adapted = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])   # flips one of three predictions
    decision = guard(received, adapted, threshold=0.2)
    decision.keep_received   # True: 1/3 of the predictions changed, more than 0.2 (the default is 0.5)
    decision.message         # the line a demo prints

The default threshold is chosen on validation shifts only (corruptions no test domain uses), from the
``unseen-domain`` experiment's table (docs/results/unseen-domain.json; lab/unseen.py).
numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Chosen on the unseen-domain experiment's validation rows only (validation corruptions, 3 seeds, MNIST and
# Fashion-MNIST): the threshold of best mean safeguarded accuracy over the personalising methods, ahead of the
# safeguard off (threshold 1); lab/tests/test_unseen_domain.py checks it against docs/results/unseen-domain.json.
DEFAULT_THRESHOLD = 0.5


@dataclass(frozen=True)
class SafeguardDecision:
    """What :func:`guard` decided: ``keep_received`` and why (``disagreement`` against ``threshold``)."""

    keep_received: bool
    disagreement: float  # share of samples whose predicted class the adaptation changed
    threshold: float

    @property
    def message(self) -> str:
        """One line for a person: which model is used and why."""
        share = f"{100 * self.disagreement:.1f}% of predictions changed (limit {100 * self.threshold:.1f}%)"
        if self.keep_received:
            return f"safeguard: kept the received model -- personalisation {share}"
        return f"safeguard: using the personalised model -- {share}"


def disagreement(received_logits: np.ndarray, adapted_logits: np.ndarray) -> float:
    """Share of samples whose arg-max class differs between two [N, K] logit (or probability) arrays.

    >>> disagreement(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([[1.0, 0.0], [1.0, 0.0]]))
    0.5
    """
    a, b = np.asarray(received_logits), np.asarray(adapted_logits)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(f"logits must be two arrays of the same shape [N, K], got {a.shape} and {b.shape}")
    if len(a) == 0:
        raise ValueError("logits are empty: the safeguard needs at least one unlabeled sample")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("logits must be finite")
    return float(np.mean(a.argmax(-1) != b.argmax(-1)))


def guard(received_logits: np.ndarray, adapted_logits: np.ndarray,
          threshold: float = DEFAULT_THRESHOLD) -> SafeguardDecision:
    """Keep the received model when the adapted one disagrees with it on more than ``threshold`` of the
    unlabeled set (both logits [N, K] on the same samples); ``threshold`` >= 1 never keeps it (safeguard off).

    >>> guard(np.array([[1.0, 0.0]] * 4), np.array([[1.0, 0.0]] * 3 + [[0.0, 1.0]]), 0.2).keep_received
    True
    """
    if not 0.0 <= threshold:
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    d = disagreement(received_logits, adapted_logits)
    return SafeguardDecision(keep_received=d > threshold, disagreement=d, threshold=float(threshold))


def guarded_logits(received_logits: np.ndarray, adapted_logits: np.ndarray,
                   threshold: float = DEFAULT_THRESHOLD) -> tuple[np.ndarray, SafeguardDecision]:
    """The logits of the model the safeguard keeps, and its decision.

    >>> guarded_logits(np.eye(2), np.eye(2)[::-1], 0.5)[1].keep_received
    True
    """
    decision = guard(received_logits, adapted_logits, threshold)
    return (np.asarray(received_logits) if decision.keep_received else np.asarray(adapted_logits)), decision
