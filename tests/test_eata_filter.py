"""EATA's reliable-sample weighting of the test-time step (``eata_margin``, fl_server.algorithms.losses.reliable_mean):
off by default, it drops the samples of entropy >= E0 from the loss, stays out of FedTTA's meta-training, and the
device's exported FedTTA step computes what torch computes with it on."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from edge_sdk._steps import StepRunner, load_session
from fl_server.algorithms import build_algorithm
from fl_server.algorithms.losses import entropy_from_logits, reliable_mean
from fl_server.export import export_spec
from fl_server.export.steps import device_specs, referenced_values
from fl_server.models import build_model
from fl_server.recipes.presets import FEDTTA_HP


def test_reliable_mean_weights_only_confident_samples() -> None:
    logits = torch.tensor([[8.0, 0.0, 0.0], [0.0, 0.0, 0.0], [4.0, 0.0, 0.0]])
    values = torch.tensor([1.0, 5.0, 3.0], requires_grad=True)
    assert torch.equal(reliable_mean(values, logits, None), values.mean())
    h = entropy_from_logits(logits)
    e0 = 0.4 * math.log(3)  # the uniform row (h = ln 3) is above it; the others below
    assert h[0] < h[2] < e0 < h[1]
    loss = reliable_mean(values, logits, 0.4)
    (g,) = torch.autograd.grad(loss, values)
    expected = torch.exp(e0 - h) * torch.tensor([1.0, 0.0, 1.0]) / 2  # mean over the 2 kept
    torch.testing.assert_close(g, expected)
    torch.testing.assert_close(loss, (expected * values).sum())
    # nothing reliable: a zero loss (no step), not a division by zero
    assert float(reliable_mean(values.detach(), torch.zeros(3, 3), 0.4)) == 0.0


def test_fedtta_device_step_with_the_filter_is_torchs(mnist_all, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x = torch.from_numpy(mnist_all.x[:64])
    model = build_model("mlp", (1, 28, 28), 10, seed=0)
    plain = build_algorithm("FedTTA", model, 1, seed=0, **FEDTTA_HP["mnist"]["FedTTA"])
    state = plain.init_state(torch.float32, torch.device("cpu"))
    psi, phi = state["params"], state["phi"]
    # a margin that keeps about half of this batch
    margin = float(entropy_from_logits(plain.forward(psi, x)).median()) / math.log(10)
    eata = build_algorithm("FedTTA", model, 1, seed=0, **FEDTTA_HP["mnist"]["FedTTA"], eata_margin=margin)
    assert plain.hp.eata_margin is None
    # meta-training's loss is untouched; the new client's step changes
    torch.testing.assert_close(eata.personalization_loss(psi, phi, x), plain.personalization_loss(psi, phi, x))
    on, off = eata.personalize(state, x), plain.personalize(state, x)
    assert any(not torch.allclose(on[n], off[n]) for n in psi)
    # no sample reliable: the step leaves the received weights as they are (finite)
    none_kept = build_algorithm("FedTTA", model, 1, seed=0, **FEDTTA_HP["mnist"]["FedTTA"], eata_margin=1e-6)
    kept_none = none_kept.personalize(state, x)
    assert all(torch.equal(kept_none[n], psi[n]) for n in psi)

    spec = device_specs(eata, state, freeze=True)["fedtta_step"]  # what a bundle ships
    runner = StepRunner(load_session(export_spec(spec, tmp_path / "step.onnx"), initializers=referenced_values(spec)))
    new, logits, entropy = runner.step(x.numpy(), {n: v.detach().numpy() for n, v in psi.items()})
    for n in psi:
        np.testing.assert_allclose(new[n], on[n].detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=n)
    with torch.no_grad():
        expected = eata.forward(on, x)
    np.testing.assert_allclose(logits, expected.numpy(), rtol=1e-4, atol=1e-5)
    assert abs(entropy - float(entropy_from_logits(expected).mean())) <= 1e-5
