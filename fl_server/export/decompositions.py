"""Decompositions that let gradient-step graphs of ConvNets lower to ONNX, and lower to cheaper ONNX.

``aten.convolution_backward`` has no ONNX lowering. For a 2-D, non-transposed convolution
y = conv2d(x, W, b; stride s, padding p, dilation d, groups G), W [C_out, C_in / G, kh, kw]:
  dL/dx = conv_transpose2d(dL/dy, W; s, p, output_padding, d, groups G)   (output_padding restores x's size;
          where W becomes a constant of the graph, fl_server.export.rewrites.constant_transposed_convolutions turns it
          into a convolution that onnxruntime packs)
  dL/dW[:, :, i, j] = sum over (n, h, w) of dL/dy * x_ij, one kernel offset at a time, x_ij the input window the
          offset reads (a strided slice of the padded input): for G = 1 a matrix product [C_out, N*h*w] @
          [N*h*w, C_in] (the input channel-last), depthwise a product and a per-channel sum. (As one convolution
          whose kernel is dL/dy, the way other groupings still go -- conv2d(x', (dL/dy)^T; stride d, padding p,
          dilation s, groups G)^T with x' [C_in / G, G * N, H, W] -- onnxruntime ran it at a third of these
          matrix products' speed: a kernel of h x w taps, an output of kh x kw. Full convolutions with larger inputs
          than _OFFSET_INPUT_ELEMENTS still go that way: the per-offset copies raised the device's peak memory.)
  dL/db = sum of dL/dy over batch and space

Max-pooling backward where the windows tile the input (kernel = stride, no padding or dilation, sizes divisible):
the exporter keeps the forward's flat indices (an ONNX MaxPool with indices, several times slower on onnxruntime
than one without) to scatter the gradient into zeros. Here the gradient goes, by comparison, to the first position
of each window (in window order, as torch's kernel keeps the first maximum) that equals the window's maximum:
  hit = x == up(max),  rank = kh * kw - offset within the window,  first = rank * hit == up(max(rank * hit))
  dL/dx = up(dL/dy) * (first & hit)          (up: nearest upsampling by the kernel, an ONNX Resize)
so the forward's indices are no longer read and its MaxPool drops them.
ReLU / ReLU6 backward: dL/dx = dL/dy * [x inside the open interval], a multiply by a 0/1 mask (the exporter's
lowering, a Where with a broadcast zero, is several times slower on onnxruntime's CPU kernels).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _grad_weight(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, stride: list[int],
                 padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    c_out, per_group, kh, kw = weight.shape
    if (groups == 1 and _offsets_fit(input, kh * kw, stride)) or (per_group == 1 and c_out == groups):
        return _grad_weight_by_offset(grad_output, input, kh, kw, stride, padding, dilation, groups)
    n, c_in = input.shape[0], input.shape[1]
    # [N, C_in, H, W] -> [N, G, C_in/G, H, W] -> [C_in/G, G, N, H, W] -> [C_in/G, G*N, H, W]
    x = input.reshape(n, groups, per_group, input.shape[2], input.shape[3]).permute(2, 1, 0, 3, 4)
    x = x.reshape(per_group, groups * n, input.shape[2], input.shape[3])
    gw = F.conv2d(x, grad_output.transpose(0, 1), stride=dilation, padding=padding, dilation=stride, groups=groups)
    return gw.transpose(0, 1)[:, :, :weight.shape[2], :weight.shape[3]]


# per-offset weight gradients of a full (G = 1) convolution, per sample input elements up to which they stay within
# the device's peak memory: their window copies and the channel-last input, in onnxruntime's arena beside a
# backward's activations, fragment it (resnet8_bn's FedTTA step, batch 64: 140 MB peak on all layers, 127 MB with
# these bounds, its 16 x 28 x 28 inputs by convolution -- 72 / 85 / 94 ms a step on one core, all by convolution)
_OFFSET_INPUT_ELEMENTS = {"unit_stride": 8192, "strided": 4096}


def _offsets_fit(input: torch.Tensor, taps: int, stride: list[int]) -> bool:
    per_sample = input.shape[1] * input.shape[2] * input.shape[3]
    return taps == 1 or per_sample <= _OFFSET_INPUT_ELEMENTS["unit_stride" if stride == [1, 1] else "strided"]


def _grad_weight_by_offset(grad_output: torch.Tensor, input: torch.Tensor, kh: int, kw: int, stride: list[int],
                           padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    """dL/dW one kernel offset (i, j) at a time: x_ij, the input window that offset reads ([N, C_in, h, w], a strided
    slice of the padded input), gives dL/dW[:, :, i, j] = sum over (n, h, w) of dL/dy x_ij -- for G = 1 one matrix
    product [C_out, N*h*w] @ [N*h*w, C_in] (inputs channel-last), depthwise a product and a sum per channel."""
    h, w = grad_output.shape[2], grad_output.shape[3]
    x = F.pad(input, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else input
    if groups == 1:  # channel-last once: each offset's window is then a [N*h*w, C_in] matrix
        x = x.permute(0, 2, 3, 1)
        gy = grad_output.transpose(0, 1).reshape(grad_output.shape[1], -1)  # [C_out, N*h*w]

    def window(i: int, j: int) -> torch.Tensor:
        rows = slice(i * dilation[0], i * dilation[0] + (h - 1) * stride[0] + 1, stride[0])
        cols = slice(j * dilation[1], j * dilation[1] + (w - 1) * stride[1] + 1, stride[1])
        return x[:, rows, cols, :] if groups == 1 else x[:, :, rows, cols]

    if groups == 1:
        taps = [gy @ window(i, j).reshape(-1, x.shape[3]) for i in range(kh) for j in range(kw)]
    else:
        taps = [(grad_output * window(i, j)).sum(dim=(0, 2, 3))[:, None] for i in range(kh) for j in range(kw)]
    return torch.stack(taps, dim=2).reshape(taps[0].shape[0], taps[0].shape[1], kh, kw)


def convolution_backward(
    grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, bias_sizes: Any,
    stride: list[int], padding: list[int], dilation: list[int], transposed: bool, output_padding: list[int],
    groups: int, output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    if transposed or input.dim() != 4:
        raise NotImplementedError("only 2-D, non-transposed convolutions are decomposed")
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        out_pad = [
            input.shape[2 + i] - ((grad_output.shape[2 + i] - 1) * stride[i] - 2 * padding[i]
                                  + dilation[i] * (weight.shape[2 + i] - 1) + 1)
            for i in range(2)
        ]
        grad_input = F.conv_transpose2d(grad_output, weight, stride=stride, padding=padding,
                                        output_padding=out_pad, groups=groups, dilation=dilation)
    if output_mask[1]:
        grad_weight = _grad_weight(grad_output, input, weight, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum(dim=(0, 2, 3))
    return grad_input, grad_weight, grad_bias


def _pair(v: Any) -> list[int]:
    """A pooling argument (an int, or a list of one or two ints) as two ints."""
    v = [v] if isinstance(v, int) else list(v)
    return v * (3 - len(v))


def _upsample(t: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """[N, C, h, w] -> [N, C, h * kh, w * kw], each value repeated over its window (lowers to ONNX Resize)."""
    return aten.upsample_nearest2d.default(t, [t.shape[2] * kh, t.shape[3] * kw])


def max_pool2d_with_indices_backward(grad_output: torch.Tensor, input: torch.Tensor, kernel_size: list[int],
                                     stride: list[int], padding: list[int], dilation: list[int], ceil_mode: bool,
                                     indices: torch.Tensor) -> Any:
    kh, kw = _pair(kernel_size)
    h, w = input.shape[2], input.shape[3]
    if (input.dim() != 4 or (_pair(stride) if stride else [kh, kw]) != [kh, kw] or _pair(padding) != [0, 0]
            or _pair(dilation) != [1, 1] or h % kh or w % kw):
        return NotImplemented  # overlapping or padded windows: the exporter's lowering (indices and scatter)
    values = F.max_pool2d(input, (kh, kw))
    hit = input == _upsample(values, kh, kw)
    offset = (torch.arange(h, device=input.device) % kh).view(h, 1) * kw + (torch.arange(w, device=input.device) % kw)
    ranked = (kh * kw - offset).to(input.dtype) * hit.to(input.dtype)
    first = ranked == _upsample(F.max_pool2d(ranked, (kh, kw)), kh, kw)
    return _upsample(grad_output, kh, kw) * (first & hit).to(grad_output.dtype)


def threshold_backward(grad_output: torch.Tensor, input: torch.Tensor, threshold: float) -> torch.Tensor:
    return grad_output * (input > threshold).to(grad_output.dtype)


def hardtanh_backward(grad_output: torch.Tensor, input: torch.Tensor, min_val: float, max_val: float) -> torch.Tensor:
    return grad_output * ((input > min_val) & (input < max_val)).to(grad_output.dtype)


DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.convolution_backward.default: convolution_backward,
    aten.max_pool2d_with_indices_backward.default: max_pool2d_with_indices_backward,
    aten.threshold_backward.default: threshold_backward,
    aten.hardtanh_backward.default: hardtanh_backward,
}
