"""Image preprocessing shared by the server's data path and the device (numpy only, no torch).

A recipe's :class:`Preprocess` turns raw images (uint8 or float, NHWC or NCHW) into the float32 NCHW batch the
model reads. The exporter writes ``preprocess.to_dict()`` into the bundle manifest and the device rebuilds it
with :meth:`Preprocess.from_dict`, so a device passes the same raw images the training data was made of.

>>> import numpy as np
>>> from edge_sdk.preprocess import Preprocess
>>> pre = Preprocess(layout="NHWC", scale=1 / 255, mean=(0.5,), std=(0.5,))
>>> pre.apply(np.full((2, 28, 28, 1), 255, np.uint8)).shape
(2, 1, 28, 28)
>>> Preprocess.from_dict(pre.to_dict()) == pre
True
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

LAYOUTS = ("NHWC", "NCHW")
_KEYS = ("layout", "size", "scale", "mean", "std")


@dataclass(frozen=True)
class Preprocess:
    """``apply(raw)``: layout -> NCHW, ``x * scale``, bilinear resize to ``size`` (H, W) if set, then
    ``(x - mean[c]) / std[c]`` per channel (``mean``/``std`` of length 1 apply to every channel).

    Raw batches are ``[N, H, W, C]`` (NHWC) or ``[N, C, H, W]`` (NCHW); ``[N, H, W]`` is a batch of
    single-channel images in either layout."""

    layout: str = "NCHW"
    size: tuple[int, int] | None = None
    scale: float = 1.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"preprocess layout must be 'NHWC' or 'NCHW', got {self.layout!r}")
        if self.size is not None:
            size = tuple(self.size)
            if len(size) != 2 or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0
                                         for s in size):
                raise ValueError(f"preprocess size must be (height, width) of positive integers, got {self.size!r}")
            object.__setattr__(self, "size", (int(size[0]), int(size[1])))
        if not _finite_number(self.scale) or self.scale == 0:
            raise ValueError(f"preprocess scale must be a finite non-zero number, got {self.scale!r}")
        for name in ("mean", "std"):
            values = getattr(self, name)
            if isinstance(values, (int, float)):
                values = (values,)
            values = tuple(values)
            if not values or not all(_finite_number(v) for v in values):
                raise ValueError(f"preprocess {name} must be a non-empty sequence of finite numbers, got {values!r}")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if any(s <= 0 for s in self.std):
            raise ValueError(f"preprocess std must be positive, got {self.std!r}")
        if len(self.mean) != len(self.std) and 1 not in (len(self.mean), len(self.std)):
            raise ValueError(f"preprocess mean and std differ in length ({len(self.mean)} vs {len(self.std)})")
        object.__setattr__(self, "scale", float(self.scale))

    @classmethod
    def identity(cls) -> "Preprocess":
        """No-op preprocessing (float32 NCHW in, the same out): bundles written before the manifest held one."""
        return cls()

    def to_nchw(self, raw: np.ndarray) -> np.ndarray:
        """``raw`` in this layout as an NCHW array (no copy where possible, dtype kept)."""
        x = np.asarray(raw)
        if x.ndim == 3:
            return x[:, None]
        if x.ndim != 4:
            raise ValueError(f"expected a batch of images [N, H, W, C] or [N, C, H, W] ({self.layout}), "
                             f"got an array of shape {list(x.shape)}")
        return x.transpose(0, 3, 1, 2) if self.layout == "NHWC" else x

    def apply(self, raw: np.ndarray) -> np.ndarray:
        """Raw images (a batch in ``layout``) -> float32 ``[N, C, H, W]`` ready for the model."""
        x = self.to_nchw(raw)
        if x.dtype.kind not in "uif":
            raise ValueError(f"images must be numbers (uint8 or float), got dtype {x.dtype}")
        x = x.astype(np.float32) * np.float32(self.scale)
        if self.size is not None and tuple(x.shape[2:]) != self.size:
            x = resize_bilinear(x, self.size)
        channels = x.shape[1]
        for name in ("mean", "std"):
            if len(getattr(self, name)) not in (1, channels):
                raise ValueError(f"preprocess {name} has {len(getattr(self, name))} values for images with "
                                 f"{channels} channels")
        mean = np.asarray(self.mean, np.float32).reshape(1, -1, 1, 1)
        std = np.asarray(self.std, np.float32).reshape(1, -1, 1, 1)
        return np.ascontiguousarray((x - mean) / std, dtype=np.float32)

    def output_shape(self, raw_shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(C, H, W) of one preprocessed image, given one raw image's shape (without the batch axis)."""
        c, h, w = self.to_nchw(np.empty((1, *raw_shape), np.uint8)).shape[1:]
        return (int(c), *(self.size or (int(h), int(w))))  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the bundle manifest's ``preprocess``)."""
        return {"layout": self.layout, "size": None if self.size is None else list(self.size),
                "scale": self.scale, "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, d: Any) -> "Preprocess":
        """The inverse of :meth:`to_dict`; strict: unknown or missing keys and wrong types are errors."""
        if not isinstance(d, dict):
            raise ValueError(f"preprocess must be an object, got {type(d).__name__}")
        if set(d) != set(_KEYS):
            unknown, missing = sorted(set(d) - set(_KEYS)), sorted(set(_KEYS) - set(d))
            raise ValueError(f"preprocess keys must be {', '.join(_KEYS)} (unknown: {unknown}, missing: {missing})")
        if not isinstance(d["layout"], str):
            raise ValueError(f"preprocess layout must be a string, got {d['layout']!r}")
        for name in ("mean", "std"):
            if not isinstance(d[name], list):
                raise ValueError(f"preprocess {name} must be a list of numbers, got {d[name]!r}")
        if d["size"] is not None and not isinstance(d["size"], list):
            raise ValueError(f"preprocess size must be null or [height, width], got {d['size']!r}")
        return cls(layout=d["layout"], size=None if d["size"] is None else tuple(d["size"]),  # type: ignore[arg-type]
                   scale=d["scale"], mean=tuple(d["mean"]), std=tuple(d["std"]))


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


def resize_bilinear(x: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of float ``[N, C, H, W]`` to ``size`` with half-pixel centres (``align_corners=False``,
    no antialiasing: torch's ``F.interpolate(mode="bilinear")``)."""
    def axis(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5
        src = np.clip(src, 0.0, None)
        lo = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, (src - lo).astype(np.float32)

    (h0, h1, wh), (w0, w1, ww) = axis(x.shape[2], size[0]), axis(x.shape[3], size[1])
    rows = x[:, :, h0] * (1 - wh)[:, None] + x[:, :, h1] * wh[:, None]
    return (rows[:, :, :, w0] * (1 - ww) + rows[:, :, :, w1] * ww).astype(np.float32)
