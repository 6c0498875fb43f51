"""The device's safeguard on the torch-free SDK (onnxruntime), with the rule the method declares in its bundle:
on the same new client, a TENT bundle whose adaptation is known to help keeps its personalised model, and one
whose adaptation is known to hurt (a test-time learning rate far too large: the predictions collapse) is rolled
back to the received model. "Known" from the client's labels, which only this test sees."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edge_sdk
from fl_server.algorithms import ALGORITHMS
from fl_server.data import load_dataset
from fl_server.data.domains import two_class_clients
from fl_server.export.run import export_run
from fl_server.recipes import DataSpec, Federation, Recipe
from fl_server.recipes.run import train


def _tent_bundle(tmp: Path, data_root: Path, **hyper: float) -> Path:
    recipe = Recipe(model="mlp", data=DataSpec.builtin("mnist", str(data_root)), method="TENT",
                    federation=Federation(partition="pathological", num_clients=10, new_fraction=0.2,
                                          max_samples=3000),
                    rounds=3, local_iterations=10, batch_size=64, hyper=hyper)
    train(recipe, tmp / "run", progress=False, device="cpu", data_root=str(data_root))
    return export_run(tmp / "run", tmp / "bundle", recipe=recipe)


def _accuracy(device: edge_sdk.Device, x: np.ndarray, y: np.ndarray) -> float:
    return float((device.predict(x).argmax(1) == y).mean())


@pytest.mark.slow
def test_the_declared_rule_keeps_help_and_rolls_back_harm(data_root: Path, tmp_path: Path) -> None:
    test = load_dataset("mnist", root=str(data_root), split="test")
    idx = two_class_clients(test.y, 1, 100, np.random.default_rng(3))[0]  # a new client: two classes, 100 samples
    x, y = test.x[idx], test.y[idx]
    declared = edge_sdk.safeguard.SafeguardRule.from_manifest(ALGORITHMS["TENT"].safeguard)

    outcomes = {}
    for name, hyper in (("helps", {}), ("hurts", {"tent_lr": 30.0, "steps": 5})):
        bundle = _tent_bundle(tmp_path / name, data_root, **hyper)
        received = edge_sdk.open_bundle(bundle, method="none")
        unguarded = edge_sdk.open_bundle(bundle, safeguard=False)
        guarded = edge_sdk.open_bundle(bundle)
        assert guarded.safeguard == declared  # the bundle carries the method's rule
        assert unguarded.personalize(x).safeguard is None
        result = guarded.personalize(x)
        assert result.safeguard is not None and result.safeguard.rule == declared.name
        outcomes[name] = (_accuracy(received, x, y), _accuracy(unguarded, x, y), _accuracy(guarded, x, y),
                          result.safeguard, received.predict(x), guarded.predict(x), unguarded.predict(x))

    rec, per, safe, decision, _, guarded_logits, unguarded_logits = outcomes["helps"]
    assert per > rec + 0.02, (rec, per)  # adaptation helps this client ...
    assert decision.action == "personalised" and safe == per, decision.message  # ... and the device keeps it
    np.testing.assert_array_equal(guarded_logits, unguarded_logits)

    rec, per, safe, decision, received_logits, guarded_logits, _ = outcomes["hurts"]
    assert per < rec - 0.1, (rec, per)  # adaptation hurts this client ...
    assert decision.keep_received and safe == rec, decision.message  # ... and the device rolls it back
    np.testing.assert_array_equal(guarded_logits, received_logits)
    assert decision.message.startswith("safeguard: kept the received model")
