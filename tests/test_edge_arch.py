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

from fl_server.export import export_spec, fedtta_step_spec, forward_spec, tent_step_spec
from fl_server.algorithms import build_algorithm
from fl_server.recipes.presets import FEDTTA_HP
from fl_server.functional import make_forward
from fl_server.models import Classifier, build_model
from fl_server.models.norm import calibrate, stat_norms

TOL = 1e-5
SIZES = (1, 17, 64)


@pytest.fixture(autouse=True)
def _one_thread():  # type: ignore[no-untyped-def]
    """One thread on both sides, as on a device: with several, torch and onnxruntime split a batch-64 weight
    gradient's sums differently and the float32 results differ by a few 1e-5."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def _check(spec, path: Path, batches, momenta=(None,), extra=None, tol: float = TOL) -> None:  # type: ignore[no-untyped-def]
    """``extra``: per batch, the graph's second batch input (FedICON's uniforms ``u``), fed after ``x``."""
    export_spec(spec, path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == spec.input_names
    for m in momenta:
        rest = list(spec.example[1 if extra is None else 2:])
        if m is not None:
            rest[-1] = torch.tensor(m)
        for i, x in enumerate(batches):
            inputs = [x, *([] if extra is None else [extra[i]]), *rest]
            feeds = dict(zip(spec.input_names, [v.detach().numpy() for v in inputs]))
            got = session.run(spec.output_names, feeds)
            want = spec.fn(*inputs)
            for name, g, w in zip(spec.output_names, got, want):
                np.testing.assert_allclose(g, w.detach().numpy(), rtol=tol, atol=tol,
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


@pytest.mark.parametrize("c_in,c_out,groups,kernel,stride,padding,dilation,size", [
    (4, 6, 1, 3, 1, 1, 1, 9), (4, 4, 4, 3, 2, 1, 1, 9), (6, 9, 3, 3, 2, 0, 1, 10), (8, 8, 8, 5, 1, 2, 2, 11),
    (4, 8, 2, 1, 1, 0, 1, 7), (3, 6, 3, 3, 2, 1, 1, 8),
    (16, 4, 1, 3, 1, 1, 1, 24), (8, 4, 1, 3, 2, 1, 1, 24),  # dense inputs past _OFFSET_INPUT_ELEMENTS: by convolution
])
def test_convolution_backward_decomposition(c_in, c_out, groups, kernel, stride, padding, dilation, size) -> None:  # type: ignore[no-untyped-def]
    """Dense (per offset, and by convolution for larger inputs), depthwise and grouped convolutions, strided, padded,
    dilated, 1x1: the decomposition's three gradients equal autograd's (float64)."""
    from fl_server.export.decompositions import convolution_backward

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, c_in, size, size, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(c_out, c_in // groups, kernel, kernel, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(c_out, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.nn.functional.conv2d(x, w, b, stride, padding, dilation, groups)
    gy = torch.randn(y.shape, dtype=torch.float64, generator=g)
    want = torch.autograd.grad(y, (x, w, b), gy)
    got = convolution_backward(gy, x.detach(), w.detach(), None, [stride] * 2, [padding] * 2, [dilation] * 2,
                               False, [0, 0], groups, [True, True, True])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape,kernel,stride", [
    ((3, 4, 8, 6), [2, 2], [2, 2]), ((2, 3, 9, 6), [3], []), ((2, 3, 8, 9), [2, 3], [2, 3]),
])
def test_max_pool_backward_decomposition(shape, kernel, stride) -> None:  # type: ignore[no-untyped-def]
    """Tiling windows (square or not, stride given or defaulted): the gradient goes where autograd sends it, ties
    (many, from rounding ReLU outputs) to the first maximum of a window; overlapping windows are left to the
    exporter."""
    from fl_server.export.decompositions import max_pool2d_with_indices_backward

    g = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(shape, generator=g)).round().requires_grad_(True)
    y, indices = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride)
    gy = torch.randn(y.shape, generator=g)
    want = torch.autograd.grad(y, x, gy)[0]
    got = max_pool2d_with_indices_backward(gy, x.detach(), kernel, stride, [0, 0], [1, 1], False, indices)
    assert torch.equal(got, want)
    x = torch.randn(2, 3, 7, 7, generator=g)
    y, indices = torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2])
    assert max_pool2d_with_indices_backward(y, x, [3, 3], [2, 2], [0, 0], [1, 1], False, indices) is NotImplemented


@pytest.mark.parametrize("model_name", ["resnet8_bn", "mobilenet_s", "resnet8_gn"])
def test_edge_models_train_under_vmap_and_grad(model_name: str, fashion_batches) -> None:  # type: ignore[no-untyped-def]
    """The engine's local step (vmapped over clients, functional grad) runs on each model and lowers the loss."""
    from fl_server.functional import broadcast, get_params, sgd

    calib, _ = fashion_batches
    model = build_model(model_name, (1, 28, 28), 10, seed=0)
    forward = make_forward(model)
    y = torch.from_numpy(np.arange(32) % 10)
    xs = torch.stack([calib[:32], calib[32:64]])

    def loss(p, x):  # type: ignore[no-untyped-def]
        return torch.nn.functional.cross_entropy(forward(p, x), y)

    params = broadcast(get_params(model), 2)
    before = torch.func.vmap(loss)(params, xs)
    for _ in range(3):
        params = sgd(params, torch.func.vmap(torch.func.grad(loss))(params, xs), 0.05)
    assert (torch.func.vmap(loss)(params, xs) < before).all()


def test_norm_affine_covers_batch_group_and_layer_norm() -> None:
    from fl_server.algorithms.tent import norm_affine_names

    gn = norm_affine_names(build_model("resnet8_gn", (1, 28, 28), 10, seed=0))
    assert "features.1.weight" in gn and "features.8.bias" in gn  # first GroupNorm, the pooled LayerNorm
    assert len(norm_affine_names(build_model("mobilenet_s", (1, 28, 28), 10, seed=0))) == 2 * 11
    with pytest.raises(ValueError, match="needs a model with affine normalisation layers"):
        build_algorithm("TENT", build_model("convnet", (1, 28, 28), 10, seed=0), 1, adapt="norm_affine")


def test_convert_batchnorm_keeps_torch_semantics() -> None:
    """A user's nn.BatchNorm2d becomes a StatBatchNorm2d: train mode = batch statistics, population mode = the
    running statistics it had (eval mode)."""
    from torch import nn

    from fl_server.models.norm import StatBatchNorm2d, convert_batchnorm, norm_mode

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    for _ in range(3):
        net(torch.randn(8, 1, 6, 6) * 2 + 1)  # running statistics move away from (0, 1)
    x = torch.randn(5, 1, 6, 6)
    train_out = net(x)  # (moves the running statistics once more)
    net.eval()
    eval_out = net(x)
    converted = convert_batchnorm(net)
    assert isinstance(converted[1], StatBatchNorm2d)
    torch.testing.assert_close(converted(x), train_out)
    with norm_mode(converted, "population"):
        torch.testing.assert_close(converted(x), eval_out)
    with pytest.raises(ValueError, match=r"BatchNorm2d\(affine=False\) is not supported"):
        convert_batchnorm(nn.BatchNorm2d(3, affine=False))


def test_client_statistics_federated_and_local(fashion_batches) -> None:  # type: ignore[no-untyped-def]
    from fl_server.functional import get_params
    from fl_server.models.norm import client_statistics, statistics

    calib, _ = fashion_batches
    model = build_model("resnet8_bn", (1, 28, 28), 10, seed=0)
    params, forward = get_params(model), make_forward(model)
    run = lambda xb: forward(params, xb)  # noqa: E731
    clients = [[calib[:40]], [calib[40:100], calib[100:130]]]
    local = client_statistics(model, run, clients, how="local")
    federated = client_statistics(model, run, clients)
    calibrate(model, run, [calib[:40], calib[40:100], calib[100:130]])
    union = statistics(model)
    for name, value in union.items():
        torch.testing.assert_close(federated[0][name], value)
        torch.testing.assert_close(federated[1][name], value)
    assert not torch.allclose(local[0]["features.1.mean"], local[1]["features.1.mean"])
    with pytest.raises(ValueError, match="unknown statistics 'fedbn'"):
        client_statistics(model, run, clients, how="fedbn")


def _every_feature_net() -> Classifier:
    """A small net with every feature of docs/edge-architectures.md's coverage table, so one export per method
    covers all of them: a strided padded convolution, BatchNorm, a residual block with a depthwise and a
    grouped 1x1 convolution under GroupNorm, global average pooling, LayerNorm on the pooled features."""
    from torch import nn

    from fl_server.models.edge import Residual
    from fl_server.models.norm import StatBatchNorm2d

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        features = nn.Sequential(
            nn.Conv2d(1, 8, 3, 2, 1, bias=False), StatBatchNorm2d(8), nn.ReLU6(),
            Residual(nn.Sequential(nn.Conv2d(8, 8, 3, 1, 1, groups=8, bias=False), nn.GroupNorm(2, 8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 1, groups=2), StatBatchNorm2d(8)), post=nn.ReLU()),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(8),
        )
        return Classifier(features, 8, 10, (1, 28, 28))


def test_tent_all_weights_and_fedicon_step_parity(fashion_batches, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The coverage table's TENT (all weights) and FedICON step columns: both steps on a net with every feature
    match torch within 1e-5 (FedICON's, 2e-5) at batch 1, 17 and 64, at both ends of the bn_momentum rule (population and
    test-batch statistics)."""
    from fl_server.export.fedicon import fedicon_tta_step_spec
    from fl_server.data.augment import hash_uniform, num_uniforms
    from fl_server.functional import get_params

    calib, batches = fashion_batches
    model = _every_feature_net()
    params = get_params(model)
    forward = make_forward(model)
    calibrate(model, lambda xb: forward(params, xb), calib.split(64))
    tent = build_algorithm("TENT", model, 1, seed=0, adapt="all", tent_lr=0.5)
    spec = tent_step_spec(tent, params)
    _check(spec, tmp_path / "tent.onnx", batches, (0.0, 1.0))
    assert spec.output_names[:len(params)] == [f"new.{n}" for n in params]

    fedicon = build_algorithm("FedICON", model, 1, seed=0, tta_lr=0.5)
    state = fedicon.init_state(torch.float32, torch.device("cpu"))
    spec = fedicon_tta_step_spec(fedicon, state["params"], state["proj"])
    uniforms = [hash_uniform(torch.tensor(i), 2 * len(x), num_uniforms(x.shape[1:])).reshape(len(x), 2, -1)
                for i, x in enumerate(batches)]
    # Eq. 7's step at lr 0.5 through two resampled views amplifies float32 rounding: the updated model's logits
    # agree within 2e-5
    _check(spec, tmp_path / "fedicon.onnx", batches, (0.0, 1.0), extra=uniforms, tol=2e-5)
