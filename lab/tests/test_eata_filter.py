"""lab/research/probe_eata_filter.py's EATA weighting (the docs/research/eata-filter.md probe) on hand-made inputs:
only the confident samples count, weighted exp(E0 - E) over the kept, and nothing kept is a zero loss."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from fl_server.algorithms.losses import entropy_from_logits


def _probe():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[1] / "research" / "probe_eata_filter.py"
    spec = importlib.util.spec_from_file_location("probe_eata_filter", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_reliable_mean_weights_only_confident_samples() -> None:
    reliable_mean = _probe().reliable_mean
    logits = torch.tensor([[8.0, 0.0, 0.0], [0.0, 0.0, 0.0], [4.0, 0.0, 0.0]])
    values = torch.tensor([1.0, 5.0, 3.0], requires_grad=True)
    h = entropy_from_logits(logits)
    e0 = 0.4 * math.log(3)  # the uniform row (h = ln 3) is above it; the others below
    assert h[0] < h[2] < e0 < h[1]
    loss = reliable_mean(values, logits, 0.4)
    (g,) = torch.autograd.grad(loss, values)
    expected = torch.exp(e0 - h) * torch.tensor([1.0, 0.0, 1.0]) / 2  # mean over the 2 kept
    torch.testing.assert_close(g, expected)
    torch.testing.assert_close(loss, (expected * values).sum())
    # nothing reliable: a zero loss with a zero (not NaN) gradient, not a division by zero
    none_kept = reliable_mean(values, torch.zeros(3, 3), 0.4)
    (g,) = torch.autograd.grad(none_kept, values)
    assert float(none_kept.detach()) == 0.0 and torch.equal(g, torch.zeros(3))


def test_weighted_new_client_steps(mnist_all) -> None:  # type: ignore[no-untyped-def]
    """The lab-only TENT and FedTTA subclasses step differently from the product's at a margin that keeps about half
    of the batch, and leave the received weights as they are (finite) when no sample is kept."""
    from fl_server.models import build_model
    from fl_server.recipes.presets import FEDTTA_HP

    probe = _probe()
    x = torch.from_numpy(mnist_all.x[:64])
    model = build_model("mlp", (1, 28, 28), 10, seed=0)
    for method, hyper in (("TENT", {}), ("FedTTA", FEDTTA_HP["mnist"]["FedTTA"])):
        plain = probe.personalizer(method, model, 0, hyper, None)
        state = plain.init_state(torch.float32, torch.device("cpu"))
        psi = state["params"]
        margin = float(entropy_from_logits(plain.forward(psi, x)).median()) / math.log(10)
        on, off = probe.personalizer(method, model, 0, hyper, margin).personalize(state, x), plain.personalize(state, x)
        assert any(not torch.allclose(on[n], off[n]) for n in psi), method
        kept_none = probe.personalizer(method, model, 0, hyper, 1e-6).personalize(state, x)
        assert all(torch.equal(kept_none[n], psi[n]) for n in psi), method
