"""Edge architectures for the zoo: a ResNet-8 (BatchNorm or GroupNorm) and a MobileNetV2-style stack.

- ``resnet8_bn``: conv3x3(16)-BN-ReLU, three basic blocks (16, 32, 64 channels, strides 1, 2, 2; two conv3x3-norm
  each, residual addition, a strided 1x1 conv-norm shortcut where the shape changes), global average pooling
  (He et al. 2016's CIFAR ResNets at depth 8: 1 + 3 x 2 convolutions + the head).
- ``resnet8_gn``: the same with GroupNorm (4 groups) in place of BatchNorm, a grouped 3x3 convolution
  (2 groups) in the last block and LayerNorm on the pooled features -- the batch-independent normalisations.
- ``mobilenet_s``: a MobileNetV2-style stack (Sandler et al. 2018): conv3x3 stride 2, inverted residual blocks
  (1x1 expand - depthwise 3x3 - 1x1 project, BatchNorm after each, ReLU6, residual addition where the stride is
  1 and the width stays), 1x1 conv to 64, global average pooling.
Every layer is an ordinary torch module except :class:`StatBatchNorm2d` (BatchNorm whose statistics live outside
the functional state, :mod:`fl_server.models.norm`), so the same code paths serve users' own modules.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fl_server.models.norm import StatBatchNorm2d

InputShape = tuple[int, int, int]
Norm = Callable[[int], nn.Module]


class Residual(nn.Module):
    """``body(x) + shortcut(x)`` (identity shortcut when ``shortcut`` is None), then ``post``."""

    def __init__(self, body: nn.Module, shortcut: nn.Module | None = None, post: nn.Module | None = None) -> None:
        super().__init__()
        self.body = body
        self.shortcut = shortcut if shortcut is not None else nn.Identity()
        self.post = post if post is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.body(x) + self.shortcut(x))


def _basic_block(c_in: int, c_out: int, stride: int, norm: Norm, groups: int = 1) -> Residual:
    body = nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), norm(c_out), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, 1, 1, groups=groups, bias=False), norm(c_out))
    shortcut = None
    if stride != 1 or c_in != c_out:
        shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm(c_out))
    return Residual(body, shortcut, nn.ReLU())


def _resnet8(input_shape: InputShape, norm: Norm, last_groups: int = 1, pooled_norm: bool = False,
             widths: tuple[int, int, int] = (16, 32, 64)) -> tuple[nn.Module, int]:
    a, b, c = widths
    layers: list[nn.Module] = [
        nn.Conv2d(input_shape[0], a, 3, 1, 1, bias=False), norm(a), nn.ReLU(),
        _basic_block(a, a, 1, norm), _basic_block(a, b, 2, norm), _basic_block(b, c, 2, norm, last_groups),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    ]
    if pooled_norm:
        layers.append(nn.LayerNorm(c))
    return nn.Sequential(*layers), c


def resnet8_bn(input_shape: InputShape) -> tuple[nn.Module, int]:
    return _resnet8(input_shape, StatBatchNorm2d)


def resnet8_gn(input_shape: InputShape) -> tuple[nn.Module, int]:
    return _resnet8(input_shape, lambda ch: nn.GroupNorm(4, ch), last_groups=2, pooled_norm=True)


def _inverted_residual(c_in: int, c_out: int, stride: int, expand: int) -> nn.Module:
    hidden = c_in * expand
    body = nn.Sequential(
        nn.Conv2d(c_in, hidden, 1, bias=False), StatBatchNorm2d(hidden), nn.ReLU6(),
        nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), StatBatchNorm2d(hidden), nn.ReLU6(),
        nn.Conv2d(hidden, c_out, 1, bias=False), StatBatchNorm2d(c_out),
    )
    return Residual(body) if stride == 1 and c_in == c_out else body


def mobilenet_s(input_shape: InputShape) -> tuple[nn.Module, int]:
    layers = nn.Sequential(
        nn.Conv2d(input_shape[0], 16, 3, 2, 1, bias=False), StatBatchNorm2d(16), nn.ReLU6(),
        _inverted_residual(16, 16, 1, 2), _inverted_residual(16, 24, 2, 3), _inverted_residual(24, 24, 1, 3),
        nn.Conv2d(24, 64, 1, bias=False), StatBatchNorm2d(64), nn.ReLU6(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )
    return layers, 64
