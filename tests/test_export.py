"""ONNX export: every exported graph matches torch within 1e-5 (fp32) on real MNIST batches, on onnxruntime,
for the MLP and the ConvNet (the latter needs the convolution_backward decomposition)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from fl_server.export import export_spec, fedtta_step_spec, forward_spec, tent_step_spec
from fl_server.algorithms import build_algorithm
from fl_server.recipes.presets import FEDTTA_HP
from fl_server.functional import make_forward
from fl_server.models import build_model
from fl_server.models.norm import calibrate

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
    nodes = onnx.load(str(tmp_path / "tent_step.onnx")).graph.node
    pools = [n for n in nodes if n.op_type == "MaxPool"]
    # fl_server.export.decompositions: ReLU's backward is a multiply by a 0/1 mask, not the exporter's slow Where; the
    # max-pool backward compares with the upsampled maximum instead of scattering with the forward's indices
    assert not [n for n in nodes if n.op_type in ("Where", "ScatterElements")]
    assert all(len(n.output) == 1 for n in pools)  # no pooling computes indices
    # 2x2 pools: the step's forward, the backward's first-maximum rank and the final forward
    assert len(pools) == (6 if model_name == "convnet" else 0)


def test_bn_affine_tent_step_parity(batches, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The original TENT on a batch-normalised CNN: the exported step (test-batch statistics, batches of 64
    and 17) matches torch and moves only the normalisation scale and shift."""
    alg = build_algorithm("TENT", build_model("btfl_cnn_bn", (1, 28, 28), 10, seed=0), 1, seed=0,
                          adapt="norm_affine", tent_lr=1.0)
    params = alg.init_state(torch.float32, torch.device("cpu"))["params"]
    forward = make_forward(alg.model)
    calibrate(alg.model, lambda xb: forward(params, xb), batches)  # the graph's population statistics input
    spec = tent_step_spec(alg, params)  # bn_momentum 1 in the example: the test batch's statistics
    export_spec(spec, tmp_path / "tent_bn_step.onnx")
    for x in batches:  # 5e-5: torch and onnxruntime reduce the batch variance in different orders (float32)
        outputs = zip(spec.output_names, _run(tmp_path / "tent_bn_step.onnx", spec, x), spec.fn(x, *spec.example[1:]))
        for name, got, want in outputs:
            np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=5e-5, err_msg=name)
    moved = [n for n, new, old in zip(spec.output_names, _run(tmp_path / "tent_bn_step.onnx", spec, batches[0]),
                                       spec.example[1:]) if n.startswith("new.") and not np.array_equal(new, old.detach().numpy())]
    assert moved and all(n.startswith("new.features.") and n.split(".")[2] in ("1", "5") for n in moved)


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


@pytest.mark.parametrize("first_candidate", [0, 1])
def test_fedtta_plus_plus_on_onnxruntime_matches_torch(batches, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                      first_candidate: int) -> None:
    from edge_sdk._steps import StepRunner, load_session, personalize_early_stopping

    alg = build_algorithm("FedTTA++", build_model("mlp", (1, 28, 28), 10, seed=0), 1, seed=0,
                          **{**FEDTTA_HP["mnist"]["FedTTA++"], "patience": 2, "max_steps": 8,
                             "first_candidate": first_candidate})
    state = alg.init_state(torch.float32, torch.device("cpu"))
    step = fedtta_step_spec(alg, state["params"], state["phi"])
    fwd = forward_spec(alg.model, state["params"])
    export_spec(step, tmp_path / "step.onnx")
    export_spec(fwd, tmp_path / "forward.onnx")
    psi = {n: v.numpy() for n, v in state["params"].items()}
    runner = StepRunner(load_session(tmp_path / "step.onnx"), fixed={n: v.numpy() for n, v in state["phi"].items()})
    x = batches[0]
    best_dev, stop_dev = personalize_early_stopping(runner, load_session(tmp_path / "forward.onnx"), x.numpy(), psi,
                                                    patience=2, max_steps=8, first_candidate=first_candidate)
    best_ref, stop_ref = alg.personalize_early_stopping(state["params"], state["phi"], x)
    assert stop_dev.best_step == stop_ref.best_step >= first_candidate
    assert len(stop_dev.history) == len(stop_ref.history)
    np.testing.assert_allclose(stop_dev.history, stop_ref.history, atol=1e-5)
    for n in best_dev:
        assert float(np.abs(best_dev[n] - best_ref[n].numpy()).max()) <= TOL


def test_device_step_rejects_bad_input(tmp_path: Path) -> None:
    from edge_sdk._steps import StepRunner, load_session

    alg = build_algorithm("TENT", build_model("mlp", (1, 28, 28), 10, seed=0), 1, lr=0.1)
    spec = tent_step_spec(alg, alg.init_state(torch.float32, torch.device("cpu"))["params"])
    runner = StepRunner(load_session(export_spec(spec, tmp_path / "t.onnx")))
    psi = dict(zip(runner.param_names, (w.numpy() for w in spec.example[1:])))
    good = np.zeros((2, 1, 28, 28), np.float32)
    with pytest.raises(ValueError, match="float32"):
        runner.step(good.astype(np.float64), psi)
    with pytest.raises(ValueError, match="axis 2"):
        runner.step(np.zeros((2, 1, 27, 28), np.float32), psi)
    with pytest.raises(ValueError, match="NaN or inf"):
        runner.step(np.full((2, 1, 28, 28), np.nan, np.float32), psi)
    with pytest.raises(ValueError, match="empty batch"):
        runner.step(np.zeros((0, 1, 28, 28), np.float32), psi)
    with pytest.raises(ValueError, match="4 dimensions"):
        runner.step(np.zeros((28, 28), np.float32), psi)
