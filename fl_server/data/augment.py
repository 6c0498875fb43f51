"""Random augmentations of [N, C, H, W] images in [0, 1] for contrastive learning (FedICON, Sec. 4.1.1),
vectorized over the batch in torch.

Randomness is an *input*: :func:`augment` is a pure function of (images, uniforms ``u`` [N, K_AUG + C*H*W])
so it runs under ``torch.vmap`` and ``grad`` and can be exported; :func:`hash_uniform` makes those uniforms
from an integer key with a counter-based hash (no global RNG), so a resumed or vmapped run draws the same
views as a per-client loop.

One view = small rotation (+-``max_degrees``) and translation (+-``max_shift`` of the width, the "random
crop" of 28x28 digits) by bilinear resampling with zero fill, then contrast scaling around the image mean
(factor in [1 - contrast, 1 + contrast]), then additive uniform pixel noise of a random amplitude up to
``noise``, clipped to [0, 1].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

K_AUG = 5  # per-image uniforms: angle, shift x, shift y, contrast, noise amplitude
_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class AugmentConfig:
    max_degrees: float = 15.0
    max_shift: float = 0.1  # fraction of the image size (2.8 px on 28x28)
    contrast: float = 0.4
    noise: float = 0.1


def num_uniforms(shape: torch.Size | tuple[int, ...]) -> int:
    """Uniforms per image needed by :func:`augment` for images of ``shape`` [C, H, W]."""
    return K_AUG + int(math.prod(shape))


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """'lowbias32' integer hash (C. Wellons) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hash_uniform(key: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[n, k] uniforms in (0, 1) as a pure function of the int64 scalar ``key`` (vmappable over keys)."""
    idx = torch.arange(n * k, device=key.device, dtype=torch.int64).reshape(n, k)
    h = _hash32((_hash32(key & _M32) + idx * 0x9E3779B9 + (key >> 32)) & _M32)
    return (h.to(torch.float32) + 0.5) / 4294967296.0


def _rotation_translation(x: torch.Tensor, u: torch.Tensor, cfg: AugmentConfig) -> torch.Tensor:
    h, w = x.shape[-2:]
    angle = (2 * u[:, 0] - 1) * math.radians(cfg.max_degrees)
    tx, ty = (2 * u[:, 1] - 1) * 2 * cfg.max_shift, (2 * u[:, 2] - 1) * 2 * cfg.max_shift  # grid units: 2 = width
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([torch.stack([cos, -sin, tx], -1), torch.stack([sin, cos, ty], -1)], -2)  # [N, 2, 3]
    ys = (torch.arange(h, device=x.device, dtype=x.dtype) * 2 + 1) / h - 1
    xs = (torch.arange(w, device=x.device, dtype=x.dtype) * 2 + 1) / w - 1
    base = torch.stack([xs.expand(h, w), ys[:, None].expand(h, w), torch.ones(h, w, dtype=x.dtype,
                                                                              device=x.device)], -1)
    grid = torch.einsum("hwk,njk->nhwj", base, theta.to(x.dtype))  # [N, H, W, 2]
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def augment(x: torch.Tensor, u: torch.Tensor, cfg: AugmentConfig = AugmentConfig()) -> torch.Tensor:
    """One random view of every image. ``x`` [N, C, H, W] in [0, 1]; ``u`` [N, num_uniforms(C, H, W)]."""
    n = x.shape[0]
    u = u.to(x.dtype)
    out = _rotation_translation(x, u, cfg)
    mean = out.mean(dim=(1, 2, 3), keepdim=True)
    factor = (1 + (2 * u[:, 3] - 1) * cfg.contrast).reshape(n, 1, 1, 1)
    out = (out - mean) * factor + mean
    amp = (u[:, 4] * cfg.noise).reshape(n, 1, 1, 1)
    noise = (2 * u[:, K_AUG:] - 1).reshape(x.shape) * amp
    return (out + noise).clamp(0.0, 1.0)


def two_views(x: torch.Tensor, key: torch.Tensor, cfg: AugmentConfig = AugmentConfig()) -> torch.Tensor:
    """[2N, C, H, W]: view 1 of every image, then view 2, drawn from ``key``."""
    u = hash_uniform(key, 2 * x.shape[0], num_uniforms(x.shape[1:]))
    return augment(torch.cat([x, x]), u, cfg)
