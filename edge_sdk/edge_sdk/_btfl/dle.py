"""DLE (Sec. 4.1, Eqs. 5-6; geometric mean of Sec. 4.4): finite scalar quantisation of the frozen features, the
per-dimension level frequencies of a client, their average over clients and the smoothed likelihood."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edge_sdk._btfl.checks import float_array, require_2d, require_finite, require_nonnegative_finite

def fsq_quantize(z: object, levels: int = 2) -> np.ndarray:
    """Finite scalar quantisation of non-negative (post-ReLU) features, Eq. 5.

    z: [..., D] features >= 0 -> codes [..., D] int8 in {0, ..., levels - 1}: round((levels - 1) * tanh(z)).
    With levels = 2 this is the paper's round(tanh(z)) in {0, 1}: code 1 iff tanh(z) > 0.5, i.e.
    z > atanh(0.5) ~ 0.549 (round-half-to-even sends tanh(z) == 0.5 to 0).
    """
    if int(levels) != levels or levels < 2 or levels > 127:
        raise ValueError(f"levels must be an integer in [2, 127], got {levels!r}")
    arr = float_array("features", z)
    require_nonnegative_finite("features", arr)
    return fsq_codes(arr, int(levels)).astype(np.int8)



def _tanh_half_threshold() -> float:
    """The smallest float64 z with ``np.tanh(z) > 0.5`` (~ atanh(1/2) = 0.5493): Eq. 5's two-level code of a
    feature z >= 0 is 1 iff z >= this, one comparison instead of a tanh (np.tanh is monotone; the test sweeps
    the neighbourhood). Bisection on the float64 bit patterns of [0.5, 0.6], with np.tanh itself as the oracle."""
    lo, hi = np.array([0.5, 0.6]).view(np.int64).tolist()  # tanh: 0.46 <= 0.5 < 0.54
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if np.tanh(np.array(mid, dtype=np.int64).view(np.float64)) > 0.5:
            hi = mid
        else:
            lo = mid
    return float(np.array(hi, dtype=np.int64).view(np.float64))


TANH_HALF = _tanh_half_threshold()


def fsq_codes(z: np.ndarray, levels: int) -> np.ndarray:
    """Unchecked Eq. 5: z [..., D] >= 0 -> integer codes (intp) round((levels - 1) tanh z)."""
    t = np.tanh(z)
    if levels != 2:
        t *= levels - 1
    return np.rint(t).astype(np.intp)


def fit_dle(features: object, levels: int = 2) -> np.ndarray:
    """Local DLE: per-dimension level frequencies of fsq(features).

    features: [N, D] non-negative -> freqs [D, levels], rows sum to 1; ``freqs[:, 0]`` is the paper's p_d
    (frequency of level 0, Eq. 6).
    """
    arr = float_array("features", features)
    require_2d("features", arr)
    if arr.shape[0] == 0:
        raise ValueError("fit_dle needs at least one feature vector")
    codes = fsq_quantize(arr, levels)
    onehot = codes[:, :, None] == np.arange(levels, dtype=np.int8)  # [N, D, L]
    return onehot.mean(axis=0)


def average_dles(dles: list[np.ndarray], weights: object | None = None) -> np.ndarray:
    """Global DLE = (weighted) average of clients' local DLEs (Sec. 4.1). dles: K x [D, L] -> [D, L].

    (The authors leave the receiving client's own DLE out: pass only the other clients'.)
    """
    if len(dles) == 0:
        raise ValueError("average_dles needs at least one DLE")
    stack = np.stack([check_freqs(f) for f in dles])
    w = np.ones(len(dles)) if weights is None else float_array("weights", weights)
    if w.shape != (len(dles),) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be K finite non-negative numbers with a positive sum")
    return np.tensordot(w / w.sum(), stack, axes=1)


def check_freqs(freqs: object) -> np.ndarray:
    f = float_array("freqs", freqs)
    require_2d("freqs", f)
    if f.shape[1] < 2:
        raise ValueError(f"freqs must be [D, levels] with levels >= 2, got shape {f.shape}")
    require_finite("freqs", f)
    if (f < 0).any() or (f > 1).any() or not np.allclose(f.sum(axis=1), 1.0, atol=1e-6):
        raise ValueError("freqs rows must be probability vectors (entries in [0, 1] summing to 1)")
    return f


@dataclass(frozen=True)
class DLESmoothing:
    """Smoothed per-dimension likelihood p' = a * p + b of a level with DLE frequency p (log taken after).

    * ``DLESmoothing.authors(levels)`` (the default): a = 0.6, b = 0.4 / levels -- for 2 levels exactly the
      authors' ``log(0.6 p + 0.2)``. Chosen as default because it is what produced the paper's numbers, it
      keeps p' a probability vector (a + levels * b = 1), and it bounds each dimension's local/global
      log-ratio to log(4), so tau (Eq. 9) is bounded by [1/4, 4] in geometric mean and can never be 0/inf.
    * ``DLESmoothing.additive(pseudocount, n_train, levels)``: Laplace / additive smoothing
      (n_k + c) / (n + levels * c) written on frequencies, i.e. a = n / (n + L c), b = c / (n + L c).
    * ``DLESmoothing.none()``: a = 1, b = 0 (raw frequencies; log 0 = -inf possible).
    """

    a: float = 0.6
    b: float = 0.2

    def __post_init__(self) -> None:
        if not (math.isfinite(self.a) and math.isfinite(self.b) and self.a >= 0 and self.b >= 0):
            raise ValueError(f"smoothing needs finite a >= 0 and b >= 0, got a={self.a!r}, b={self.b!r}")
        if self.a == 0 and self.b == 0:
            raise ValueError("smoothing with a = b = 0 gives log(0) everywhere")

    @classmethod
    def authors(cls, levels: int = 2) -> DLESmoothing:
        return cls(0.6, 0.4 / levels)

    @classmethod
    def additive(cls, pseudocount: float = 1.0, n_train: int = 1, levels: int = 2) -> DLESmoothing:
        if not pseudocount > 0 or not n_train >= 1:
            raise ValueError("additive smoothing needs pseudocount > 0 and n_train >= 1")
        den = n_train + levels * pseudocount
        return cls(n_train / den, pseudocount / den)

    @classmethod
    def none(cls) -> DLESmoothing:
        return cls(1.0, 0.0)

    def log_table(self, freqs: np.ndarray) -> np.ndarray:
        """freqs [D, L] -> log(a * freqs + b) [D, L] (-inf where the smoothed value is 0)."""
        with np.errstate(divide="ignore"):
            return np.log(self.a * freqs + self.b)


def dle_log_likelihood(codes: object, freqs: object, smoothing: DLESmoothing | None = None) -> np.ndarray:
    """log q = (1/D) sum_d log(a * freqs[d, codes[n, d]] + b): the log of the geometric-mean likelihood.

    codes: [N, D] ints in [0, levels) (from :func:`fsq_quantize`); freqs: [D, levels] -> [N] (Eq. 6 and the
    1/D exponent of Sec. 4.4). ``smoothing`` defaults to ``DLESmoothing.authors(levels)``.
    """
    f = check_freqs(freqs)
    c = np.asarray(codes)
    require_2d("codes", c, cols=f.shape[0])
    if not np.issubdtype(c.dtype, np.integer) or (c.size and (c.min() < 0 or c.max() >= f.shape[1])):
        raise ValueError(f"codes must be integers in [0, {f.shape[1]})")
    sm = DLESmoothing.authors(f.shape[1]) if smoothing is None else smoothing
    table = sm.log_table(f)
    return np.add.reduce(table[np.arange(f.shape[0]), c], axis=-1) / f.shape[0]


