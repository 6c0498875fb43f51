"""Convolutions as patch extraction plus one matrix multiply, for clients stepped together under ``vmap``.

Under ``torch.vmap`` over K clients, each with its own weights, a convolution becomes one grouped convolution
with K groups. On a GPU that is what a vmapped ConvNet round spends its time in: cuDNN's grouped kernels, their
layout transposes and, for single-channel inputs, the depthwise fallback took about 80% of the GPU time of a
UPFL Fashion-MNIST FedTTA round (docs/research/gpu-engine.md). Written as ``unfold`` (im2col) and a matrix
product, the same convolution is K independent matrix products, one batched GEMM:

    out[n, o, l] = sum_j W[o, j] * cols[n, j, l],   cols = unfold(x) in R^{N x (C kh kw) x L},  L = H_out W_out

The first and second derivatives are those of ``unfold`` (``fold``) and of the product, so FedTTA's second-order
meta-step goes through unchanged. :class:`GemmConv` routes ``torch.conv2d`` (what ``nn.Conv2d`` calls) to
:func:`conv2d_gemm` while it is active; grouped convolutions and string paddings keep the native kernel.

Example::

    with GemmConv():
        states = torch.vmap(step, in_dims=(0, None, 0, 0))(states, server, x, y)
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_Pair = int | tuple[int, int]


def _pair(v: _Pair) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv2d_gemm(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: _Pair = 1,
                padding: _Pair | str = 0, dilation: _Pair = 1, groups: int = 1) -> torch.Tensor:
    """``torch.conv2d`` computed as ``unfold`` plus a matrix product (same arguments, same result up to rounding);
    grouped convolutions and string paddings ("same", "valid") use ``torch.conv2d`` itself."""
    if groups != 1 or isinstance(padding, str):
        return torch.conv2d(input, weight, bias, stride, padding, dilation, groups)
    unbatched = input.dim() == 3
    x = input.unsqueeze(0) if unbatched else input
    n, _, h, w = x.shape
    out_ch, _, kh, kw = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    h_out = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    w_out = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    cols = F.unfold(x, (kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))  # [N, C kh kw, L]
    out = torch.matmul(weight.reshape(out_ch, -1), cols).reshape(n, out_ch, h_out, w_out)
    if bias is not None:
        out = out + bias.reshape(1, out_ch, 1, 1)
    return out.squeeze(0) if unbatched else out


class GemmConv(TorchFunctionMode):
    """While active, ``torch.conv2d`` / ``F.conv2d`` calls (``nn.Conv2d`` included) run :func:`conv2d_gemm`.

    The convolutions keep the precision torch gives convolutions: while the mode is active, CUDA matrix products
    may use TF32 exactly where cuDNN's convolutions may (``torch.backends.cudnn.allow_tf32``, torch's default: on),
    so that the GEMM form is not held to full float32 where the native kernels are not. The switch is global for
    the duration (the round's dense layers follow it too) and restored on exit; ``tf32`` overrides it. It has no
    effect on float64 or on the CPU."""

    def __init__(self, tf32: bool | None = None) -> None:
        super().__init__()
        self.tf32 = tf32
        self._saved: list[bool] = []

    def __enter__(self) -> "GemmConv":
        self._saved.append(torch.backends.cuda.matmul.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 if self.tf32 is None else self.tf32
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.backends.cuda.matmul.allow_tf32 = self._saved.pop()
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.conv2d:  # F.conv2d is the same builtin
            return conv2d_gemm(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
