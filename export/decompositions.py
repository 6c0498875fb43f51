"""Decompositions that let gradient-step graphs of ConvNets lower to ONNX.

``aten.convolution_backward`` has no ONNX lowering. For a 2-D, non-transposed convolution
y = conv2d(x, W, b; stride s, padding p, dilation d, groups 1):
  dL/dx = conv_transpose2d(dL/dy, W; s, p, output_padding, d)     (output_padding restores x's size)
  dL/dW = conv2d(x^T, (dL/dy)^T; stride d, padding p, dilation s)^T, cropped to W's kernel size
          (x^T: batch and channel axes swapped, so the batch sum becomes the convolution's channel sum)
  dL/db = sum of dL/dy over batch and space
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def convolution_backward(
    grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, bias_sizes: Any,
    stride: list[int], padding: list[int], dilation: list[int], transposed: bool, output_padding: list[int],
    groups: int, output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    if transposed or groups != 1 or input.dim() != 4:
        raise NotImplementedError("only 2-D, non-transposed, groups=1 convolutions are decomposed")
    grad_input = grad_weight = grad_bias = None
    kh, kw = weight.shape[2], weight.shape[3]
    if output_mask[0]:
        out_pad = [
            input.shape[2 + i] - ((grad_output.shape[2 + i] - 1) * stride[i] - 2 * padding[i]
                                  + dilation[i] * (weight.shape[2 + i] - 1) + 1)
            for i in range(2)
        ]
        grad_input = F.conv_transpose2d(grad_output, weight, stride=stride, padding=padding,
                                        output_padding=out_pad, dilation=dilation)
    if output_mask[1]:
        gw = F.conv2d(input.transpose(0, 1), grad_output.transpose(0, 1), stride=dilation, padding=padding,
                      dilation=stride)
        grad_weight = gw.transpose(0, 1)[:, :, :kh, :kw]
    if output_mask[2]:
        grad_bias = grad_output.sum(dim=(0, 2, 3))
    return grad_input, grad_weight, grad_bias


DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {aten.convolution_backward.default: convolution_backward}
