"""DPI (Sec. 4.5, Eqs. 16-21): the weight of the global head e = E_{m ~ Beta(alpha, beta)}[m / (m + (1 - m)
tau_hat)], exactly (logit-space trapezoid, see :mod:`edge_sdk._btfl`) or by the authors' 100-point trapezoid.
The tau-independent parts (the density on the grid) are memoised by a :class:`WeightIntegral` object, which a
stream owns; nothing is cached at module level."""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from edge_sdk._btfl.checks import float_array

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


# (idx or None, e^v [G, n], density [G, n], density sum [G]) per group of samples with the same node count
_PriorTerms = list[tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]]


def _group_terms(ab: np.ndarray, v_start: np.ndarray, step: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """tau-independent part of the trapezoid for samples sharing the node count n: ab [2, G] -> e^v, dens [G, n],
    sum(dens) [G].

    In v = -logit(m): E = e^v = (1-m)/m, the Beta density (w.r.t. v) is m^alpha (1-m)^beta =
    exp(beta v - (alpha+beta) log1p(E)) up to its normaliser, and m_hat = m / (m + (1-m) tau) = 1 / (1 + tau E).
    """
    v = v_start[:, None] - step[:, None] * np.arange(n, dtype=np.float64)  # [G, n]
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


_MEMO_MAX_ENTRIES = 256
_MEMO_MAX_BATCH = 4


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
        float_array("alpha", alpha), float_array("beta", beta), float_array("tau_hat", tau_hat)
    )
    _check_weight_inputs(a, b, t)
    t = t.ravel()
    e = WeightIntegral().batch(np.stack([a.ravel(), b.ravel()]), t)
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
    e = 1.0 if t == 0.0 else 0.0 if t == math.inf else WeightIntegral(1).one(a, b, math.log(t))
    shape = shape_a if shape_a == shape_b == shape_t else np.broadcast_shapes(shape_a, shape_b, shape_t)
    return np.full(shape, e)


def _trapezoid(y: np.ndarray, dx: float) -> np.ndarray:
    """Composite trapezoid rule on a uniform grid along the last axis: y [..., n] -> [...]."""
    return dx * (np.sum(y, axis=-1) - 0.5 * (y[..., 0] + y[..., -1]))


_LGAMMA = np.frompyfunc(math.lgamma, 1, 1)


def _betaln(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """log B(a, b) = lgamma(a) + lgamma(b) - lgamma(a + b) (math.lgamma per element; a, b > 0)."""
    return (_LGAMMA(a) + _LGAMMA(b) - _LGAMMA(a + b)).astype(np.float64)


def trapezoid_from_log_tau(
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
        float_array("alpha", alpha), float_array("beta", beta), float_array("tau_hat", tau_hat)
    )
    _check_weight_inputs(a, b, t)
    with np.errstate(divide="ignore"):
        log_t = np.log(t.ravel())
    return trapezoid_from_log_tau(a.ravel(), b.ravel(), log_t).reshape(a.shape)




_Grid = tuple[np.ndarray, np.ndarray]
DEFAULT_CACHE_SIZE = 2048


class WeightIntegral:
    """The exact e (:func:`expected_global_weight`) with the tau-independent parts memoised on this object: the
    prior terms of batches of <= 4 samples (a stream fed a few samples at a time revisits the same (alpha, beta)
    states) and, for the scalar path, the grid of each Beta state (least recently used out beyond
    ``cache_size``; a 2,048-sample stream visits about 500 states, a few MB at most). Memoised arrays are
    exactly what would be recomputed (pure functions of alpha and beta)."""

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if not (isinstance(cache_size, int) and cache_size >= 1):
            raise ValueError(f"cache_size must be an int >= 1, got {cache_size!r}")
        self.cache_size = cache_size
        self._grids: OrderedDict[tuple[float, float], _Grid] = OrderedDict()
        self._memo: OrderedDict[bytes, _PriorTerms] = OrderedDict()

    def grid(self, a: float, b: float) -> _Grid:
        """(v / 2 on the logit grid, normalised density weights) of :func:`_logit_grid` for one (alpha, beta)."""
        key = (a, b)
        hit = self._grids.get(key)
        if hit is None:
            hit = self._grids[key] = _one_grid(a, b)
            if len(self._grids) > self.cache_size:
                self._grids.popitem(last=False)
        else:
            self._grids.move_to_end(key)
        return hit

    def __len__(self) -> int:
        """The number of Beta states whose grid is held."""
        return len(self._grids)

    def one(self, a: float, b: float, log_tau: float) -> float:
        """Scalar e from log tau_hat: m_hat = 1 / (1 + e^(v + log tau)) = (1 - tanh((v + log tau) / 2)) / 2 on the
        same logit-space grid (tanh cannot overflow; the weights sum to 1)."""
        half_v, w = self.grid(a, b)
        return 0.5 - 0.5 * float(w @ np.tanh(half_v + 0.5 * log_tau))

    def _prior_terms(self, ab: np.ndarray) -> _PriorTerms:
        if ab.shape[1] > _MEMO_MAX_BATCH:
            return _prior_terms(ab)
        key = ab.tobytes()
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = _prior_terms(ab)
            if len(self._memo) > _MEMO_MAX_ENTRIES:
                self._memo.popitem(last=False)
        return hit

    def batch(self, ab: np.ndarray, tau: np.ndarray) -> np.ndarray:
        """Unchecked core of :func:`expected_global_weight`: ab [2, B] = (alpha, beta), tau [B] -> e [B].

        tau is clamped to [5e-324, 1.8e308] (so 0 * inf never occurs; nodes where e^v is 0 or inf carry zero
        density); the exact limits e(0) = 1, e(inf) = 0 are applied by the public function.
        """
        tau = np.minimum(np.maximum(tau, _TINY), _HUGE)
        with np.errstate(over="ignore"):  # e^v or tau e^v = inf far in the tails: m_hat = 0 there, as it should
            groups = self._prior_terms(ab)
            if groups[0][0] is None:
                _, big_e, dens, total = groups[0]
                return np.add.reduce(dens / (1.0 + tau[:, None] * big_e), axis=-1) / total
            out = np.empty(tau.shape, dtype=np.float64)
            for idx, big_e, dens, total in groups:
                out[idx] = np.add.reduce(dens / (1.0 + tau[idx, None] * big_e), axis=-1) / total
        return out


def _one_grid(a: float, b: float) -> _Grid:
    ab = np.array([[a], [b]])
    v_start, step, nodes = _logit_grid(ab)
    n = int(nodes[0])
    _, dens, total = _group_terms(ab, v_start, step, n)
    return 0.5 * (v_start[0] - step[0] * np.arange(n, dtype=np.float64)), dens[0] / total[0]
