"""Image preprocessing shared by the server's data path and the device (numpy only, no torch).

A recipe's :class:`Preprocess` turns raw images (uint8 or float, NHWC or NCHW) into the float32 NCHW batch the
model reads. The exporter writes ``preprocess.to_dict()`` into the bundle manifest and the device rebuilds it
with :meth:`Preprocess.from_dict`, so a device passes the same raw images the training data was made of.

>>> import numpy as np
>>> from edge_sdk._preprocess import Preprocess
>>> pre = Preprocess(layout="NHWC", scale=1 / 255, mean=(0.5,), std=(0.5,))
>>> pre.apply(np.full((2, 28, 28, 1), 255, np.uint8)).shape
(2, 1, 28, 28)
>>> Preprocess.from_dict(pre.to_dict()) == pre
True

A recipe also records the raw images its data held (:class:`RawInput`: dtype, value range, one image's shape);
``apply`` then refuses, in one line, input that does not match: e.g. float images already in [0, 1] given to a
bundle trained on uint8 pixels (they would be scaled by 1/255 twice), or images of another size, stated in the
raw layout. Manifests without it (older bundles) are not checked. Float data in no range a device can recognise
(tabular features, say) records its channels' mean and standard deviation instead (:meth:`Preprocess.with_moments`,
the manifest's ``input_moments``, beside ``preprocess`` so that SDKs that predate it read the bundle as before),
and ``apply`` warns (:class:`InputScaleWarning`) for a batch that lies on another scale: values normalised
already, or raw ones where the data held normalised values.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

LAYOUTS = ("NHWC", "NCHW")
_KEYS = ("layout", "size", "scale", "mean", "std")  # and "raw" (optional: manifests before it have none)
_RAW_KEYS = ("dtype", "range", "shape")
_MOMENT_KEYS = ("mean", "std")  # the manifest's input_moments
# a batch is on another scale than the data when, for the median channel, its values lie more than SCALE_Z of the
# data's standard deviations from the data's mean (root mean square), or spread more than SCALE_SPREAD times as
# widely or narrowly (judged on batches of SPREAD_VALUES values per channel or more)
SCALE_Z, SCALE_SPREAD, SPREAD_VALUES = 6.0, 10.0, 8


class InputScaleWarning(UserWarning):
    """A raw batch lies on another scale than the recipe's data (:meth:`RawInput.check`): predictions on it are
    unlikely to mean anything."""


@dataclass(frozen=True)
class RawInput:
    """The raw images a recipe's data held: numpy ``dtype`` name, nominal value ``range`` (lo, hi) or None (not
    checked), one image's ``shape`` in the recipe's layout ((H, W) for single-channel images; None for an
    axis the preprocessing resizes; None for the whole shape: not checked).

    >>> RawInput("uint8", (0, 255), (28, 28)).check(np.zeros((2, 32, 32, 3), np.uint8), "NHWC")
    Traceback (most recent call last):
    ValueError: expected raw images [N, 28, 28] (uint8, layout NHW), got [2, 32, 32, 3]: pass images of that size and channels (the recipe's data)
    """

    dtype: str
    range: tuple[float, float] | None = None
    shape: tuple[int | None, ...] | None = None
    moments: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # per channel (mean, std); not in to_dict

    def __post_init__(self) -> None:
        try:
            kind = np.dtype(self.dtype).kind if isinstance(self.dtype, str) else ""
        except TypeError:
            kind = ""
        if kind not in ("u", "i", "f"):
            raise ValueError(f"preprocess raw dtype must name a numeric numpy dtype (e.g. 'uint8'), got {self.dtype!r}")
        if self.range is not None:
            lo_hi = tuple(self.range)
            if len(lo_hi) != 2 or not all(_finite_number(v) for v in lo_hi) or not lo_hi[0] < lo_hi[1]:
                raise ValueError(f"preprocess raw range must be [low, high] with low < high, got {self.range!r}")
            object.__setattr__(self, "range", (float(lo_hi[0]), float(lo_hi[1])))
        if self.shape is not None:
            shape = tuple(self.shape)
            if len(shape) not in (2, 3) or not all(s is None or (isinstance(s, (int, np.integer)) and
                                                                 not isinstance(s, bool) and s > 0) for s in shape):
                raise ValueError(f"preprocess raw shape must be one image's 2 or 3 sizes (positive integers or "
                                 f"null), got {self.shape!r}")
            object.__setattr__(self, "shape", tuple(None if s is None else int(s) for s in shape))
        if self.moments is not None:
            try:
                mean, std = (tuple(v) for v in self.moments)
            except (TypeError, ValueError):
                mean, std = (), ()
            if not mean or len(mean) != len(std) or not all(_finite_number(v) for v in (*mean, *std)) or \
                    any(v < 0 for v in std):
                raise ValueError(f"preprocess raw moments must be [means, stds], one finite value per channel "
                                 f"(stds not negative), got {self.moments!r}")
            object.__setattr__(self, "moments", (tuple(float(v) for v in mean), tuple(float(v) for v in std)))

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the manifest's ``preprocess.raw``), without ``moments``: those go beside it
        (:meth:`Preprocess.moments_dict`)."""
        return {"dtype": self.dtype, "range": None if self.range is None else list(self.range),
                "shape": None if self.shape is None else list(self.shape)}

    @classmethod
    def from_dict(cls, d: Any) -> "RawInput":
        if not isinstance(d, dict) or set(d) != set(_RAW_KEYS):
            raise ValueError(f"preprocess raw must be an object with keys {', '.join(_RAW_KEYS)}, got {d!r}")
        for name in ("range", "shape"):
            if d[name] is not None and not isinstance(d[name], list):
                raise ValueError(f"preprocess raw {name} must be null or a list, got {d[name]!r}")
        return cls(dtype=d["dtype"], range=None if d["range"] is None else tuple(d["range"]),  # type: ignore[arg-type]
                   shape=None if d["shape"] is None else tuple(d["shape"]))

    def check(self, x: np.ndarray, layout: str) -> None:
        """Raise ValueError (one line, saying what to pass) unless the raw batch ``x`` in ``layout`` has this
        shape and lies in this range. Values: a batch whose largest value is at most 1 (and not all zero) given
        where the data was 0..255 is refused as already normalised (it would be scaled twice), integers too
        (``(x / 255).astype(np.uint8)``, a thresholded mask); any batch outside the range (plus a 0.1% margin) is
        refused. Data with ``moments`` (no range): a batch on another scale is warned of
        (:class:`InputScaleWarning`), not refused (test-time shifts move values, though not by that much): for the
        median channel, values more than :data:`SCALE_Z` of the channel's standard deviations from its mean (root
        mean square over the batch), or spread more than :data:`SCALE_SPREAD` times as widely or narrowly as the
        data (with :data:`SPREAD_VALUES` values per channel or more: a batch of one feature vector is judged by where
        its values lie alone). The median: one heavy-tailed or rarely set feature does not speak for the batch."""
        if self.shape is not None and not self._shape_fits(x, layout):
            raise ValueError(f"expected raw images {self._shape_text(layout)} ({self.dtype}, layout "
                             f"{'NHW' if len(self.shape) == 2 else layout}), got {list(x.shape)}: pass images of that "
                             f"size and channels (the recipe's data)")
        if x.size == 0 or x.dtype.kind not in "uif":
            return
        if self.range is None:
            if self.moments is not None:
                self._check_scale(x, layout)
            return
        lo, hi = self.range
        x_lo, x_hi = float(x.min()), float(x.max())
        got = f"got {x.dtype} values in [{x_lo:.4g}, {x_hi:.4g}]"
        expects = f"expects raw pixels in [{lo:g}, {hi:g}] ({self.dtype})"
        if hi > 1 and x_hi <= 1 and (x_hi > 0 or x_lo < 0):
            raise ValueError(f"this bundle {expects}; {got}: pass the raw images, not normalised ones")
        margin = 1e-3 * (hi - lo)
        if x_lo < lo - margin or x_hi > hi + margin:
            eight_bit = " (8-bit pixels: x / 255)" if x.dtype == np.uint8 else ""
            fix = (f"scale them into [{lo:g}, {hi:g}] as the recipe's data was{eight_bit}" if hi <= 1 < x_hi else
                   "pass images in the value range of the recipe's data")
            raise ValueError(f"this bundle {expects}; {got}: {fix}")

    def _check_scale(self, x: np.ndarray, layout: str) -> None:
        assert self.moments is not None
        mean, std = (np.asarray(m, np.float64) for m in self.moments)
        values = channel_values(x, layout)
        varied = std > 0  # a channel constant in the data has no scale to compare with
        if values.shape[1] != len(mean) or not varied.any():
            return  # other channels: the shape check speaks to them
        # per channel, from the batch's first two moments (float64 sums, no float64 copy of the batch)
        n = len(values)
        first = np.einsum("ij->j", values, dtype=np.float64)[varied] / n
        second = np.einsum("ij,ij->j", values, values, dtype=np.float64)[varied] / n
        if not (np.isfinite(first).all() and np.isfinite(second).all()):
            return  # NaN or infinite values: not a question of scale
        mu, sd = mean[varied], std[varied]
        rms = float(np.median(np.sqrt(np.maximum(second - 2 * mu * first + mu * mu, 0.0)) / sd))
        spread = None
        if n >= SPREAD_VALUES:
            ratio = np.sqrt(np.maximum(second - first * first, 0.0)) / sd
            ratio = ratio[ratio > 0]  # a channel constant in this batch says nothing of its scale
            spread = float(np.median(ratio)) if ratio.size else None
        if rms > SCALE_Z or spread is not None and not 1 / SCALE_SPREAD <= spread <= SCALE_SPREAD:
            widely = "" if spread is None else f" and spread {spread:.2g} times as widely"
            warnings.warn(f"this batch is on another scale than the bundle's data (channel means {_few(mean)}, "
                          f"standard deviations {_few(std)}): for the median channel, its values lie {rms:.1f} of "
                          f"those standard deviations from the mean (root mean square){widely}, so its predictions "
                          f"are unlikely to mean anything; pass values as the recipe's data held them (normalised "
                          f"there if it was, raw if not)", InputScaleWarning, stacklevel=4)

    def _shape_fits(self, x: np.ndarray, layout: str) -> bool:
        assert self.shape is not None
        if x.ndim not in (3, 4):
            return False
        want = _chw(self.shape, layout)
        have = _chw(tuple(x.shape[1:]), layout)
        return all(w is None or w == h for w, h in zip(want, have))

    def _shape_text(self, layout: str) -> str:
        assert self.shape is not None
        names = ("H", "W") if len(self.shape) == 2 else ("C", "H", "W") if layout == "NCHW" else ("H", "W", "C")
        return "[N, " + ", ".join(n if s is None else str(s) for n, s in zip(names, self.shape)) + "]"


def channel_values(x: np.ndarray, layout: str) -> np.ndarray:
    """A raw batch as [values, channels] (a view where it can be): ``[N, H, W]`` is one channel; 4-D batches have
    their channels where ``layout`` puts them. Shared with the recipe side, which records each channel's moments."""
    if x.ndim == 3:
        return x.reshape(-1, 1)
    return x.reshape(-1, x.shape[-1]) if layout == "NHWC" else np.moveaxis(x, 1, -1).reshape(-1, x.shape[1])


def _few(values: np.ndarray, most: int = 3) -> str:
    """A short list of numbers for a message: the first ``most`` and how many more."""
    shown = ", ".join(f"{v:.3g}" for v in values[:most])
    return f"[{shown}{f', ... ({len(values)} channels)' if len(values) > most else ''}]"


def _chw(shape: tuple[Any, ...], layout: str) -> tuple[Any, Any, Any]:
    """One image's (C, H, W) from its shape in ``layout`` ((H, W): one channel)."""
    if len(shape) == 2:
        return (1, *shape)
    return (shape[2], shape[0], shape[1]) if layout == "NHWC" else (shape[0], shape[1], shape[2])


@dataclass(frozen=True)
class Preprocess:
    """``apply(raw)``: layout -> NCHW, ``x * scale``, bilinear resize to ``size`` (H, W) if set, then
    ``(x - mean[c]) / std[c]`` per channel (``mean``/``std`` of length 1 apply to every channel).

    Raw batches are ``[N, H, W, C]`` (NHWC) or ``[N, C, H, W]`` (NCHW); ``[N, H, W]`` is a batch of
    single-channel images in either layout. ``raw``: what raw images the recipe's data held (checked by
    ``apply``; None: not checked)."""

    layout: str = "NCHW"
    size: tuple[int, int] | None = None
    scale: float = 1.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    raw: RawInput | None = None

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
        if self.raw is not None and not isinstance(self.raw, RawInput):
            raise ValueError(f"preprocess raw must be a RawInput, got {type(self.raw).__name__}")

    @classmethod
    def identity(cls) -> "Preprocess":
        """No-op preprocessing (float32 NCHW in, the same out): bundles written before the manifest held one."""
        return cls()

    @property
    def is_identity(self) -> bool:
        """Whether it changes nothing (float32 NCHW in, the same out), whatever raw input it records."""
        return dataclasses.replace(self, raw=None) == Preprocess.identity()

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
        """Raw images (a batch in ``layout``) -> float32 ``[N, C, H, W]`` ready for the model; ValueError (one
        line) for images unlike the recipe's raw data (:meth:`RawInput.check`)."""
        if self.raw is not None:
            self.raw.check(np.asarray(raw), self.layout)
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

    def moments_dict(self) -> dict[str, list[float]] | None:
        """The manifest's ``input_moments`` (each channel's ``mean`` and ``std`` of the raw data, where no value range
        tells raw from normalised data), or None; kept beside ``preprocess``, whose keys older SDKs check."""
        if self.raw is None or self.raw.moments is None:
            return None
        return {"mean": list(self.raw.moments[0]), "std": list(self.raw.moments[1])}

    def with_moments(self, d: Any) -> "Preprocess":
        """This preprocessing with the manifest's ``input_moments`` (None: as it is); strict, as
        :meth:`from_dict`. Without a recorded ``raw`` there is nothing to check against: as it is."""
        if d is None:
            return self
        if not isinstance(d, dict) or set(d) != set(_MOMENT_KEYS) or not all(isinstance(d[k], list)
                                                                           for k in _MOMENT_KEYS):
            raise ValueError(f"input_moments must be an object with lists mean and std, got {str(d)[:80]}")
        if self.raw is None:
            return self
        return dataclasses.replace(self, raw=dataclasses.replace(self.raw, moments=(tuple(d["mean"]),
                                                                                   tuple(d["std"]))))

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the bundle manifest's ``preprocess``); ``raw`` only when it records one (its ``moments``
        are :meth:`moments_dict`'s)."""
        d: dict[str, Any] = {"layout": self.layout, "size": None if self.size is None else list(self.size),
                             "scale": self.scale, "mean": list(self.mean), "std": list(self.std)}
        if self.raw is not None:
            d["raw"] = self.raw.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Preprocess":
        """The inverse of :meth:`to_dict`; strict: unknown or missing keys and wrong types are errors."""
        if not isinstance(d, dict):
            raise ValueError(f"preprocess must be an object, got {type(d).__name__}")
        if set(d) - {"raw"} != set(_KEYS):
            unknown, missing = sorted(set(d) - {*_KEYS, "raw"}), sorted(set(_KEYS) - set(d))
            raise ValueError(f"preprocess keys must be {', '.join(_KEYS)} and optionally raw (unknown: {unknown}, "
                             f"missing: {missing})")
        if not isinstance(d["layout"], str):
            raise ValueError(f"preprocess layout must be a string, got {d['layout']!r}")
        for name in ("mean", "std"):
            if not isinstance(d[name], list):
                raise ValueError(f"preprocess {name} must be a list of numbers, got {d[name]!r}")
        if d["size"] is not None and not isinstance(d["size"], list):
            raise ValueError(f"preprocess size must be null or [height, width], got {d['size']!r}")
        return cls(layout=d["layout"], size=None if d["size"] is None else tuple(d["size"]),  # type: ignore[arg-type]
                   scale=d["scale"], mean=tuple(d["mean"]), std=tuple(d["std"]),
                   raw=None if d.get("raw") is None else RawInput.from_dict(d["raw"]))


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
