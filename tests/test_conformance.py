"""The device gets what training reports: every registered method with a device path (``Algorithm.servable``) x
every architecture kind a user brings (an MLP, a batch-normalised ResNet, a depthwise-separable batch-normalised
MobileNet-style net, a GroupNorm net), trained on real Fashion-MNIST at a CI size, exported from its run directory
alone and run by the torch-free SDK (onnxruntime) on the run's new clients:

* the device's new-client accuracy, each client's whole set in one call, equals the accuracy the training run
  reported (``train(...)["test"]``, the summary ``fl-server train`` prints and ``metrics.jsonl`` holds) within
  0.1 points;
* streamed one sample at a time (batch 1) the device predicts what it predicts for the whole client.

It iterates the registry, so a method a user registers (``@register``) with a device path is held to the same
test. BTFL is checked on its received model (the global head on the frozen features graph; what training reports
for a new client without labels), which is where a batch-normalised bundle once normalised with whatever batch
the device passed."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import edge_sdk
from fl_server.export.run import export_run
from fl_server import rundir
from fl_server.algorithms import ALGORITHMS
from fl_server.recipes import DataSpec, Federation, ModelSpec, Recipe
from fl_server.recipes.run import federate, rebuild, train
from fl_server.service.hypernet import FusedHypernet



class TinyResNet(nn.Module):
    """A user's residual net at CI size: ``norm`` "bn" (nn.BatchNorm2d, converted by the recipe) or "gn"."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, norm: str = "bn") -> None:
        super().__init__()
        def norm_layer() -> nn.Module:
            return nn.BatchNorm2d(8) if norm == "bn" else nn.GroupNorm(2, 8)
        self.stem = nn.Sequential(nn.Conv2d(input_shape[0], 8, 3, stride=2, padding=1), norm_layer(), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), norm_layer(), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1), norm_layer())
        self.pool = nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.fc(self.pool(h + self.block(h)))


class TinyMobileNet(nn.Module):
    """A user's depthwise-separable, batch-normalised net at CI size (MobileNet's block)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(input_shape[0], 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU(),  # depthwise
            nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16), nn.ReLU(),  # pointwise
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


ARCHS: dict[str, Any] = {"mlp": "mlp", "bn_resnet": ModelSpec(TinyResNet, name="bn_resnet"),
                         "mobilenet_bn": ModelSpec(TinyMobileNet, name="mobilenet_bn"),
                         "gn_resnet": ModelSpec(functools.partial(TinyResNet, norm="gn"), name="gn_resnet")}
METHODS = [name for name, cls in ALGORITHMS.items() if cls.servable]
# small, fixed hyperparameters so that one short round moves every method off its initial model (ODPFL-HN's narrow
# hypernetwork at its MNIST local_lr of 0.3 blows the MLP's encoder up within two rounds on Fashion-MNIST)
HYPER = {"FedICON": {"encoder_rounds": 0, "tta_epochs": 1}, "ODPFL-HN": {"hn_width": 8, "local_lr": 0.05}}


class InProcessHypernetwork:
    """ODPFL-HN's coordinator side for the device, in this process: the run's hypernetwork f_theta, fused as the
    coordinator serves it (``fl_server.service.hypernet``), turning the device's embedding into weights."""

    def __init__(self, run_dir: Path, recipe: Recipe) -> None:
        _, _, algorithm = rebuild(rundir.read_run(run_dir), recipe=recipe)
        theta = {k: torch.from_numpy(v) for k, v in rundir.best_arrays(run_dir, "hn").items()}
        self.net = FusedHypernet(algorithm, theta)

    def generate(self, embedding: np.ndarray, bundle_id: str) -> dict[str, np.ndarray]:
        """The run's own hypernetwork (``bundle_id``, the device's bundle, names it already)."""
        return self.net.split(self.net(np.asarray(embedding, np.float32)[None])[0])


def _recipe(arch: str, method: str, data_root: Path) -> Recipe:
    return Recipe(model=ARCHS[arch], data=DataSpec.builtin("fashion_mnist", str(data_root)), method=method,
                  federation=Federation(partition="dirichlet", alpha=1.0, num_clients=6, new_fraction=0.34,
                                        max_samples=900),
                  rounds=2, local_iterations=8, batch_size=32, hyper=HYPER.get(method, {}))


def _device_accuracies(bundle: Path, run_dir: Path, recipe: Recipe, method: str,
                       received: bool) -> tuple[float, float]:
    """(whole client, one sample at a time): the mean over new clients of the device's accuracy; ``received``:
    of the model a device receives (``method="none"``), where training says it scored that one."""
    fed = federate(recipe, 0)
    client = InProcessHypernetwork(run_dir, recipe) if ALGORITHMS[method].device_step == "encoder" else None
    whole, single = [], []
    for idx in fed.new:
        x, y = fed.dataset.x[idx], fed.dataset.y[idx]
        device = edge_sdk.open_bundle(bundle, client=client, method="none" if received else None)  # type: ignore[arg-type]
        device.personalize(x)
        whole.append(float((device.predict(x).argmax(1) == y).mean()))
        single.append(float((np.stack(list(device.stream(x))).argmax(1) == y).mean()))
    return 100 * float(np.mean(whole)), 100 * float(np.mean(single))


CELLS = [(m, a) for m in METHODS for a in ARCHS]  # every cell, in CI too (about 4 minutes on 2 cores)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "arch"), CELLS)
def test_device_gets_what_training_reports(method: str, arch: str, data_root: Path, tmp_path: Path) -> None:
    recipe = _recipe(arch, method, data_root)
    record = train(recipe, tmp_path / "run", progress=False, device="cpu", data_root=str(data_root))
    bundle = export_run(tmp_path / "run", tmp_path / "bundle", recipe=recipe)
    # what training scored, as its record says: the received model only where a device personalises on labels
    assert record["test_of"] == ("received" if ALGORITHMS[method].device_labels else "device")
    rule = edge_sdk.load_bundle(bundle).safeguard
    assert record["safeguard"] == (None if rule is None else rule.name)  # the rule its devices apply
    whole, single = _device_accuracies(bundle, tmp_path / "run", recipe, method, record["test_of"] == "received")
    assert abs(whole - record["test"]) <= 0.1, (method, arch, whole, record["test"])
    assert abs(single - whole) <= 0.1, (method, arch, single, whole)
