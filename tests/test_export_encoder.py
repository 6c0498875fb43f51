"""ODPFL-HN's set encoder exported for the device: ONNX matches torch (1e-5) on real digits sets of any
size, for the MLP and the ConvNet trunk, and is invariant to the order of the set."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from fl_server.export import encoder_spec, export_spec
from fl_server.algorithms import build_algorithm
from fl_server.data import load_dataset
from fl_server.models import build_model


@pytest.mark.parametrize("model_name", ["mlp", "convnet"])
def test_encoder_parity(model_name: str, tmp_path: Path) -> None:
    x_all = load_dataset("digits", split="all").x.astype(np.float32)
    alg = build_algorithm("ODPFL-HN", build_model(model_name, x_all.shape[1:], 10, seed=0), 4, seed=0)
    gamma = alg.init_state(torch.float32, torch.device("cpu"))["enc"]
    spec = encoder_spec(alg, gamma)
    path = export_spec(spec, tmp_path / "encoder.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {f"gamma.{k}": v.numpy() for k, v in gamma.items()}
    for n in (1, 7, 300):
        x = x_all[np.random.default_rng(n).choice(len(x_all), n, replace=False)]
        (got,) = session.run(["embedding"], {"x": x, **feeds})
        want = alg.encode(gamma, torch.from_numpy(x)).numpy()
        assert got.shape == (alg.hp.embed_dim,)
        np.testing.assert_allclose(got, want, atol=1e-5)
        (shuffled,) = session.run(["embedding"], {"x": x[::-1].copy(), **feeds})
        np.testing.assert_allclose(shuffled, got, atol=1e-5)
