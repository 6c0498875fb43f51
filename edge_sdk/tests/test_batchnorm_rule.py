"""The bundle's batch-normalisation rule (edge_sdk._batchnorm): which statistics a step normalises with, and the
exact errors for a malformed manifest entry."""
from __future__ import annotations

import pytest

from edge_sdk._batchnorm import BatchNormRule


def test_default_rule_never_uses_one_samples_statistics() -> None:
    rule = BatchNormRule.from_manifest({"statistics": "federated", "min_batch": 16})
    assert [rule.step_momentum(n) for n in (1, 15, 16, 64)] == [0.0, 0.0, 1.0, 1.0]
    assert not any(rule.updates_statistics(n) for n in (1, 16))


def test_ema_rule_updates_on_small_batches_only() -> None:
    rule = BatchNormRule.from_manifest({"min_batch": 8, "small_batch": "ema", "ema_momentum": 0.05})
    assert rule.step_momentum(1) == 0.05 and rule.step_momentum(8) == 1.0
    assert rule.updates_statistics(1) and not rule.updates_statistics(8)


@pytest.mark.parametrize("entry,message", [
    ([], "batch_norm must be an object, got list"),
    ({"min_batch": 1}, "batch_norm.min_batch must be an integer >= 2, got 1"),
    ({"small_batch": "sample"}, "batch_norm.small_batch must be one of running, ema, got 'sample'"),
    ({"ema_momentum": 1.0}, r"batch_norm.ema_momentum must be in \(0, 1\), got 1.0"),
])
def test_bad_rules_are_refused(entry: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        BatchNormRule.from_manifest(entry)
