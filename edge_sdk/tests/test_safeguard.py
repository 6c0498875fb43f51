"""edge_sdk.safeguard: keeps the received model when the adapted one disagrees beyond the threshold, passes the
adapted one otherwise, and refuses malformed logits with a clear message."""
from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.safeguard import DEFAULT_THRESHOLD, disagreement, guard, guarded_logits


def _pair(n: int, flipped: int) -> tuple[np.ndarray, np.ndarray]:
    """Received logits of ``n`` samples (class i % 3) and adapted ones that flip the first ``flipped``."""
    rng = np.random.default_rng(0)
    received = rng.normal(size=(n, 3))
    received[np.arange(n), np.arange(n) % 3] += 10.0
    adapted = received + rng.normal(scale=0.1, size=received.shape)  # same arg-max, other logits
    adapted[:flipped] = np.roll(received[:flipped], 1, axis=1)
    return received, adapted


def test_keeps_received_beyond_threshold() -> None:
    received, adapted = _pair(100, 31)
    decision = guard(received, adapted, 0.3)
    assert decision.keep_received and decision.disagreement == pytest.approx(0.31)
    logits, _ = guarded_logits(received, adapted, 0.3)
    assert logits is received or np.array_equal(logits, received)
    assert decision.message.startswith("safeguard: kept the received model") and "31.0%" in decision.message


def test_passes_adapted_within_threshold() -> None:
    received, adapted = _pair(100, 30)
    decision = guard(received, adapted, 0.3)  # exactly at the threshold: not beyond it
    assert not decision.keep_received and decision.disagreement == pytest.approx(0.3)
    logits, _ = guarded_logits(received, adapted, 0.3)
    assert np.array_equal(logits, adapted)
    assert decision.message.startswith("safeguard: using the personalised model")


def test_threshold_one_is_off_and_default_in_range() -> None:
    received, adapted = _pair(10, 10)
    assert disagreement(received, adapted) == 1.0
    assert not guard(received, adapted, 1.0).keep_received
    assert 0.0 < DEFAULT_THRESHOLD < 1.0


@pytest.mark.parametrize(("a", "b", "message"), [
    (np.zeros((3, 2)), np.zeros((3, 3)), "same shape [N, K]"),
    (np.zeros(3), np.zeros(3), "same shape [N, K]"),
    (np.zeros((0, 2)), np.zeros((0, 2)), "at least one unlabeled sample"),
    (np.full((2, 2), np.nan), np.zeros((2, 2)), "must be finite"),
])
def test_bad_logits(a: np.ndarray, b: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        guard(a, b)


def test_negative_threshold() -> None:
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        guard(np.zeros((1, 2)), np.zeros((1, 2)), -0.1)
