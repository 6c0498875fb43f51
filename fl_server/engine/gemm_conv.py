"""Convolutions as patch extraction plus one matrix multiply, for clients stepped together under ``vmap``.

Under ``torch.vmap`` over K clients, each with its own weights, a convolution becomes one grouped convolution
with K groups. On a GPU that is what a vmapped ConvNet round spends its time in: cuDNN's grouped kernels, their
layout transposes and, for single-channel inputs, the depthwise fallback took about 80% of the GPU time of a
UPFL Fashion-MNIST FedTTA round (docs/research/gpu-engine.md). Written as patches and a matrix product, the same
convolution is K independent matrix products, one batched GEMM:

    out[n, o, u, v] = sum_{c,i,j} W[o, c, i, j] * P[n, u, v, i, j, c],
    P[n, u, v, i, j, c] = input_padded[n, c, u s + i d, v s + j d]   (stride s, dilation d)

``P`` is gathered from the (padded) input by one ``index_select`` over its flattened pixels, channels last, so
that the patch matrix is built by one kernel whatever the batch and its gradient by one ``index_add``, both with
vmap batching rules. (``F.unfold``, im2col, is not used: its CUDA kernel loops over the batch, one launch per
image and one per image again for its gradient, ``col2im``; on a Fashion-MNIST round of 50 clients x 64 images
that made 5.5 times as many kernels as the grouped convolutions. ``Tensor.unfold``'s gradient has no vmap
batching rule and would loop over the clients.) The first and second derivatives are those of the gather and of
the product, so FedTTA's second-order meta-step goes through unchanged. :class:`GemmConv` routes ``torch.conv2d``
(what ``nn.Conv2d`` calls) to :func:`conv2d_gemm` while it is active; grouped convolutions, string paddings and
arguments torch refuses keep the native kernel (which raises torch's error for the latter).

Example::

    with GemmConv():
        states = torch.vmap(step, in_dims=(0, None, 0, 0))(states, server, x, y)
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_Pair = int | tuple[int, int]


def _pair(v: _Pair) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    return (int(v[0]), int(v[0])) if len(v) == 1 else (int(v[0]), int(v[1]))


def _patch_index(h: int, w: int, kh: int, kw: int, stride: tuple[int, int], dilation: tuple[int, int],
                 device: torch.device) -> tuple[torch.Tensor, int, int]:
    """Flat pixel indices of every output position's patch of an h x w image, ordered [H_out, W_out, kh, kw].

    A constant of the shapes, cached and built outside any functorch transform (``vmap``, ``grad``), so that the
    cached tensor is a plain one wherever it is used next. Not cached while a CUDA graph is being captured (the
    tensor would be recorded, not computed, and live in the graph's pool) or under inference mode (an inference
    tensor cannot be saved for a later backward); the cache is unbounded, so a captured graph never reads an
    evicted index (a model has a handful of convolution shapes)."""
    if torch.is_inference_mode_enabled() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return _patch_index_plain(h, w, kh, kw, stride, dilation, device)
    return _cached_patch_index(h, w, kh, kw, stride, dilation, device)


@functools.cache
def _cached_patch_index(h: int, w: int, kh: int, kw: int, stride: tuple[int, int], dilation: tuple[int, int],
                        device: torch.device) -> tuple[torch.Tensor, int, int]:
    with torch._C._DisableFuncTorch():
        return _patch_index_plain(h, w, kh, kw, stride, dilation, device)


def _patch_index_plain(h: int, w: int, kh: int, kw: int, stride: tuple[int, int], dilation: tuple[int, int],
                       device: torch.device) -> tuple[torch.Tensor, int, int]:
    (sh, sw), (dh, dw) = stride, dilation
    h_out, w_out = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    rows = (torch.arange(h_out, device=device) * sh).view(-1, 1, 1, 1) \
        + (torch.arange(kh, device=device) * dh).view(1, 1, -1, 1)
    cols = (torch.arange(w_out, device=device) * sw).view(1, -1, 1, 1) \
        + (torch.arange(kw, device=device) * dw).view(1, 1, 1, -1)
    return (rows * w + cols).reshape(-1), h_out, w_out


def _gemm_form_applies(input: torch.Tensor, weight: torch.Tensor, padding: _Pair | str, stride: _Pair,
                       dilation: _Pair, groups: int) -> bool:
    """Whether :func:`conv2d_gemm` computes this call itself: an ungrouped convolution with numeric padding whose
    arguments torch accepts (the rest go to ``torch.conv2d``, which computes them or raises its own error)."""
    if groups != 1 or isinstance(padding, str) or input.dim() not in (3, 4) or weight.dim() != 4 \
            or weight.shape[1] != input.shape[-3]:
        return False
    (ph, pw), (sh, sw), (dh, dw) = _pair(padding), _pair(stride), _pair(dilation)
    kh, kw = weight.shape[-2:]
    return min(ph, pw) >= 0 and min(sh, sw, dh, dw) >= 1 and input.shape[-2] + 2 * ph >= dh * (kh - 1) + 1 \
        and input.shape[-1] + 2 * pw >= dw * (kw - 1) + 1


def conv2d_gemm(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: _Pair = 1,
                padding: _Pair | str = 0, dilation: _Pair = 1, groups: int = 1) -> torch.Tensor:
    """``torch.conv2d`` computed as gathered patches plus a matrix product (same arguments, same result up to
    rounding); grouped convolutions, string paddings ("same", "valid") and arguments torch refuses (an empty output,
    negative padding, stride or dilation below 1, weights of other input channels) go to ``torch.conv2d`` itself."""
    if not _gemm_form_applies(input, weight, padding, stride, dilation, groups):
        return torch.conv2d(input, weight, bias, stride, padding, dilation, groups)
    out_ch, _, kh, kw = weight.shape
    (ph, pw), (sh, sw), (dh, dw) = _pair(padding), _pair(stride), _pair(dilation)
    h, w = input.shape[-2] + 2 * ph, input.shape[-1] + 2 * pw
    unbatched = input.dim() == 3
    x = input.unsqueeze(0) if unbatched else input
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    n, c = x.shape[:2]
    index, h_out, w_out = _patch_index(h, w, kh, kw, (sh, sw), (dh, dw), x.device)
    pixels = x.reshape(n, c, h * w).transpose(1, 2)  # [N, H W, C]
    cols = pixels.index_select(1, index).reshape(n, h_out * w_out, kh * kw * c)  # [N, L, kh kw C]
    out = cols @ weight.permute(0, 2, 3, 1).reshape(out_ch, -1).t()  # [N, L, O]
    out = out.reshape(n, h_out, w_out, out_ch).permute(0, 3, 1, 2)
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
