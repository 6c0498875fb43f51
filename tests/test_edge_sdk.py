"""edge_sdk numerics match torch; importing edge_sdk never imports torch."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from edge_sdk import entropy, log_softmax, softmax
from fl_server.algorithms.losses import entropy_from_logits


def test_entropy_matches_torch() -> None:
    logits = np.random.default_rng(0).normal(scale=5.0, size=(64, 10))
    np.testing.assert_allclose(entropy(logits), entropy_from_logits(torch.from_numpy(logits)).numpy(), atol=1e-12)
    np.testing.assert_allclose(softmax(logits).sum(-1), 1.0, atol=1e-12)
    assert np.isfinite(log_softmax(np.array([[1e4, 0.0]]))).all()
    assert abs(entropy(np.zeros((1, 10)))[0] - np.log(10)) < 1e-12


def test_import_edge_sdk_without_torch() -> None:
    code = "import sys, edge_sdk; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
