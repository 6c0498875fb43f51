"""edge_sdk.safeguard: the label-free evidence, each rule's decision, the manifest form of a rule and its
validation, and malformed logits refused with a clear message."""
from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.safeguard import EVIDENCE, SafeguardRule, disagreement, evidence, mix, shifted


def _pair(n: int, flipped: int) -> tuple[np.ndarray, np.ndarray]:
    """Received logits of ``n`` samples (class i % 3) and adapted ones that flip the first ``flipped``."""
    rng = np.random.default_rng(0)
    received = rng.normal(size=(n, 3))
    received[np.arange(n), np.arange(n) % 3] += 10.0
    adapted = received + rng.normal(scale=0.1, size=received.shape)  # same arg-max, other logits
    adapted[:flipped] = np.roll(received[:flipped], 1, axis=1)
    return received, adapted


def test_disagreement_rule_keeps_received_beyond_threshold() -> None:
    received, adapted = _pair(100, 31)
    decision = SafeguardRule("disagreement", threshold=0.3).decide(evidence(received, adapted))
    assert decision.keep_received and decision.action == "received"
    assert decision.evidence["disagreement"] == pytest.approx(0.31)
    assert decision.message.startswith("safeguard: kept the received model") and "31.0%" in decision.message
    at = SafeguardRule("disagreement", threshold=0.3).decide(evidence(*_pair(100, 30)))  # at it: not beyond
    assert not at.keep_received and at.message.startswith("safeguard: using the personalised model")


def test_evidence_measures_collapse_and_confidence() -> None:
    received = np.array([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 3.0], [3.0, 0.0, 0.0]])
    collapsed = np.array([[9.0, 0.0, 0.0]] * 4)  # every prediction on class 0, very confident
    ev = evidence(received, collapsed)
    assert ev["disagreement"] == 0.5
    assert ev["entropy_drop"] > 0 and ev["confidence_gain"] > 0  # more confident ...
    assert ev["marginal_entropy_change"] < -0.5  # ... and collapsed onto one class
    assert "shift_consistency_change" not in ev
    ev = evidence(received, collapsed, received[[1, 0, 2, 3]], collapsed)  # the shift moved two received answers
    assert ev["shift_consistency_change"] == pytest.approx(0.5)
    assert set(ev) == set(EVIDENCE)


def test_linear_rule_and_manifest_round_trip() -> None:
    rule = SafeguardRule("linear", weights={"marginal_entropy_change": 4.0, "disagreement": -2.0}, bias=0.5)
    assert rule.action({"marginal_entropy_change": -0.5, "disagreement": 0.1}) == "received"  # 0.5 - 2 - 0.2 < 0
    assert rule.action({"marginal_entropy_change": 0.0, "disagreement": 0.1}) == "personalised"
    assert SafeguardRule.from_manifest(rule.to_manifest()) == rule
    assert SafeguardRule("off").action({}) == "personalised" and SafeguardRule("rollback").action({}) == "received"
    partial = SafeguardRule.from_manifest({**rule.to_manifest(), "partial": True})
    assert partial.name == "linear+partial" and partial.to_manifest()["partial"] is True
    decision = partial.decide({"marginal_entropy_change": -0.5, "disagreement": 0.1})
    assert decision.action == "partial" and not decision.keep_received and "partially" in decision.message
    assert SafeguardRule("rollback", partial=True).action({}) == "partial"  # always the mix
    assert rule.decide({"marginal_entropy_change": 0.0, "disagreement": 0.1}).score == pytest.approx(0.3)


@pytest.mark.parametrize(("spec", "message"), [
    ({"rule": "maybe"}, "unknown safeguard rule 'maybe'"),
    ({"rule": "disagreement", "threshold": 2}, r"a share in \[0, 1\]"),
    ({"rule": "disagreement", "threshold": float("nan")}, r"a share in \[0, 1\]"),
    ({"rule": "linear", "weights": {"accuracy": 1.0}}, "weighs evidence among"),
    ({"rule": "linear", "weights": {"disagreement": 1e300}}, "finite numbers below 1e6"),
    ({"rule": "off", "extra": 1}, "unknown safeguard fields"),
    ("off", "a safeguard block is"),
    ({"rule": "rollback", "partial": "yes"}, "partial is true or false"),
])
def test_bad_rules_refused(spec: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SafeguardRule.from_manifest(spec)


def test_mix_is_the_mean_of_the_two_models_probabilities() -> None:
    received, adapted = np.array([[2.0, 0.0, -1.0]]), np.array([[-1.0, 3.0, 0.0]])
    p = lambda z: np.exp(z) / np.exp(z).sum()  # noqa: E731
    np.testing.assert_allclose(np.exp(mix(received, adapted)), 0.5 * (p(received) + p(adapted)), rtol=1e-6)


def test_shift_is_for_images_only() -> None:
    x = np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4)
    s = shifted(x)
    assert s is not None and s[0, 0, 1, 1] == x[0, 0, 0, 0]
    assert shifted(np.zeros((2, 10), np.float32)) is None


@pytest.mark.parametrize(("a", "b", "message"), [
    (np.zeros((3, 2)), np.zeros((3, 3)), "same shape [N, K]"),
    (np.zeros(3), np.zeros(3), "same shape [N, K]"),
    (np.zeros((0, 2)), np.zeros((0, 2)), "at least one unlabeled sample"),
    (np.full((2, 2), np.nan), np.zeros((2, 2)), "must be finite"),
])
def test_bad_logits(a: np.ndarray, b: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        evidence(a, b)
    with pytest.raises(ValueError):
        disagreement(a, b)
