"""Model zoo: every classifier is ``features`` (x -> post-ReLU z, shape [N, D]) followed by a linear ``head``.

Architectures follow the papers (cited in the method modules, :mod:`fl_server.algorithms`):
- ``mlp``: UPFL's MNIST model, 2 hidden layers of 200 units.
- ``convnet``: McMahan et al. (2017) CNN, conv5x5(32)-pool-conv5x5(64)-pool-FC512-head. UPFL App. G calls
  this the *medium* model; ``convnet_small`` / ``convnet_big`` use 16-32 / 64-128 channels.
- ``btfl_cnn``: BTFL's simple CNN, conv32-conv64 (k5, no padding) + FC64 + FC64 (D = 64), ReLU before the head.
- ``btfl_cnn_bn``: the same with batch normalisation after each convolution (:mod:`fl_server.models.norm`: the
  statistics live outside the functional state), as the CNNs of FedICON's and FedBN's Digit-5 experiments.
- ``resnet8_bn``, ``resnet8_gn``, ``mobilenet_s``: edge architectures (:mod:`fl_server.models.edge`: residual
  blocks, depthwise and grouped convolutions, BatchNorm / GroupNorm / LayerNorm, global average pooling).
- ``mlp_2x512``: MAP's MLPNet; ``lenet``: LeNet-5 style (MAP).
- :class:`AdaptationMLP`: FedTTA's adaptation model g, C -> w -> w -> w -> 1.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from fl_server.models.edge import mobilenet_s, resnet8_bn, resnet8_gn
from fl_server.models.norm import StatBatchNorm2d

InputShape = tuple[int, int, int]  # (C, H, W)


class Classifier(nn.Module):
    """``forward(x) = head(features(x))``; ``feature_dim`` is the width of ``features``' output."""

    def __init__(self, features: nn.Module, feature_dim: int, num_classes: int,
                 input_shape: InputShape | None = None, arch: str | None = None,
                 head: nn.Linear | None = None) -> None:
        """``head``: a linear head to use (a user's model's own, see :mod:`fl_server.recipes.model`);
        default: a fresh ``nn.Linear(feature_dim, num_classes)``."""
        super().__init__()
        self.input_shape = input_shape
        self.arch = arch  # zoo name, e.g. "convnet" (set by build_model); None for a recipe's own model
        self.features = features
        self.head = head if head is not None else nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _mlp_features(input_shape: InputShape, widths: Sequence[int]) -> tuple[nn.Module, int]:
    in_dim = input_shape[0] * input_shape[1] * input_shape[2]
    layers: list[nn.Module] = [nn.Flatten()]
    for width in widths:
        layers += [nn.Linear(in_dim, width), nn.ReLU()]
        in_dim = width
    return nn.Sequential(*layers), in_dim


def _flat_dim(features: nn.Module, input_shape: InputShape) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *input_shape)).shape[1])


def _convnet_features(input_shape: InputShape, channels: tuple[int, int], fc: int) -> tuple[nn.Module, int]:
    c1, c2 = channels
    conv = nn.Sequential(
        nn.Conv2d(input_shape[0], c1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
    )
    flat = _flat_dim(conv, input_shape)
    return nn.Sequential(*conv, nn.Linear(flat, fc), nn.ReLU()), fc


def _btfl_features(input_shape: InputShape) -> tuple[nn.Module, int]:
    conv = nn.Sequential(
        nn.Conv2d(input_shape[0], 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
    )
    flat = _flat_dim(conv, input_shape)
    return nn.Sequential(*conv, nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU()), 64


def _btfl_bn_features(input_shape: InputShape) -> tuple[nn.Module, int]:
    conv = nn.Sequential(
        nn.Conv2d(input_shape[0], 32, 5), StatBatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), StatBatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
    )
    flat = _flat_dim(conv, input_shape)
    return nn.Sequential(*conv, nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU()), 64


def _lenet_features(input_shape: InputShape) -> tuple[nn.Module, int]:
    conv = nn.Sequential(
        nn.Conv2d(input_shape[0], 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
    )
    flat = _flat_dim(conv, input_shape)
    return nn.Sequential(*conv, nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU()), 84


_FEATURES: dict[str, Callable[[InputShape], tuple[nn.Module, int]]] = {
    "mlp": lambda s: _mlp_features(s, (200, 200)),
    "mlp_2x512": lambda s: _mlp_features(s, (512, 512)),
    "convnet": lambda s: _convnet_features(s, (32, 64), 512),
    "convnet_small": lambda s: _convnet_features(s, (16, 32), 512),
    "convnet_big": lambda s: _convnet_features(s, (64, 128), 512),
    "btfl_cnn": _btfl_features,
    "btfl_cnn_bn": _btfl_bn_features,
    "lenet": _lenet_features,
    "resnet8_bn": resnet8_bn,
    "resnet8_gn": resnet8_gn,
    "mobilenet_s": mobilenet_s,
}
MODELS: tuple[str, ...] = tuple(_FEATURES)


def build_model(name: str, input_shape: InputShape, num_classes: int, seed: int | None = None) -> Classifier:
    """Build a classifier by name for inputs ``[N, *input_shape]``; ``seed`` fixes the initial weights
    without touching the global torch RNG."""
    if name not in _FEATURES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        features, dim = _FEATURES[name](tuple(input_shape))  # type: ignore[arg-type]
        return Classifier(features, dim, num_classes, tuple(input_shape), name)  # type: ignore[arg-type]


class AdaptationMLP(nn.Module):
    """FedTTA adaptation model g: logits [N, C] -> per-sample scalar [N] (C -> w -> w -> w -> 1, ReLU)."""

    def __init__(self, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(num_classes, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, 1),
        )

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return self.net(logits).squeeze(-1)
