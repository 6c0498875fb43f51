"""BTFL test-time head interpolation on the device (numpy + scipy only, no torch).

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
geometrically in the step size. The grid is set per sample from (alpha, beta) only (step <= min(0.5,
0.5 * sqrt(1/alpha + 1/beta)), tails cut where the density has dropped by >= e^-36) and the result is
self-normalised by the same rule applied to the density, so no Beta function is needed. Measured
against mpmath / scipy quad: <= 2e-14 absolute for alpha, beta in [1, 20], <= 1e-12 for alpha, beta in
[0.05, 1e7], any tau_hat in [0, inf]; 40-150 nodes for alpha, beta in [1, 20].
"""
from __future__ import annotations

import math
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
_H_CAP = 0.5  # step cap from the strip of analyticity |Im u| < pi
_H_REL = 0.5  # step cap relative to the peak width sqrt(1/alpha + 1/beta)
_NODE_QUANTUM = 16  # node counts are rounded up to a multiple of this (samples are grouped by node count)


def _check_weight_inputs(alpha: np.ndarray, beta: np.ndarray, tau: np.ndarray) -> None:
    if not (np.isfinite(alpha).all() and (alpha > 0).all()):
        raise ValueError("alpha must be finite and > 0 (Beta(alpha, beta) prior)")
    if not (np.isfinite(beta).all() and (beta > 0).all()):
        raise ValueError("beta must be finite and > 0 (Beta(alpha, beta) prior)")
    if np.isnan(tau).any() or (tau < 0).any():
        raise ValueError("tau_hat must be >= 0 and not NaN (0 and inf are allowed limits)")


def _logit_grid(alpha: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample logit-space trapezoid grid from (alpha, beta) only.

    alpha, beta: [B] -> (start [B], step [B], nodes [B] int). Grid u_j = start + step * j, j < nodes.
    """
    sig = np.sqrt(1.0 / alpha + 1.0 / beta)
    mode = np.log(alpha) - np.log(beta)
    left = np.maximum(_TAIL_SIGMAS * sig, _TAIL_NATS / alpha + 2.0 * sig)
    right = np.maximum(_TAIL_SIGMAS * sig, _TAIL_NATS / beta + 2.0 * sig)
    span = left + right
    h_max = np.minimum(_H_CAP, _H_REL * sig)
    need = np.ceil(span / h_max) + 1.0
    nodes = (np.ceil(need / _NODE_QUANTUM) * _NODE_QUANTUM).astype(np.int64)
    return mode - left, span / (nodes - 1), nodes


def _weight_on_grid(
    alpha: np.ndarray, beta: np.ndarray, log_tau: np.ndarray, start: np.ndarray, step: np.ndarray, n: int
) -> np.ndarray:
    """Self-normalised logit-space trapezoid for samples sharing the node count ``n``. All inputs [G] -> [G]."""
    u = start[:, None] + step[:, None] * np.arange(n, dtype=np.float64)  # [G, n]
    log_sig = -np.logaddexp(0.0, -u)  # log sigmoid(u) = log m
    s = alpha + beta
    log_mode = alpha * np.log(alpha / s) + beta * np.log(beta / s)  # max of the log density below
    # log of m^alpha (1-m)^beta = Beta(alpha, beta) density in u, up to the normaliser
    dens = np.exp(s[:, None] * log_sig - beta[:, None] * u - log_mode[:, None])
    with np.errstate(over="ignore"):
        post = dens / (1.0 + np.exp(log_tau[:, None] - u))  # density * m_hat(m)
    return np.sum(post, axis=-1) / np.sum(dens, axis=-1)


def _expected_weight_from_log_tau(alpha: np.ndarray, beta: np.ndarray, log_tau: np.ndarray) -> np.ndarray:
    """Unchecked core of :func:`expected_global_weight`; 1-D float arrays [B], log_tau in [-inf, inf]."""
    start, step, nodes = _logit_grid(alpha, beta)
    if nodes.size and (nodes == nodes[0]).all():  # the usual case: one node count for the whole batch
        return _weight_on_grid(alpha, beta, log_tau, start, step, int(nodes[0]))
    out = np.empty(alpha.shape, dtype=np.float64)
    for n in np.unique(nodes):  # a few distinct node counts at most; each group is fully vectorised
        idx = np.flatnonzero(nodes == n)
        out[idx] = _weight_on_grid(alpha[idx], beta[idx], log_tau[idx], start[idx], step[idx], int(n))
    return out


def expected_global_weight(alpha: object, beta: object, tau_hat: object) -> np.ndarray:
    """e = E_{m ~ Beta(alpha, beta)}[ m / (m + (1 - m) tau_hat) ]  (Eqs. 16-21), vectorised.

    alpha, beta, tau_hat: array-likes broadcast together (e.g. [B]) -> e with the broadcast shape.
    ``tau_hat = 1`` gives alpha / (alpha + beta), ``tau_hat = 0`` gives 1 and ``tau_hat = inf`` gives 0
    (the limits); e is decreasing in tau_hat. Computed by the logit-space trapezoid rule described in the
    module docstring (absolute error <= ~1e-13). Raises ValueError for alpha <= 0, beta <= 0, non-finite
    alpha / beta, and negative or NaN tau_hat.
    """
    a, b, t = np.broadcast_arrays(
        _float_array("alpha", alpha), _float_array("beta", beta), _float_array("tau_hat", tau_hat)
    )
    _check_weight_inputs(a, b, t)
    with np.errstate(divide="ignore"):
        log_t = np.log(t.ravel())
    e = _expected_weight_from_log_tau(a.ravel().copy(), b.ravel().copy(), log_t)
    return e.reshape(a.shape)


def _trapezoid(y: np.ndarray, dx: float) -> np.ndarray:
    """Composite trapezoid rule on a uniform grid along the last axis: y [..., n] -> [...]."""
    return dx * (np.sum(y, axis=-1) - 0.5 * (y[..., 0] + y[..., -1]))


def _trapezoid_from_log_tau(
    alpha: np.ndarray, beta: np.ndarray, log_tau: np.ndarray, n: int = 100, lo: float = 0.01, hi: float = 0.99
) -> np.ndarray:
    from scipy.special import betaln

    mh = np.linspace(lo, hi, n)  # grid in m_hat
    lt = np.clip(log_tau, -700.0, 700.0)[:, None]  # tau_hat = 0 / inf are not representable in Eq. 19
    log_den = np.logaddexp(np.log1p(-mh), np.log(mh) + lt)  # log(1 - m_hat + m_hat tau)
    log_m = np.log(mh) + lt - log_den  # g^{-1}(m_hat), Eq. 17
    log_1m = np.log1p(-mh) - log_den
    log_jac = lt - 2.0 * log_den  # Eq. 18
    log_pdf = (alpha[:, None] - 1.0) * log_m + (beta[:, None] - 1.0) * log_1m - betaln(alpha, beta)[:, None]
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
    With levels = 2 this is the paper's round(tanh(z)) in {0, 1} (threshold z >= atanh(0.5) ~ 0.549;
    round-half-to-even sends tanh(z) == 0.5 to 0).
    """
    if int(levels) != levels or levels < 2 or levels > 127:
        raise ValueError(f"levels must be an integer in [2, 127], got {levels!r}")
    arr = _float_array("features", z)
    _require_finite("features", arr)
    if (arr < 0).any():
        raise ValueError("features must be non-negative (post-ReLU); fsq maps R+ to {0, ..., levels-1}")
    return np.rint((levels - 1) * np.tanh(arr)).astype(np.int8)


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
    return np.sum(table[np.arange(f.shape[0]), c], axis=-1) / f.shape[0]


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
    return _log_tau_hat(lql, lqg, hl, hg, hlb, hgb)


def _log_tau_hat(
    lql: np.ndarray, lqg: np.ndarray, hl: np.ndarray, hg: np.ndarray, hlb: float, hgb: float
) -> np.ndarray:
    u_l = np.exp(np.minimum((hl - hlb) / hlb, 700.0))  # Eq. 14
    u_g = np.exp(np.minimum((hg - hgb) / hgb, 700.0))
    with np.errstate(invalid="ignore"):
        out = u_l * lql - u_g * lqg
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
    lt = np.asarray(log_tau)
    hl = np.asarray(h_local)
    hg = np.asarray(h_global)
    ind = (lt > 0) & (hl < h_local_bar) & (hg > h_global_bar)
    exd = (lt < 0) & (hl > h_local_bar) & (hg < h_global_bar)
    return (exd.astype(np.int8) - ind.astype(np.int8)).astype(np.int8)


def _prune(alpha: float, beta: float, lam: float, restart: Restart, restart_c: float) -> tuple[float, float]:
    """Algorithm 1: if alpha + beta > lambda restart at strength 2 + 1 (paper) or 2 + c/10 (authors)."""
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
    a_seq: list[float] = []
    b_seq: list[float] = []
    a, b = float(alpha), float(beta)
    for ev in np.asarray(events).tolist():
        a_seq.append(a)
        b_seq.append(b)
        if ev:
            a, b = hbu_update(a, b, ev, lam, restart, restart_c)
    return np.array(a_seq, dtype=np.float64), np.array(b_seq, dtype=np.float64), a, b


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
      * The authors' hard-coded H_g_bar = ln(100) is reproduced by ``h_global_bar=math.log(100)``.
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
        alpha0: float = 1.0,
        beta0: float = 1.0,
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
        # [2, D, L] smoothed log-likelihood tables (local, global)
        self._log_tables = np.stack([self.smoothing.log_table(loc), self.smoothing.log_table(glo)])
        self._dim_index = np.arange(self.dim)
        self.alpha, self.beta = self.alpha0, self.beta0
        self.last_weights: np.ndarray | None = None  # e per sample of the last predict call, [B]
        self.last_alphas: np.ndarray | None = None  # prior alpha used per sample, [B]
        self.last_betas: np.ndarray | None = None
        self.last_events: np.ndarray | None = None  # EVENT_* per sample, [B]
        self.last_log_tau_hat: np.ndarray | None = None

    def reset(self) -> None:
        """Back to Beta(alpha0, beta0)."""
        self.alpha, self.beta = self.alpha0, self.beta0

    def _validate(self, local_logits: object, global_logits: object, features: object) -> tuple[np.ndarray, ...]:
        lo = _float_array("local_logits", local_logits)
        gl = _float_array("global_logits", global_logits)
        ft = _float_array("features", features)
        _require_2d("local_logits", lo)
        _require_2d("global_logits", gl, cols=lo.shape[1], rows=lo.shape[0])
        _require_2d("features", ft, cols=self.dim, rows=lo.shape[0])
        if lo.shape[1] < 2:
            raise ValueError(f"need at least 2 classes, got local_logits shape {lo.shape}")
        _require_finite("local_logits", lo)
        _require_finite("global_logits", gl)
        return lo, gl, ft

    def predict(self, local_logits: object, global_logits: object, features: object) -> np.ndarray:
        """local_logits [B, C], global_logits [B, C], features [B, D] (>= 0) -> probabilities [B, C].

        Sets ``last_weights`` (e per sample, the weight of the global head), ``last_alphas``,
        ``last_betas`` (the prior used per sample), ``last_events`` and ``last_log_tau_hat``.
        """
        lo, gl, ft = self._validate(local_logits, global_logits, features)
        codes = fsq_quantize(ft, self.levels)  # validates finite and >= 0
        log_q = np.sum(self._log_tables[:, self._dim_index, codes], axis=-1) / self.dim  # [2, B]
        lp_l = log_softmax(lo)
        lp_g = log_softmax(gl)
        h_l = -np.sum(np.exp(lp_l) * lp_l, axis=-1)  # == numerics.entropy(lo)
        h_g = -np.sum(np.exp(lp_g) * lp_g, axis=-1)
        events = detect_events(log_q[0] - log_q[1], h_l, h_g, self.h_local_bar, self.h_global_bar)
        lt_hat = _log_tau_hat(log_q[0], log_q[1], h_l, h_g, self.h_local_bar, self.h_global_bar)
        if self.tau_clip_kb is not None:
            lt_hat = soft_clip_log_tau(lt_hat, self.tau_clip_kb)
        alphas, betas, self.alpha, self.beta = hbu_sequence(
            self.alpha, self.beta, events, self.lam, self.restart, self.restart_c
        )
        if self.integral == "exact":
            e = _expected_weight_from_log_tau(alphas, betas, lt_hat)
        else:
            e = _trapezoid_from_log_tau(alphas, betas, lt_hat)
        self.last_weights, self.last_alphas, self.last_betas = e, alphas, betas
        self.last_events, self.last_log_tau_hat = events, lt_hat
        w = e[:, None]
        if self.mixing == "prob":
            return w * np.exp(lp_g) + (1.0 - w) * np.exp(lp_l)
        return np.exp(log_softmax(w * lp_g + (1.0 - w) * lp_l))
