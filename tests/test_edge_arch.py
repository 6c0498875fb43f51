"""Edge architectures on the device (issue #34): a ResNet-8 with BatchNorm, a MobileNetV2-style stack (depthwise
+ pointwise + residual) and a ResNet-8 with GroupNorm / LayerNorm / a grouped convolution. The exported forward
and one step of each device method (TENT over all weights, the original TENT over the normalisation affine
parameters, FedTTA) match torch within 1e-5 (float32, onnxruntime CPU) at batch 1, 17 and 64 on real
Fashion-MNIST; BatchNorm graphs under both ends of the ``bn_momentum`` rule (population and test-batch statistics)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export import export_spec, fedtta_step_spec, forward_spec, tent_step_spec
from fl_server.algorithms import build_algorithm
from fl_server.algorithms.fedtta import FEDTTA_HP
from fl_server.functional import make_forward
from fl_server.models import build_model
from fl_server.models.norm import calibrate, stat_norms

TOL = 1e-5
SIZES = (1, 17, 64)


@pytest.fixture(scope="module")
def fashion_batches(fashion_all):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    idx = rng.choice(len(fashion_all), sum(SIZES) + 256, replace=False)
    x = torch.from_numpy(fashion_all.x[idx])
    out, start = [], 256
    for n in SIZES:
        out.append(x[start:start + n])
        start += n
    return x[:256], out


def _algorithm(model_name: str, method: str, calib: torch.Tensor, **hp):  # type: ignore[no-untyped-def]
    model = build_model(model_name, (1, 28, 28), 10, seed=0)
    alg = build_algorithm(method, model, 1, seed=0, **hp)
    state = alg.init_state(torch.float32, torch.device("cpu"))
    if stat_norms(model):
        forward = make_forward(model)
        calibrate(model, lambda xb: forward(state["params"], xb), calib.split(64))
    return alg, state


def _check(spec, path: Path, batches, momenta=(None,)) -> None:  # type: ignore[no-untyped-def]
    export_spec(spec, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == spec.input_names
    for m in momenta:
        rest = list(spec.example[1:])
        if m is not None:
            rest[-1] = torch.tensor(m)
        for x in batches:
            feeds = dict(zip(spec.input_names, [x.numpy(), *(w.detach().numpy() for w in rest)]))
            got = session.run(spec.output_names, feeds)
            want = spec.fn(x, *rest)
            for name, g, w in zip(spec.output_names, got, want):
                np.testing.assert_allclose(g, w.detach().numpy(), rtol=TOL, atol=TOL,
                                           err_msg=f"{name} at batch {len(x)}, bn_momentum {m}")


@pytest.mark.slow  # nine graph exports: about 20-60 s each on a shared 2-core CPU
@pytest.mark.parametrize("model_name", ["resnet8_bn", "mobilenet_s", "resnet8_gn"])
def test_forward_tent_and_fedtta_parity(model_name: str, fashion_batches, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The frozen forward (population statistics), TENT's step (the original: normalisation affine parameters)
    and FedTTA's step (every weight, UPFL Eq. 5); BatchNorm steps at both ends of the bn_momentum rule."""
    calib, batches = fashion_batches
    has_bn = model_name != "resnet8_gn"
    momenta = (0.0, 1.0) if has_bn else (None,)
    tent, state = _algorithm(model_name, "TENT", calib, adapt="norm_affine", tent_lr=0.5)
    forward = forward_spec(tent.model, state["params"])
    assert ("bn_momentum" in forward.input_names) == has_bn
    _check(forward, tmp_path / "forward.onnx", batches, (0.0,) if has_bn else (None,))
    _check(tent_step_spec(tent, state["params"]), tmp_path / "tent.onnx", batches, momenta)
    fedtta, state = _algorithm(model_name, "FedTTA", calib, **FEDTTA_HP["mnist"]["FedTTA"])
    _check(fedtta_step_spec(fedtta, state["params"], state["phi"]), tmp_path / "fedtta.onnx", batches, momenta)
