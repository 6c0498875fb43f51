"""Convolutions in bfloat16 for clients stepped together under ``vmap`` (``RunConfig(batched_conv="bf16")``).

A vmapped ConvNet round on a GPU spends about 80% of its time in vmap's grouped convolutions
(docs/research/gpu-engine.md). :class:`Bf16Conv` runs each ``torch.conv2d`` (what ``nn.Conv2d`` calls) on
bfloat16 copies of its input, weight and bias and returns the result in the input's dtype: the kernels read and
write half the bytes and use the GPU's bf16 matrix units, while everything else in the round (losses, the
second-order meta-gradient's other terms, the optimiser) stays in the run's dtype. Autograd goes through the
casts, so the first and second derivatives of the convolutions are computed in bfloat16 too.

This changes the arithmetic, unlike the GEMM path: bfloat16 keeps 8 significant bits, so a round differs from the
float32 round by its rounding (about 1e-2 relative per convolution) and training amplifies that. A row trained
with it is a different row; it is recorded (``batched_conv`` in the raw record) and its accuracy must be checked
on validation against the float32 row before any table row runs with it.

Example::

    with Bf16Conv():
        states = torch.vmap(step, in_dims=(0, None, 0, 0))(states, server, x, y)
"""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class Bf16Conv(TorchFunctionMode):
    """While active, ``torch.conv2d`` / ``F.conv2d`` calls (``nn.Conv2d`` included) compute in bfloat16 and return
    their input's dtype."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.conv2d:  # F.conv2d is the same builtin
            dtype = (args[0] if args else kwargs["input"]).dtype
            half = lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) else t  # noqa: E731
            return torch.conv2d(*map(half, args), **{k: half(v) for k, v in kwargs.items()}).to(dtype)
        return func(*args, **kwargs)
