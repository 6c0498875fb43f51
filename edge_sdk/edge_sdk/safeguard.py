"""A label-free safeguard for test-time personalisation: keep the received model when adaptation looks harmful.

A device personalises the received model on its unlabeled data (TENT, FedTTA, FedTTA++, FedICON ...). On a
domain the federation never saw, that adaptation can lower accuracy with no label to tell. The safeguard
compares the two models on the same unlabeled set and computes label-free :func:`evidence` (how many
predictions changed, how much more confident the adapted model is, whether its predictions collapsed onto fewer
classes, whether they stay stable under a one-pixel shift); a :class:`SafeguardRule` turns the evidence into a
decision: use the personalised model, keep the received one (rolled back), or keep both partially (predict with
the mean of the two models' probabilities, :func:`mix`). Each method declares its rule (chosen on validation
shifts only, never on a test domain; see the ``unseen-domain`` experiment of the lab) and the exporter writes it
into the bundle's manifest (``"safeguard"``); :meth:`edge_sdk.Device.personalize` applies it and reports the
decision in ``Adaptation.safeguard``.

    import numpy as np
    from edge_sdk.safeguard import SafeguardRule, evidence

    received = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    adapted = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])   # flips one of three predictions
    rule = SafeguardRule("disagreement", threshold=0.2)
    decision = rule.decide(evidence(received, adapted))
    decision.action          # "received": 1/3 of the predictions changed, more than 0.2
    decision.message         # the line a demo prints

Rules (``SafeguardRule.kind``):

* ``"off"``: always use the personalised model;
* ``"rollback"``: always keep the received model (a method whose adaptation hurt on validation);
* ``"disagreement"``: keep the received model when more than ``threshold`` of the predictions changed;
* ``"linear"``: use the personalised model when ``bias + sum(weights[f] * evidence[f]) > 0`` (a logistic model
  of "adaptation helped" fitted on validation clients).

With ``partial=True`` a rule keeps both models partially where it would roll back (``"rollback"`` with
``partial=True``: always the mixture).

numpy only.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ACTIONS", "EVIDENCE", "SafeguardDecision", "SafeguardRule", "disagreement", "evidence", "mix", "shifted"]

# the label-free evidence :func:`evidence` computes; "shift_consistency" needs image inputs [N, C, H, W]
EVIDENCE: tuple[str, ...] = ("disagreement", "entropy_drop", "confidence_gain", "marginal_entropy_change",
                             "shift_consistency_change")
_KINDS = ("off", "rollback", "disagreement", "linear")
# what the device predicts with after the decision
ACTIONS = ("personalised", "partial", "received")


def _probabilities(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(-1, keepdims=True)


def _entropy(p: np.ndarray) -> np.ndarray:
    return -(p * np.log(np.clip(p, 1e-12, None))).sum(-1)


def _check(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(f"logits must be two arrays of the same shape [N, K], got {a.shape} and {b.shape}")
    if len(a) == 0:
        raise ValueError("logits are empty: the safeguard needs at least one unlabeled sample")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("logits must be finite")
    return a, b


def disagreement(received_logits: np.ndarray, adapted_logits: np.ndarray) -> float:
    """Share of samples whose arg-max class differs between two [N, K] logit (or probability) arrays.

    >>> disagreement(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([[1.0, 0.0], [1.0, 0.0]]))
    0.5
    """
    a, b = _check(received_logits, adapted_logits)
    return float(np.mean(a.argmax(-1) != b.argmax(-1)))


def evidence(received_logits: np.ndarray, adapted_logits: np.ndarray,
             received_shifted: np.ndarray | None = None, adapted_shifted: np.ndarray | None = None
             ) -> dict[str, float]:
    """Label-free evidence on one unlabeled set from the two models' logits [N, K] on it:

    * ``disagreement``: share of predictions the adaptation changed;
    * ``entropy_drop``: mean prediction entropy, received minus adapted (> 0: more confident);
    * ``confidence_gain``: mean top-class probability, adapted minus received;
    * ``marginal_entropy_change``: entropy of the mean prediction, adapted minus received (< 0: the predictions
      concentrate on fewer classes, the signature of entropy minimisation collapsing);
    * ``shift_consistency_change`` (when both models' logits on the set shifted by one pixel are given, see
      :func:`shifted`): share of predictions unchanged by the shift, adapted minus received.

    >>> sorted(evidence(np.eye(2), np.eye(2)))[:2]
    ['confidence_gain', 'disagreement']
    """
    a, b = _check(received_logits, adapted_logits)
    pa, pb = _probabilities(a), _probabilities(b)
    out = {"disagreement": float(np.mean(a.argmax(-1) != b.argmax(-1))),
           "entropy_drop": float(_entropy(pa).mean() - _entropy(pb).mean()),
           "confidence_gain": float(pb.max(-1).mean() - pa.max(-1).mean()),
           "marginal_entropy_change": float(_entropy(pb.mean(0)) - _entropy(pa.mean(0)))}
    if received_shifted is not None and adapted_shifted is not None:
        sa, sb = _check(received_shifted, adapted_shifted)
        if sa.shape != a.shape:
            raise ValueError(f"shifted logits must have the logits' shape {a.shape}, got {sa.shape}")
        out["shift_consistency_change"] = float(np.mean(sb.argmax(-1) == b.argmax(-1))
                                                - np.mean(sa.argmax(-1) == a.argmax(-1)))
    return out


def shifted(x: np.ndarray) -> np.ndarray | None:
    """The image batch [N, C, H, W] moved by one pixel right and one down (edges wrap), the augmentation the
    ``shift_consistency_change`` evidence uses; None for inputs that are not images."""
    x = np.asarray(x)
    return np.roll(x, (1, 1), axis=(-2, -1)) if x.ndim == 4 and min(x.shape[-2:]) > 2 else None


def mix(received_logits: np.ndarray, adapted_logits: np.ndarray) -> np.ndarray:
    """Log of the mean of the two models' class probabilities [N, K] (float32): the "partial" decision's
    prediction.

    >>> mix(np.array([[0.0, 0.0]]), np.array([[0.0, 0.0]])).round(3).tolist()
    [[-0.693, -0.693]]
    """
    p = 0.5 * (_probabilities(received_logits) + _probabilities(adapted_logits))
    return np.log(np.clip(p, 1e-30, None)).astype(np.float32)


@dataclass(frozen=True)
class SafeguardDecision:
    """What a :class:`SafeguardRule` decided: the ``action`` (one of :data:`ACTIONS`) and the evidence."""

    action: str
    rule: str
    evidence: dict[str, float] = field(default_factory=dict)
    score: float | None = None  # the linear rule's score (> 0: use the personalised model)

    @property
    def keep_received(self) -> bool:
        """Whether the device rolled back to the received model."""
        return self.action == "received"

    @property
    def message(self) -> str:
        """One line for a person: which model is used and why."""
        changed = self.evidence.get("disagreement")
        why = f"rule {self.rule}" + ("" if changed is None else f", {100 * changed:.1f}% of predictions changed") \
            + ("" if self.score is None else f", score {self.score:+.2f}")
        what = {"received": "kept the received model", "partial": "kept both models partially (mean of their "
                "probabilities)", "personalised": "using the personalised model"}[self.action]
        return f"safeguard: {what} ({why})"

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "rule": self.rule, "score": self.score, "evidence": dict(self.evidence)}


@dataclass(frozen=True)
class SafeguardRule:
    """A decision rule from :func:`evidence` to "keep the received model"; see the module docstring for the
    kinds. ``threshold``: the ``"disagreement"`` rule's largest share of changed predictions it accepts.
    ``weights`` / ``bias``: the ``"linear"`` rule's coefficients over evidence names. ``partial``: where the rule
    judges adaptation harmful, keep both models partially instead of rolling back.

    >>> SafeguardRule.from_manifest({"rule": "disagreement", "threshold": 0.5}).name
    'disagreement<=0.5'
    """

    kind: str
    threshold: float = 0.5
    weights: Mapping[str, float] = field(default_factory=dict)
    bias: float = 0.0
    partial: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown safeguard rule {self.kind!r}; one of {', '.join(_KINDS)}")
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold)
                and 0.0 <= self.threshold <= 1.0):
            raise ValueError(f"a safeguard threshold is a share in [0, 1], got {self.threshold!r}")
        if self.kind == "linear":
            if not self.weights or set(self.weights) - set(EVIDENCE):
                raise ValueError(f"a linear safeguard rule weighs evidence among {', '.join(EVIDENCE)}, got "
                                 f"{sorted(self.weights)}")
            values = [*self.weights.values(), self.bias]
            if not all(isinstance(v, (int, float)) and math.isfinite(v) and abs(v) < 1e6 for v in values):
                raise ValueError("a linear safeguard rule's weights and bias must be finite numbers below 1e6")

    @property
    def name(self) -> str:
        """A short name: ``off``, ``rollback``, ``disagreement<=0.3``, ``linear``; ``+partial`` when partial."""
        base = f"disagreement<={self.threshold:g}" if self.kind == "disagreement" else self.kind
        return base + ("+partial" if self.partial and self.kind != "off" else "")

    @property
    def keeps_received(self) -> bool:
        """Whether the rule keeps the received model whatever adaptation does (``rollback``, not partial): a
        device then adapts nothing, and what it predicts with is the received model.

        >>> SafeguardRule("rollback").keeps_received, SafeguardRule("rollback", partial=True).keeps_received
        (True, False)
        """
        return self.kind == "rollback" and not self.partial

    @property
    def needs_shift(self) -> bool:
        """Whether the rule reads ``shift_consistency_change`` (the device then predicts the shifted set too)."""
        return self.kind == "linear" and "shift_consistency_change" in self.weights

    def score(self, ev: Mapping[str, float]) -> float | None:
        if self.kind != "linear":
            return None
        missing = set(self.weights) - set(ev)
        if missing:
            raise ValueError(f"the safeguard rule needs evidence {sorted(missing)}")
        return float(self.bias + sum(w * ev[k] for k, w in self.weights.items()))

    def harmful(self, ev: Mapping[str, float]) -> bool:
        """Whether the rule judges the adaptation harmful on this evidence."""
        if self.kind == "off":
            return False
        if self.kind == "rollback":
            return True
        if self.kind == "disagreement":
            return ev["disagreement"] > self.threshold
        s = self.score(ev)
        assert s is not None
        return s <= 0.0

    def action(self, ev: Mapping[str, float]) -> str:
        """What the device predicts with on this evidence (one of :data:`ACTIONS`)."""
        if not self.harmful(ev):
            return "personalised"
        return "partial" if self.partial else "received"

    def decide(self, ev: Mapping[str, float]) -> SafeguardDecision:
        return SafeguardDecision(self.action(ev), self.name, dict(ev), self.score(ev))

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.kind}
        if self.kind == "disagreement":
            out["threshold"] = float(self.threshold)
        if self.kind == "linear":
            out["weights"] = {k: float(v) for k, v in self.weights.items()}
            out["bias"] = float(self.bias)
        if self.partial and self.kind != "off":
            out["partial"] = True
        return out

    @classmethod
    def from_manifest(cls, spec: object) -> SafeguardRule:
        """The rule a manifest's ``"safeguard"`` block declares (ValueError naming what is wrong)."""
        if not isinstance(spec, dict) or not isinstance(spec.get("rule"), str):
            raise ValueError(f"a safeguard block is {{'rule': one of {', '.join(_KINDS)}, ...}}, got {spec!r}")
        extra = set(spec) - {"rule", "threshold", "weights", "bias", "partial"}
        if extra:
            raise ValueError(f"unknown safeguard fields {sorted(extra)}")
        weights = spec.get("weights", {})
        if not isinstance(weights, dict):
            raise ValueError("a safeguard rule's weights are {evidence name: number}")
        if not isinstance(spec.get("partial", False), bool):
            raise ValueError("a safeguard rule's partial is true or false")
        return cls(spec["rule"], threshold=spec.get("threshold", 0.5), weights=dict(weights),
                   bias=spec.get("bias", 0.0), partial=spec.get("partial", False))

