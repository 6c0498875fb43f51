"""BTFL test-time head interpolation on the device (numpy only: no torch, no scipy).

Reference: "Bayesian Test-time Federated Learning" (BTFL, KDD '25; ``shared/seeds/btfl.txt``) and
``shared/SPEC.md`` section 3. Equation numbers below are the paper's.

Pipeline for one test sample with frozen feature ``z`` (post-ReLU, dimension D) and two heads
(local / personal and global, C classes):

* DLE (Sec. 4.1, Eqs. 5-6): ``z_hat = fsq(z) = round(tanh(z))`` in {0, 1}^D; a DLE stores, per dimension,
  the frequency of each level on a training set. Likelihood ``Q = prod_d p_d(z_hat_d)``; we use the
  geometric mean ``q = Q^(1/D)`` (Sec. 4.4) and work with ``log q = mean_d log p_d(z_hat_d)`` throughout.
  Zero frequencies are smoothed explicitly (:class:`DLESmoothing`).
* HBU (Sec. 4.3, Eqs. 7-11, Algorithm 1): ``tau = Q_l / Q_g`` (Eq. 9) plus the entropy inspection ``pi``
  (Eq. 10) turn the stream into IND / EXD events that update a Beta(alpha, beta) prior on ``m``; the
  prior strength is pruned to ``lambda`` (Algorithm 1).
* CBU (Sec. 4.4, Eqs. 12-15): the entropy-rectified ratio
  ``tau_hat = q_l^exp((H_l - H_l_bar)/H_l_bar) / q_g^exp((H_g - H_g_bar)/H_g_bar)`` (Eqs. 14-15) turns the
  prior draw ``m`` into the posterior ``m_hat = m / (m + (1 - m) tau_hat)`` (Eq. 13).
* DPI (Sec. 4.5, Eqs. 16-21): ``e = int m_hat pdf(m_hat | z) d m_hat`` (Eqs. 19-21); by the change of
  variables of Eqs. 16-18 this is exactly ``E_{m ~ Beta(alpha, beta)}[m / (m + (1 - m) tau_hat)]``, and the
  prediction is ``Y_int = e * Y_g + (1 - e) * Y_l`` (Eq. 21).

CONVENTION (differs from the letter of Eq. 11, follows its semantics). ``m = P(sample is EXD)`` (Eqs. 12-13),
so the Beta parameter whose mean ``alpha / (alpha + beta)`` estimates ``m`` must count EXD evidence:
``alpha`` counts EXD events, ``beta`` counts IND events. ``tau = Q_l / Q_g > 1`` means the local DLE
explains the sample better, i.e. IND evidence -> ``beta += 1``; ``tau < 1`` -> EXD evidence -> ``alpha += 1``.
The paper's text (below Eq. 7) calls alpha the IND count and Eq. 11 increments alpha for ``tau > 1``, which
together with ``m = P(EXD)`` would make IND evidence *raise* the weight of the global head; we follow the
semantics so that a stream of EXD samples drives ``e`` toward 1 (tested).

The exact integral (:func:`expected_global_weight`). The closed form is
``e = alpha/(alpha+beta) * 2F1(1, beta; alpha+beta+1; 1 - tau_hat)`` (Euler integral + Pfaff transformation,
argument in [0, 1) for ``tau_hat <= 1``; ``e(alpha, beta, t) = 1 - e(beta, alpha, 1/t)`` for ``t > 1``). We do
NOT evaluate it with ``scipy.special.hyp2f1``: near ``z -> 1`` (``tau_hat`` far from 1) with ``c - a - b``
(= alpha or beta) at or near an integer -- exactly the values the Beta counts take -- scipy 1.17 returns
``inf``/``nan`` (e.g. ``hyp2f1(1, 1.3, 3.3, 0.999) = inf``) or loses 5-6 digits. Gauss-Jacobi quadrature in
``m`` needs O(tau^-1/2) nodes because the pole of the integrand sits at distance ~tau_hat from an endpoint.
Instead we integrate in logit space, ``u = log(m / (1 - m))``: the integrand becomes
``sigmoid(u - log tau_hat) * sigmoid(u)^alpha * sigmoid(-u)^beta``, analytic in the strip |Im u| < pi for
every ``tau_hat`` (the endpoint singularities become exponential tails), so the trapezoid rule converges
geometrically in the step size. The grid is set per sample from (alpha, beta) only (step <= min(0.4,
1.2 / sqrt(alpha + beta)), tails cut where the density has dropped by >= e^-36) and the result is
self-normalised by the same rule applied to the density, so no Beta function is needed. Measured
absolute error against mpmath (hyp2f1 at 30 digits) / scipy quad, tau_hat log-uniform in [1e-8, 1e8]:
<= 4e-15 for alpha, beta in [1, 20] (integers included), <= 1e-15 in [0.05, 1], <= 2e-13 in [20, 1e5],
<= 5e-11 in [1e5, 1e7]; 32-208 nodes per sample for alpha, beta in [1, 20]. The tau-independent part
(density on the grid) is memoised for batches of <= 4 samples, which a one-sample-at-a-time stream hits;
:class:`BTFLStream` keeps a grid cache of its own, sized to the stream (``cache_size``).
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import numpy as np

from edge_sdk.numerics import log_softmax

__all__ = [
    "DEFAULT_LAMBDA",
    "EVENT_EXD",
    "EVENT_IND",
    "EVENT_NONE",
    "BTFLStream",
    "DLESmoothing",
    "average_dles",
    "detect_events",
    "dle_log_likelihood",
    "expected_global_weight",
    "fit_dle",
    "fsq_quantize",
    "hbu_sequence",
    "hbu_update",
    "log_tau_hat",
    "soft_clip_log_tau",
    "tau_hat",
    "trapezoid_global_weight",
]

DEFAULT_LAMBDA = 16.0  # prior-strength threshold of Algorithm 1 (paper: results insensitive in [5, 20])
EVENT_EXD = 1  # tau < 1 and inspection passed -> alpha += 1
EVENT_IND = -1  # tau > 1 and inspection passed -> beta += 1
EVENT_NONE = 0

Mixing = Literal["prob", "logprob"]
Integral = Literal["exact", "trapezoid100"]
Restart = Literal["paper", "authors"]


# --------------------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------------------
def _float_array(name: str, x: object) -> np.ndarray:
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be numeric, got {type(x).__name__}") from exc
    return arr


def _require_finite(name: str, x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite (no NaN/inf)")


def _require_2d(name: str, x: np.ndarray, cols: int | None = None, rows: int | None = None) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {x.shape}")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got shape {x.shape}")
    if cols is not None and x.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns, got shape {x.shape}")


def _positive_scalar(name: str, x: float) -> float:
    v = float(x)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
    return v


# --------------------------------------------------------------------------------------------------------
# DPI: e = E_{m ~ Beta(alpha, beta)}[m / (m + (1 - m) tau_hat)]  (Eqs. 16-21)
# --------------------------------------------------------------------------------------------------------
_TAIL_SIGMAS = 9.0  # Gaussian-regime half-width of the grid, in units of sqrt(1/alpha + 1/beta)
_TAIL_NATS = 36.0  # exponential-regime tail cut: density dropped by e^-36 (~2e-16)
_H_CAP = 0.4  # step cap from the strip of analyticity |Im u| < pi (0.5 -> ~1e-11 error, 0.4 -> ~1e-14)
_H_REL = 1.2  # step cap / sqrt(alpha + beta): |density| grows like cos(Im u / 2)^-(alpha+beta) off the axis
_NODE_QUANTUM = 16  # node counts are rounded up to a multiple of this (samples are grouped by node count)
_TINY = 5e-324
_HUGE = float(np.finfo(np.float64).max)


def _check_weight_inputs(alpha: np.ndarray, beta: np.ndarray, tau: np.ndarray) -> None:
    if not (np.isfinite(alpha).all() and (alpha > 0).all()):
        raise ValueError("alpha must be finite and > 0 (Beta(alpha, beta) prior)")
    if not (np.isfinite(beta).all() and (beta > 0).all()):
        raise ValueError("beta must be finite and > 0 (Beta(alpha, beta) prior)")
    if np.isnan(tau).any() or (tau < 0).any():
        raise ValueError("tau_hat must be >= 0 and not NaN (0 and inf are allowed limits)")


def _logit_grid(ab: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample trapezoid grid in v = -logit(m), from (alpha, beta) only (so each sample's result does not
    depend on the rest of the batch).

    ab: [2, B] = (alpha, beta) -> (v_start [B], step [B], nodes [B] float, a multiple of _NODE_QUANTUM);
    nodes v_j = v_start - step * j, j < nodes, span the logit of the Beta mode -left ... +right.
    """
    inv = 1.0 / ab
    sig = np.sqrt(inv[0] + inv[1])  # ~ sd of logit(m) for large alpha, beta
    ext = np.maximum(_TAIL_SIGMAS * sig, _TAIL_NATS * inv + 2.0 * sig)  # [2, B]: left / right extent
    span = ext[0] + ext[1]
    h_max = np.minimum(_H_CAP, _H_REL / np.sqrt(ab[0] + ab[1]))
    nodes = _NODE_QUANTUM * np.ceil((span / h_max + 2.0) / _NODE_QUANTUM)
    log_ab = np.log(ab)
    return ext[0] + (log_ab[1] - log_ab[0]), span / (nodes - 1.0), nodes


_STEPS: dict[int, np.ndarray] = {}


def _steps(n: int) -> np.ndarray:
    if n not in _STEPS:
        _STEPS[n] = np.arange(n, dtype=np.float64)
    return _STEPS[n]


# (idx or None, e^v [G, n], density [G, n], density sum [G]) per group of samples with the same node count
_PriorTerms = list[tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]]


def _group_terms(ab: np.ndarray, v_start: np.ndarray, step: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """tau-independent part of the trapezoid for samples sharing the node count n: ab [2, G] -> e^v, dens [G, n],
    sum(dens) [G].

    In v = -logit(m): E = e^v = (1-m)/m, the Beta density (w.r.t. v) is m^alpha (1-m)^beta =
    exp(beta v - (alpha+beta) log1p(E)) up to its normaliser, and m_hat = m / (m + (1-m) tau) = 1 / (1 + tau E).
    """
    v = v_start[:, None] - step[:, None] * _steps(n)  # [G, n]
    big_e = np.exp(v)
    log_dens = ab[1][:, None] * v - (ab[0] + ab[1])[:, None] * np.log1p(big_e)
    dens = np.exp(log_dens - np.maximum.reduce(log_dens, axis=-1, keepdims=True))
    return big_e, dens, np.add.reduce(dens, axis=-1)


def _prior_terms(ab: np.ndarray) -> _PriorTerms:
    v_start, step, nodes = _logit_grid(ab)
    if nodes.size and np.equal(nodes, nodes[0]).all():  # usual case: one node count for the whole batch
        return [(None, *_group_terms(ab, v_start, step, int(nodes[0])))]
    groups: _PriorTerms = []
    for n in np.unique(nodes):  # a few distinct node counts at most; each group is fully vectorised
        idx = np.flatnonzero(nodes == n)
        groups.append((idx, *_group_terms(ab[:, idx], v_start[idx], step[idx], int(n))))
    return groups


_MEMO: OrderedDict[bytes, _PriorTerms] = OrderedDict()
_MEMO_MAX_ENTRIES = 256
_MEMO_MAX_BATCH = 4


def _cached_prior_terms(ab: np.ndarray) -> _PriorTerms:
    """Memoised :func:`_prior_terms` for small batches: a stream fed one sample at a time revisits the same
    few (alpha, beta) states. The cached arrays are exactly what would be recomputed (pure function of ab)."""
    if ab.shape[1] > _MEMO_MAX_BATCH:
        return _prior_terms(ab)
    key = ab.tobytes()
    hit = _MEMO.get(key)
    if hit is None:
        hit = _MEMO[key] = _prior_terms(ab)
        if len(_MEMO) > _MEMO_MAX_ENTRIES:
            _MEMO.popitem(last=False)
    return hit


def _expected_weight(ab: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """Unchecked core of :func:`expected_global_weight`: ab [2, B] = (alpha, beta), tau [B] -> e [B].

    tau is clamped to [5e-324, 1.8e308] (so 0 * inf never occurs; nodes where e^v is 0 or inf carry zero
    density); the exact limits e(0) = 1, e(inf) = 0 are applied by the public function.
    """
    tau = np.minimum(np.maximum(tau, _TINY), _HUGE)
    with np.errstate(over="ignore"):  # e^v or tau e^v = inf far in the tails: m_hat = 0 there, as it should
        groups = _cached_prior_terms(ab)
        if groups[0][0] is None:
            _, big_e, dens, total = groups[0]
            return np.add.reduce(dens / (1.0 + tau[:, None] * big_e), axis=-1) / total
        out = np.empty(tau.shape, dtype=np.float64)
        for idx, big_e, dens, total in groups:
            out[idx] = np.add.reduce(dens / (1.0 + tau[idx, None] * big_e), axis=-1) / total
    return out


def expected_global_weight(alpha: object, beta: object, tau_hat: object) -> np.ndarray:
    """e = E_{m ~ Beta(alpha, beta)}[ m / (m + (1 - m) tau_hat) ]  (Eqs. 16-21), vectorised.

    alpha, beta, tau_hat: array-likes broadcast together (e.g. [B]) -> e with the broadcast shape.
    ``tau_hat = 1`` gives alpha / (alpha + beta), ``tau_hat = 0`` gives 1 and ``tau_hat = inf`` gives 0
    (the limits); e is decreasing in tau_hat. Computed by the logit-space trapezoid rule described in the
    module docstring (absolute error <= ~1e-13). Raises ValueError for alpha <= 0, beta <= 0, non-finite
    alpha / beta, and negative or NaN tau_hat.
    """
    one = _scalar_weight(alpha, beta, tau_hat)
    if one is not None:
        return one
    a, b, t = np.broadcast_arrays(
        _float_array("alpha", alpha), _float_array("beta", beta), _float_array("tau_hat", tau_hat)
    )
    _check_weight_inputs(a, b, t)
    t = t.ravel()
    e = _expected_weight(np.stack([a.ravel(), b.ravel()]), t)
    e = np.where(t == 0.0, 1.0, np.where(t == np.inf, 0.0, e))  # the exact limits
    return e.reshape(a.shape)


def _scalar(x: object) -> tuple[float, tuple[int, ...]] | None:
    """(value, shape) of a Python / numpy number or a one-element numeric array; None for anything else."""
    kind = type(x)
    if kind is float or kind is int:
        return float(x), ()  # type: ignore[arg-type]
    if isinstance(x, np.ndarray):
        if x.size == 1 and x.dtype.kind in "fiu":
            return float(x.reshape(-1)[0]), x.shape
        return None
    if isinstance(x, (np.floating, np.integer)):
        return float(x), ()
    return None


def _scalar_weight(alpha: object, beta: object, tau_hat: object) -> np.ndarray | None:
    """The batch-1 fast path of :func:`expected_global_weight` (same checks and messages, no array
    machinery): None unless all three arguments are single numbers."""
    sa, sb, st = _scalar(alpha), _scalar(beta), _scalar(tau_hat)
    if sa is None or sb is None or st is None:
        return None
    (a, shape_a), (b, shape_b), (t, shape_t) = sa, sb, st
    if not (0.0 < a < math.inf):  # NaN fails too
        raise ValueError("alpha must be finite and > 0 (Beta(alpha, beta) prior)")
    if not (0.0 < b < math.inf):
        raise ValueError("beta must be finite and > 0 (Beta(alpha, beta) prior)")
    if not (t >= 0.0):
        raise ValueError("tau_hat must be >= 0 and not NaN (0 and inf are allowed limits)")
    e = 1.0 if t == 0.0 else 0.0 if t == math.inf else _weight_one(a, b, math.log(t))
    shape = shape_a if shape_a == shape_b == shape_t else np.broadcast_shapes(shape_a, shape_b, shape_t)
    return np.full(shape, e)


def _trapezoid(y: np.ndarray, dx: float) -> np.ndarray:
    """Composite trapezoid rule on a uniform grid along the last axis: y [..., n] -> [...]."""
    return dx * (np.sum(y, axis=-1) - 0.5 * (y[..., 0] + y[..., -1]))


_LGAMMA = np.frompyfunc(math.lgamma, 1, 1)


def _betaln(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """log B(a, b) = lgamma(a) + lgamma(b) - lgamma(a + b) (math.lgamma per element; a, b > 0)."""
    return (_LGAMMA(a) + _LGAMMA(b) - _LGAMMA(a + b)).astype(np.float64)


def _trapezoid_from_log_tau(
    alpha: np.ndarray, beta: np.ndarray, log_tau: np.ndarray, n: int = 100, lo: float = 0.01, hi: float = 0.99
) -> np.ndarray:
    mh = np.linspace(lo, hi, n)  # grid in m_hat
    lt = np.clip(log_tau, -700.0, 700.0)[:, None]  # tau_hat = 0 / inf are not representable in Eq. 19
    log_den = np.logaddexp(np.log1p(-mh), np.log(mh) + lt)  # log(1 - m_hat + m_hat tau)
    log_m = np.log(mh) + lt - log_den  # g^{-1}(m_hat), Eq. 17
    log_1m = np.log1p(-mh) - log_den
    log_jac = lt - 2.0 * log_den  # Eq. 18
    log_pdf = (alpha[:, None] - 1.0) * log_m + (beta[:, None] - 1.0) * log_1m - _betaln(alpha, beta)[:, None]
    integrand = mh * np.exp(log_pdf + log_jac)  # m_hat * pdf(m_hat | z), Eq. 19
    return _trapezoid(integrand, (hi - lo) / (n - 1))


def trapezoid_global_weight(alpha: object, beta: object, tau_hat: object) -> np.ndarray:
    """The authors' code variant of e: 100-point trapezoid of m_hat * pdf(m_hat | z) (Eq. 19) on [0.01, 0.99].

    Same arguments / broadcasting / validation as :func:`expected_global_weight`. Vectorised restatement of a
    per-sample loop; biased (the mass of m_hat outside [0.01, 0.99] is dropped and the grid is coarse).
    ``tau_hat`` is clamped to [e^-700, e^700] so 0 / inf give finite (meaningless) values instead of NaN.
    """
    a, b, t = np.broadcast_arrays(
        _float_array("alpha", alpha), _float_array("beta", beta), _float_array("tau_hat", tau_hat)
    )
    _check_weight_inputs(a, b, t)
    with np.errstate(divide="ignore"):
        log_t = np.log(t.ravel())
    return _trapezoid_from_log_tau(a.ravel(), b.ravel(), log_t).reshape(a.shape)


# --------------------------------------------------------------------------------------------------------
# DLE (Sec. 4.1, Eqs. 5-6; geometric mean of Sec. 4.4)
# --------------------------------------------------------------------------------------------------------
def fsq_quantize(z: object, levels: int = 2) -> np.ndarray:
    """Finite scalar quantisation of non-negative (post-ReLU) features, Eq. 5.

    z: [..., D] features >= 0 -> codes [..., D] int8 in {0, ..., levels - 1}: round((levels - 1) * tanh(z)).
    With levels = 2 this is the paper's round(tanh(z)) in {0, 1}: code 1 iff tanh(z) > 0.5, i.e.
    z > atanh(0.5) ~ 0.549 (round-half-to-even sends tanh(z) == 0.5 to 0).
    """
    if int(levels) != levels or levels < 2 or levels > 127:
        raise ValueError(f"levels must be an integer in [2, 127], got {levels!r}")
    arr = _float_array("features", z)
    _require_nonnegative_finite("features", arr)
    return _fsq_codes(arr, int(levels)).astype(np.int8)


def _require_nonnegative_finite(name: str, x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite (no NaN/inf)")
    if (x < 0).any():
        raise ValueError(f"{name} must be non-negative (post-ReLU); fsq maps R+ to {{0, ..., levels-1}}")


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


_TANH_HALF = _tanh_half_threshold()


def _fsq_codes(z: np.ndarray, levels: int) -> np.ndarray:
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
    arr = _float_array("features", features)
    _require_2d("features", arr)
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
    stack = np.stack([_check_freqs(f) for f in dles])
    w = np.ones(len(dles)) if weights is None else _float_array("weights", weights)
    if w.shape != (len(dles),) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be K finite non-negative numbers with a positive sum")
    return np.tensordot(w / w.sum(), stack, axes=1)


def _check_freqs(freqs: object) -> np.ndarray:
    f = _float_array("freqs", freqs)
    _require_2d("freqs", f)
    if f.shape[1] < 2:
        raise ValueError(f"freqs must be [D, levels] with levels >= 2, got shape {f.shape}")
    _require_finite("freqs", f)
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
    f = _check_freqs(freqs)
    c = np.asarray(codes)
    _require_2d("codes", c, cols=f.shape[0])
    if not np.issubdtype(c.dtype, np.integer) or (c.size and (c.min() < 0 or c.max() >= f.shape[1])):
        raise ValueError(f"codes must be integers in [0, {f.shape[1]})")
    sm = DLESmoothing.authors(f.shape[1]) if smoothing is None else smoothing
    table = sm.log_table(f)
    return np.add.reduce(table[np.arange(f.shape[0]), c], axis=-1) / f.shape[0]


# --------------------------------------------------------------------------------------------------------
# CBU: tau_hat (Eqs. 14-15)
# --------------------------------------------------------------------------------------------------------
def log_tau_hat(
    log_q_local: object,
    log_q_global: object,
    h_local: object,
    h_global: object,
    h_local_bar: float,
    h_global_bar: float,
) -> np.ndarray:
    """log tau_hat = exp((H_l - H_l_bar)/H_l_bar) log q_l - exp((H_g - H_g_bar)/H_g_bar) log q_g  (Eq. 15).

    log_q_*: geometric-mean log-likelihoods [B] (<= 0 normally; -inf allowed); h_*: head entropies [B] (nats);
    h_*_bar: mean training entropies (> 0). Returns [B] in [-inf, inf]. Exponents are capped at e^700 so
    u * log q cannot be inf * 0; -inf - (-inf) (both DLEs impossible) is resolved to 0 (tau_hat = 1).
    (The authors' code uses ln(100) for H_g_bar: pass ``h_global_bar=math.log(100)`` to reproduce.)
    """
    hlb = _positive_scalar("h_local_bar", h_local_bar)
    hgb = _positive_scalar("h_global_bar", h_global_bar)
    lql, lqg, hl, hg = np.broadcast_arrays(
        _float_array("log_q_local", log_q_local),
        _float_array("log_q_global", log_q_global),
        _float_array("h_local", h_local),
        _float_array("h_global", h_global),
    )
    if np.isnan(lql).any() or np.isnan(lqg).any():
        raise ValueError("log_q_local / log_q_global must not be NaN")
    _require_finite("h_local", hl)
    _require_finite("h_global", hg)
    h_bar = np.array([[hlb], [hgb]]).reshape((2,) + (1,) * hl.ndim)
    return _log_tau_hat(np.stack([lql, lqg]), np.stack([hl, hg]) - h_bar, h_bar, True)


def _log_tau_hat(log_q: np.ndarray, dh: np.ndarray, h_bar: np.ndarray, may_be_nan: bool) -> np.ndarray:
    """Unchecked Eq. 15 on stacked (local, global) arrays: log_q [2, B], dh = H - H_bar [2, B], h_bar [2, 1].

    The exponents are capped at e^700, so u * log q is never inf * 0; with ``may_be_nan`` (log q = -inf
    possible, i.e. unsmoothed DLEs) -inf - (-inf) is mapped to 0.
    """
    x = np.exp(np.minimum(dh / h_bar, 700.0)) * log_q  # u = exp(log u), Eq. 14
    if not may_be_nan:
        return x[0] - x[1]
    with np.errstate(invalid="ignore"):
        out = x[0] - x[1]
    return np.where(np.isnan(out), 0.0, out)


def tau_hat(
    log_q_local: object,
    log_q_global: object,
    h_local: object,
    h_global: object,
    h_local_bar: float,
    h_global_bar: float,
) -> np.ndarray:
    """tau_hat = q_l^exp((H_l - H_l_bar)/H_l_bar) / q_g^exp((H_g - H_g_bar)/H_g_bar) (Eq. 15); see
    :func:`log_tau_hat` (this is its exp; may under/overflow to 0 / inf, which the weight handles)."""
    with np.errstate(over="ignore"):
        return np.exp(log_tau_hat(log_q_local, log_q_global, h_local, h_global, h_local_bar, h_global_bar))


def soft_clip_log_tau(log_tau: np.ndarray, kb: float = 4.0) -> np.ndarray:
    """Authors' code variant: soft clip of tau_hat into [1/(kb+1), kb+1], done on the log scale.

    log tau -> L tanh(log tau / L) with L = log(kb + 1): identity to first order at tau = 1, monotone,
    saturating at the bounds. (The authors' exact saturating function is not given in SPEC.md; this is our
    smooth choice with the same range. Their bug mapping tau_hat == 1 to 0 is not reproduced.)
    """
    if not (math.isfinite(kb) and kb > 0):
        raise ValueError(f"kb must be finite and > 0, got {kb!r}")
    lim = math.log(kb + 1.0)
    return lim * np.tanh(np.asarray(log_tau, dtype=np.float64) / lim)


# --------------------------------------------------------------------------------------------------------
# HBU: inspection, Beta update, pruning (Eqs. 10-11, Algorithm 1)
# --------------------------------------------------------------------------------------------------------
def detect_events(
    log_tau: np.ndarray, h_local: np.ndarray, h_global: np.ndarray, h_local_bar: float, h_global_bar: float
) -> np.ndarray:
    """Event per sample from tau = Q_l / Q_g (Eq. 9; only its sign, log_tau, matters) and pi (Eq. 10).

    tau > 1 and (H_l < H_l_bar and H_g > H_g_bar) -> EVENT_IND; tau < 1 and (H_l > H_l_bar and
    H_g < H_g_bar) -> EVENT_EXD; otherwise (pi = 0 or tau == 1) EVENT_NONE. Inputs [B] -> int8 [B].
    """
    lt, hl, hg = np.broadcast_arrays(
        _float_array("log_tau", log_tau), _float_array("h_local", h_local), _float_array("h_global", h_global)
    )
    return _events(lt, np.stack([hl - float(h_local_bar), hg - float(h_global_bar)]))


def _events(log_tau: np.ndarray, dh: np.ndarray) -> np.ndarray:
    """Unchecked Eq. 10-11: log_tau [B], dh = H - H_bar stacked (local, global) [2, B] -> int8 [B].

    IND needs sign(dh_l) = -1, sign(dh_g) = +1 with tau > 1; EXD the mirror image with tau < 1, i.e. both
    cases are sign(dh_l) = -s and sign(dh_g) = s with s = sign(log tau) != 0; the event is then -s.
    (For finite floats a - b < 0 exactly when a < b, so this is the strict inequality of Eq. 10.)
    """
    sgn = np.sign(log_tau)
    sd = np.sign(dh)
    neg = -sgn
    ok = (sd[0] == neg) & (sd[1] == sgn)  # NaN log_tau compares False -> no event
    return np.where(ok, neg, 0.0).astype(np.int8)


def _prune(alpha: float, beta: float, lam: float, restart: Restart, restart_c: float) -> tuple[float, float]:
    """Algorithm 1: if alpha + beta > lambda, restart keeping the mean: strength 3 (paper) or 2 + c/10 (authors)."""
    s = alpha + beta
    if s <= lam:
        return alpha, beta
    scale = 1.0 if restart == "paper" else restart_c / 10.0
    return 1.0 + alpha / s * scale, 1.0 + beta / s * scale


def hbu_update(
    alpha: float,
    beta: float,
    event: int,
    lam: float = DEFAULT_LAMBDA,
    restart: Restart = "paper",
    restart_c: float = 10.0,
) -> tuple[float, float]:
    """One Historical Bayesian Update (Eq. 11, our convention) followed by pruning (Algorithm 1).

    EVENT_EXD -> alpha + 1; EVENT_IND -> beta + 1; EVENT_NONE -> unchanged (and no pruning is needed).
    """
    if event == EVENT_EXD:
        alpha += 1.0
    elif event == EVENT_IND:
        beta += 1.0
    elif event != EVENT_NONE:
        raise ValueError(f"event must be one of {EVENT_EXD}, {EVENT_IND}, {EVENT_NONE}, got {event!r}")
    return _prune(alpha, beta, lam, restart, restart_c)


def hbu_sequence(
    alpha: float,
    beta: float,
    events: np.ndarray,
    lam: float = DEFAULT_LAMBDA,
    restart: Restart = "paper",
    restart_c: float = 10.0,
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Run the recursion over a batch: events [B] -> (alphas [B], betas [B], alpha_end, beta_end).

    ``alphas[t], betas[t]`` is the prior used for sample t (built from samples < t); the returned end state
    includes every sample's update. A tight loop over Python scalars (the recursion is inherently serial).
    """
    ab, a, b = _hbu_run(float(alpha), float(beta), np.asarray(events), lam, restart, restart_c)
    return ab[0].copy(), ab[1].copy(), a, b


def _hbu_run(
    a: float, b: float, events: np.ndarray, lam: float, restart: Restart, restart_c: float
) -> tuple[np.ndarray, float, float]:
    """events [B] -> (prior per sample stacked as [2, B] = (alphas, betas), alpha_end, beta_end)."""
    a_seq: list[float] = []
    b_seq: list[float] = []
    for ev in events.tolist():
        a_seq.append(a)
        b_seq.append(b)
        if ev:
            a, b = hbu_update(a, b, ev, lam, restart, restart_c)
    return np.array([a_seq, b_seq], dtype=np.float64).reshape(2, len(a_seq)), a, b


# --------------------------------------------------------------------------------------------------------
# scalar helpers of the batch-1 path (BTFLStream.predict_one)
# --------------------------------------------------------------------------------------------------------
def _softmax_entropy(x: list[float], exp=math.exp, log=math.log, mul=operator.mul  # type: ignore[no-untyped-def]
                     ) -> tuple[list[float], float, float, float]:
    """Python floats: logits -> (exp(x - max), their sum S, entropy H = log Z - sum p x, log Z); p = exp / S.
    (The defaults bind the functions as locals: this runs twice per streamed sample.)"""
    m = max(x)
    ex = [exp(v - m) for v in x]
    s = sum(ex)
    lz = m + log(s)
    return ex, s, lz - sum(map(mul, ex, x)) / s, lz


_Grid = tuple[np.ndarray, np.ndarray]


class _GridCache:
    """Least-recently-used cache of :func:`_one_grid` results, keyed by (alpha, beta). A stream revisits a
    bounded set of Beta states (the prior strength is pruned to lambda); a 2,048-sample stream visits about
    500, so the default holds a whole stream's states (a few MB at most: 32-208 nodes x 2 arrays each)."""

    def __init__(self, size: int) -> None:
        if not (isinstance(size, int) and size >= 1):
            raise ValueError(f"cache_size must be an int >= 1, got {size!r}")
        self.size = size
        self._grids: OrderedDict[tuple[float, float], _Grid] = OrderedDict()

    def get(self, a: float, b: float) -> _Grid:
        key = (a, b)
        hit = self._grids.get(key)
        if hit is None:
            hit = self._grids[key] = _one_grid(a, b)
            if len(self._grids) > self.size:
                self._grids.popitem(last=False)
        else:
            self._grids.move_to_end(key)
        return hit

    def __len__(self) -> int:
        return len(self._grids)


DEFAULT_CACHE_SIZE = 2048
_SHARED_GRIDS = _GridCache(DEFAULT_CACHE_SIZE)  # for expected_global_weight's batch-1 path


def _one_grid(a: float, b: float) -> _Grid:
    """(v / 2 on the logit grid, normalised density weights) of :func:`_logit_grid` for one (alpha, beta)."""
    ab = np.array([[a], [b]])
    v_start, step, nodes = _logit_grid(ab)
    n = int(nodes[0])
    _, dens, total = _group_terms(ab, v_start, step, n)
    return 0.5 * (v_start[0] - step[0] * _steps(n)), dens[0] / total[0]


def _weight_one(a: float, b: float, log_tau: float, grids: _GridCache = _SHARED_GRIDS) -> float:
    """Scalar e of :func:`expected_global_weight` from log tau_hat: m_hat = 1 / (1 + e^(v + log tau)) =
    (1 - tanh((v + log tau) / 2)) / 2 on the same logit-space grid (tanh cannot overflow; weights sum to 1)."""
    half_v, w = grids.get(a, b)
    return 0.5 - 0.5 * float(w @ np.tanh(half_v + 0.5 * log_tau))


# --------------------------------------------------------------------------------------------------------
# the streaming predictor
# --------------------------------------------------------------------------------------------------------
class BTFLStream:
    """BTFL test-time interpolation of a local and a global head over a stream of samples.

    State: the Beta(alpha, beta) prior on m = P(EXD) (starts at Beta(alpha0, beta0) = Beta(1, 1)), the local
    and global DLEs ([D, L] frequencies), and the mean training entropies H_l_bar, H_g_bar (nats).

    Semantics: sample t is weighted with the prior built from samples < t, then updates it, so a batch of B
    samples gives exactly the same outputs as B calls with one sample each (tested bit-for-bit).

    Options (defaults = the paper):
      * ``mixing``: "prob" -> Y = e softmax(g) + (1-e) softmax(l) (Eq. 21); "logprob" (authors' code) ->
        Y = softmax(e log_softmax(g) + (1-e) log_softmax(l)) (a renormalised geometric mixture).
      * ``tau_clip_kb``: None, or kb for the authors' soft clip of tau_hat to [1/(kb+1), kb+1] (kb = 4).
      * ``integral``: "exact" (:func:`expected_global_weight`) or "trapezoid100" (authors' 100-point
        trapezoid on [0.01, 0.99], :func:`trapezoid_global_weight`).
      * ``restart``: "paper" (Algorithm 1: alpha <- 1 + alpha/(alpha+beta)) or "authors"
        (alpha <- alpha/(alpha+beta) * restart_c/10 + 1; restart_c = 10 equals the paper, they use 5..3000).
      * ``smoothing``: :class:`DLESmoothing` for both DLEs (default: authors' 0.6 p + 0.4/levels).
      * ``rectify_h_global_bar``: None (the paper: H_g_bar), or the constant that replaces H_g_bar in the
        global head's rectification r_g of Eq. 15 only; the authors' code hard-codes ln(100) there. The
        inspection pi (Eq. 10) keeps H_g_bar. (``h_global_bar=math.log(100)`` would replace it in both.)
      * ``cache_size``: Beta states whose integration grid the batch-1 path keeps (least recently used
        out); the default holds every state of a stream of a few thousand samples.

    Example::

        stream = BTFLStream(local_dle, global_dle, h_local_bar, h_global_bar)
        probs = stream.predict_one(local_logits, global_logits, features)  # one sample, [C]
        probs = stream.predict(local_logits_b, global_logits_b, features_b)  # a batch, [B, C]
    """

    def __init__(
        self,
        local_dle: object,
        global_dle: object,
        h_local_bar: float,
        h_global_bar: float,
        *,
        lam: float = DEFAULT_LAMBDA,
        smoothing: DLESmoothing | None = None,
        mixing: Mixing = "prob",
        tau_clip_kb: float | None = None,
        integral: Integral = "exact",
        restart: Restart = "paper",
        restart_c: float = 10.0,
        rectify_h_global_bar: float | None = None,
        alpha0: float = 1.0,
        beta0: float = 1.0,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        loc = _check_freqs(local_dle)
        glo = _check_freqs(global_dle)
        if loc.shape != glo.shape:
            raise ValueError(f"local_dle {loc.shape} and global_dle {glo.shape} must have the same shape")
        if mixing not in ("prob", "logprob"):
            raise ValueError(f"mixing must be 'prob' or 'logprob', got {mixing!r}")
        if integral not in ("exact", "trapezoid100"):
            raise ValueError(f"integral must be 'exact' or 'trapezoid100', got {integral!r}")
        if restart not in ("paper", "authors"):
            raise ValueError(f"restart must be 'paper' or 'authors', got {restart!r}")
        if tau_clip_kb is not None:
            _positive_scalar("tau_clip_kb", tau_clip_kb)
        self.dim, self.levels = loc.shape
        self.smoothing = DLESmoothing.authors(self.levels) if smoothing is None else smoothing
        self.h_local_bar = _positive_scalar("h_local_bar", h_local_bar)
        self.h_global_bar = _positive_scalar("h_global_bar", h_global_bar)
        self.lam = _positive_scalar("lam", lam)
        self.restart_c = _positive_scalar("restart_c", restart_c)
        self.alpha0 = _positive_scalar("alpha0", alpha0)
        self.beta0 = _positive_scalar("beta0", beta0)
        self.mixing, self.integral, self.restart, self.tau_clip_kb = mixing, integral, restart, tau_clip_kb
        # [2, D, L] smoothed log-likelihood tables (local, global); -inf only without smoothing
        self._log_tables = np.stack([self.smoothing.log_table(loc), self.smoothing.log_table(glo)])
        self._tables_may_be_inf = not bool(np.isfinite(self._log_tables).all())
        self._dim_index = np.arange(self.dim)
        self._h_bar = np.array([[self.h_local_bar], [self.h_global_bar]])  # [2, 1]
        self._neg_h_bar = -self._h_bar
        # H_bar of the rectification (Eq. 15); differs from _h_bar only with rectify_h_global_bar
        self.rectify_h_global_bar = (self.h_global_bar if rectify_h_global_bar is None
                                     else _positive_scalar("rectify_h_global_bar", rectify_h_global_bar))
        self._h_bar_rect = np.array([[self.h_local_bar], [self.rectify_h_global_bar]])  # [2, 1]
        self._rect_shift = self._h_bar - self._h_bar_rect  # (H - H_bar_rect) = (H - H_bar) + shift
        # batch-1 fast path (predict_one), 2 levels and finite tables: with code c_d in {0, 1},
        # log q = (sum_d T[d, 0] + sum_d c_d (T[d, 1] - T[d, 0])) / D, one [2, D] @ [D] product per sample
        self._q_delta: np.ndarray | None = None
        if self.levels == 2 and not self._tables_may_be_inf:
            self._q_base = (self._log_tables[:, :, 0].sum(1) / self.dim).tolist()
            self._q_delta = (self._log_tables[:, :, 1] - self._log_tables[:, :, 0]) / self.dim
            self._codes = np.empty(self.dim)  # c_d as 0.0 / 1.0, rewritten by every _step_one
        self._grids = _GridCache(cache_size)  # e's grid per Beta state, for the batch-1 path
        self.alpha, self.beta = self.alpha0, self.beta0
        self.last_weights: np.ndarray | None = None  # e per sample of the last predict call, [B]
        self.last_alphas: np.ndarray | None = None  # prior alpha used per sample, [B]
        self.last_betas: np.ndarray | None = None
        self.last_events: np.ndarray | None = None  # EVENT_* per sample, [B]
        self.last_log_tau_hat: np.ndarray | None = None
        self.last_weight: float | None = None  # e of the last predict_one call
        self.last_event: int | None = None

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], **options: object) -> BTFLStream:
        """From a BTFL bundle's ``btfl`` weights (``local_dle``, ``global_dle``, ``h_bar`` = (H_l_bar, H_g_bar));
        ``options`` as in the constructor."""
        missing = {"local_dle", "global_dle", "h_bar"} - set(arrays)
        if missing:
            raise ValueError(f"BTFL arrays lack {', '.join(sorted(missing))} (is this a BTFL bundle's 'btfl' set?)")
        h_bar = np.asarray(arrays["h_bar"], dtype=np.float64).ravel()
        if h_bar.shape != (2,):
            raise ValueError(f"h_bar must hold (H_l_bar, H_g_bar), got shape {h_bar.shape}")
        return cls(arrays["local_dle"], arrays["global_dle"], float(h_bar[0]), float(h_bar[1]), **options)  # type: ignore[arg-type]

    def reset(self) -> None:
        """Back to Beta(alpha0, beta0)."""
        self.alpha, self.beta = self.alpha0, self.beta0

    def predict_one(self, local_logits: object, global_logits: object, features: object) -> np.ndarray:
        """One sample: local_logits [C], global_logits [C], features [D] (>= 0) -> probabilities [C].

        The batch-1 fast path of :meth:`predict` (same semantics and state update): scalar Python math for the
        heads, events, Eq. 15 and the Beta update, one small matrix product for both DLEs and a memoised grid
        for e. Agrees with ``predict`` on the same stream to ~1e-15 (not bit for bit: different summation
        order). Sets ``last_weight`` and ``last_event`` (scalars); the batch ``last_*`` arrays are cleared.
        Falls back to ``predict`` for more than 2 fsq levels or unsmoothed DLEs.
        """
        lo = _float_array("local_logits", local_logits)
        gl = _float_array("global_logits", global_logits)
        ft = _float_array("features", features)
        if lo.ndim != 1 or gl.shape != lo.shape or ft.shape != (self.dim,) or lo.shape[0] < 2:
            raise ValueError(f"predict_one needs local_logits [C], global_logits [C] (C >= 2) and features "
                             f"[{self.dim}]; got {lo.shape}, {gl.shape}, {ft.shape}")
        if self._q_delta is None:
            out = self._predict_batch(*self._validate(lo[None], gl[None], ft[None]))[0]
            self.last_weight, self.last_event = float(self.last_weights[0]), int(self.last_events[0])
            return out
        if not (0.0 <= ft.min() and ft.max() < math.inf):  # NaN fails both comparisons
            raise ValueError("features must be finite and non-negative (post-ReLU)")
        probs, e, event, _, _, _ = self._step_one(lo, gl, ft)
        self.last_weight, self.last_event = e, event
        self.last_weights = self.last_alphas = self.last_betas = self.last_events = self.last_log_tau_hat = None
        return probs

    def _step_one(self, lo: np.ndarray, gl: np.ndarray, ft: np.ndarray
                  ) -> tuple[np.ndarray, float, int, float, float, float]:
        """The scalar path on validated inputs: (probabilities [C], e, event, prior alpha, prior beta,
        log tau_hat); updates the prior."""
        lo_l, gl_l = lo.tolist(), gl.tolist()
        ex_l, s_l, h_l, lz_l = _softmax_entropy(lo_l)
        ex_g, s_g, h_g, lz_g = _softmax_entropy(gl_l)
        if not math.isfinite(h_l + h_g + lz_l + lz_g):  # any NaN / inf logit ends up here
            raise ValueError("local_logits and global_logits must be finite (no NaN/inf)")
        codes = np.greater_equal(ft, _TANH_HALF, out=self._codes, casting="unsafe")  # Eq. 5: round(tanh z)
        q_l, q_g = (self._q_delta @ codes).tolist()
        lq_l, lq_g = self._q_base[0] + q_l, self._q_base[1] + q_g
        dh_l, dh_g = h_l - self.h_local_bar, h_g - self.h_global_bar
        lt_raw = lq_l - lq_g  # sign of log tau (Eq. 9) and the inspection pi (Eq. 10)
        if lt_raw > 0 and dh_l < 0 < dh_g:
            event = EVENT_IND
        elif lt_raw < 0 and dh_g < 0 < dh_l:
            event = EVENT_EXD
        else:
            event = EVENT_NONE
        hgb_rect = self.rectify_h_global_bar
        lt = (math.exp(min(dh_l / self.h_local_bar, 700.0)) * lq_l
              - math.exp(min((h_g - hgb_rect) / hgb_rect, 700.0)) * lq_g)  # Eq. 15
        if self.tau_clip_kb is not None:
            lim = math.log(self.tau_clip_kb + 1.0)
            lt = lim * math.tanh(lt / lim)
        a, b = self.alpha, self.beta
        if self.integral == "exact":
            e = _weight_one(a, b, lt, self._grids)
        else:
            e = float(_trapezoid_from_log_tau(np.array([a]), np.array([b]), np.array([lt]))[0])
        if event:
            self.alpha, self.beta = hbu_update(a, b, event, self.lam, self.restart, self.restart_c)
        if self.mixing == "prob":  # Eq. 21: e softmax(g) + (1 - e) softmax(l)
            c_g, c_l = e / s_g, (1.0 - e) / s_l
            probs = np.array([c_g * pg + c_l * pl for pg, pl in zip(ex_g, ex_l)])
        else:
            ex, s_mix, _, _ = _softmax_entropy([e * (g - lz_g) + (1.0 - e) * (x - lz_l)
                                                for g, x in zip(gl_l, lo_l)])
            probs = np.array(ex) / s_mix
        return probs, e, event, a, b, lt

    def _validate(self, local_logits: object, global_logits: object, features: object) -> tuple[np.ndarray, ...]:
        lo = _float_array("local_logits", local_logits)
        gl = _float_array("global_logits", global_logits)
        ft = _float_array("features", features)
        _require_2d("local_logits", lo)
        _require_2d("global_logits", gl, cols=lo.shape[1], rows=lo.shape[0])
        _require_2d("features", ft, cols=self.dim, rows=lo.shape[0])
        if lo.shape[0] == 0:
            raise ValueError("empty batch: local_logits, global_logits and features have 0 rows")
        if lo.shape[1] < 2:
            raise ValueError(f"need at least 2 classes, got local_logits shape {lo.shape}")
        _require_finite("local_logits", lo)
        _require_finite("global_logits", gl)
        _require_nonnegative_finite("features", ft)
        return lo, gl, ft

    def predict(self, local_logits: object, global_logits: object, features: object) -> np.ndarray:
        """local_logits [B, C], global_logits [B, C], features [B, D] (>= 0) -> probabilities [B, C].

        Sets ``last_weights`` (e per sample, the weight of the global head), ``last_alphas``,
        ``last_betas`` (the prior used per sample), ``last_events`` and ``last_log_tau_hat`` (all [B]).
        Everything is vectorised over the batch except the scalar Beta recursion (:func:`hbu_sequence`);
        e is evaluated once for the whole batch after the prior sequence is known. A batch of one sample
        takes :meth:`predict_one`'s scalar path (same result to ~1e-15, a few times faster).
        """
        if self._q_delta is not None and self._one_valid_row(local_logits, global_logits, features):
            return self._predict_row(local_logits[0], global_logits[0], features[0])  # type: ignore[index]
        lo, gl, ft = self._validate(local_logits, global_logits, features)
        if len(lo) == 1 and self._q_delta is not None:
            return self._predict_row(lo[0], gl[0], ft[0])
        return self._predict_batch(lo, gl, ft)

    def _predict_row(self, lo: np.ndarray, gl: np.ndarray, ft: np.ndarray) -> np.ndarray:
        """:meth:`predict` on one validated row through the scalar path, with the batch fields of a batch of 1."""
        probs, e, event, a, b, lt = self._step_one(lo, gl, ft)
        self.last_weights, self.last_alphas, self.last_betas = np.array([e]), np.array([a]), np.array([b])
        self.last_events, self.last_log_tau_hat = np.array([event]), np.array([lt])
        self.last_weight, self.last_event = e, event
        return probs[None]

    def _one_valid_row(self, lo: object, gl: object, ft: object) -> bool:
        """True for one row of float arrays of the right shapes, finite logits and finite non-negative
        features: the cheap check of predict's batch-1 path. Anything else (including input that is merely
        unusual, e.g. logits whose sum overflows) goes through :meth:`_validate`, which names the problem."""
        if not (type(lo) is np.ndarray and type(gl) is np.ndarray and type(ft) is np.ndarray):
            return False
        if not (lo.ndim == 2 and lo.shape[0] == 1 and lo.shape[1] >= 2 and gl.shape == lo.shape
                and ft.shape == (1, self.dim) and lo.dtype.kind == gl.dtype.kind == ft.dtype.kind == "f"):
            return False
        f = ft[0]
        return math.isfinite(float(lo.sum()) + float(gl.sum())) and 0.0 <= f.min() and f.max() < math.inf

    def _predict_batch(self, lo: np.ndarray, gl: np.ndarray, ft: np.ndarray) -> np.ndarray:
        """The vectorised path of :meth:`predict` on validated inputs."""
        # heads: stacked (local, global) log-probabilities [2, B, C] and entropies [2, B] (numerics.entropy)
        log_p = log_softmax(np.stack((lo, gl)))
        prob = np.exp(log_p)
        dh = self._neg_h_bar - np.add.reduce(prob * log_p, axis=-1)  # H - H_bar, H = -sum p log p
        # DLEs: geometric-mean log-likelihoods log q [2, B] (Eq. 6 and Sec. 4.4)
        codes = _fsq_codes(ft, self.levels)
        log_q = np.add.reduce(self._log_tables[:, self._dim_index, codes], axis=-1) / self.dim
        # HBU events from tau = Q_l / Q_g (Eq. 9, the sign of log q_l - log q_g) and pi (Eq. 10)
        events = _events(log_q[0] - log_q[1], dh)
        # CBU: tau_hat (Eq. 15), optionally soft-clipped (authors' code)
        lt_hat = _log_tau_hat(log_q, dh + self._rect_shift, self._h_bar_rect, self._tables_may_be_inf)
        if self.tau_clip_kb is not None:
            lt_hat = soft_clip_log_tau(lt_hat, self.tau_clip_kb)
        # the prior of each sample (built from the samples before it), then e for the whole batch at once
        ab, self.alpha, self.beta = _hbu_run(self.alpha, self.beta, events, self.lam, self.restart, self.restart_c)
        if self.integral == "exact":
            e = _expected_weight(ab, np.exp(np.minimum(lt_hat, 709.0)))
        else:
            e = _trapezoid_from_log_tau(ab[0], ab[1], lt_hat)
        self.last_weights, self.last_alphas, self.last_betas = e, ab[0], ab[1]
        self.last_events, self.last_log_tau_hat = events, lt_hat
        w = e[:, None]
        if self.mixing == "prob":  # Eq. 21
            return w * prob[1] + (1.0 - w) * prob[0]
        return np.exp(log_softmax(w * log_p[1] + (1.0 - w) * log_p[0]))
