"""ONNX export: every exported graph matches torch within 1e-5 (fp32) on real MNIST batches, on onnxruntime,
for the MLP and the ConvNet (the latter needs the convolution_backward decomposition)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export import export_spec, fedtta_step_spec, forward_spec, tent_step_spec
from fl_server.algorithms import build_algorithm
from fl_server.algorithms.fedtta import FEDTTA_HP
from fl_server.models import build_model

TOL = 1e-5


@pytest.fixture(scope="module")
def batches(mnist_all):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    return [torch.from_numpy(mnist_all.x[rng.choice(len(mnist_all), n, replace=False)]) for n in (64, 17)]


def _run(path: Path, spec, x: torch.Tensor) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = dict(zip(spec.input_names, [x.numpy(), *(w.detach().numpy() for w in spec.example[1:])]))
    assert [i.name for i in session.get_inputs()] == spec.input_names
    return session.run(spec.output_names, feeds)


def _check(spec, path: Path, batches) -> None:  # type: ignore[no-untyped-def]
    export_spec(spec, path)
    for x in batches:
        got = _run(path, spec, x)
        want = spec.fn(x, *spec.example[1:])
        assert len(got) == len(want)
        for name, g, w in zip(spec.output_names, got, want):
            diff = float(np.abs(g - w.detach().numpy()).max())
            assert diff <= TOL, f"{name}: max abs diff {diff:.2e} at batch {len(x)}"


@pytest.mark.parametrize("model_name", ["mlp", "convnet"])
def test_fedtta_step_and_forward_parity(model_name: str, batches, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    alg = build_algorithm("FedTTA", build_model(model_name, (1, 28, 28), 10, seed=0), 1, seed=0,
                          **FEDTTA_HP["mnist"]["FedTTA"])
    state = alg.init_state(torch.float32, torch.device("cpu"))
    _check(forward_spec(alg.model, state["params"]), tmp_path / "forward.onnx", batches)
    _check(fedtta_step_spec(alg, state["params"], state["phi"]), tmp_path / "fedtta_step.onnx", batches)


@pytest.mark.parametrize("model_name", ["mlp", "convnet"])
def test_tent_step_parity(model_name: str, batches, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    alg = build_algorithm("TENT", build_model(model_name, (1, 28, 28), 10, seed=0), 1, seed=0, lr=0.1)
    state = alg.init_state(torch.float32, torch.device("cpu"))
    _check(tent_step_spec(alg, state["params"]), tmp_path / "tent_step.onnx", batches)


def test_step_lowers_entropy_on_device(batches, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Iterating the exported TENT step on onnxruntime alone lowers the prediction entropy."""
    alg = build_algorithm("TENT", build_model("mlp", (1, 28, 28), 10, seed=0), 1, seed=0, lr=0.5)
    spec = tent_step_spec(alg, alg.init_state(torch.float32, torch.device("cpu"))["params"])
    path = export_spec(spec, tmp_path / "tent.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    weights = [w.numpy() for w in spec.example[1:]]
    x = batches[0].numpy()
    entropies = []
    for _ in range(5):
        out = session.run(None, dict(zip(spec.input_names, [x, *weights])))
        weights, entropies = out[:len(weights)], entropies + [float(out[-1])]
    assert entropies[-1] < entropies[0]
