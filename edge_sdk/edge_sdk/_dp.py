"""Differentially private client embeddings (ODPFL-HN paper, Sec. 7 and App. D). numpy only.

A novel client sends its deep-set embedding ``e = psi(mean_{x in D} phi(x))`` plus Gaussian noise
(Gaussian mechanism, Dwork et al. 2006):

    Delta g  <=  2 L_psi B_phi / |D|                          (Lemma 2: sensitivity of a mean-pooled deep set)
    sigma    =   analytic Gaussian mechanism for (eps, delta, Delta g)   (Balle & Wang 2018, Algorithm 1)

The paper's Sec. 7 uses the classic calibration ``sigma^2 = 2 Delta^2 ln(1.25/delta) / eps^2`` (Dwork & Roth,
Thm. A.1), which is proven only for eps < 1 and is loose below it. The analytic mechanism gives the smallest
sigma for which ``N(0, sigma^2)`` noise is (eps, delta)-DP, for every eps > 0 (Balle & Wang 2018, Thm. 8):

    Phi(Delta / (2 sigma) - eps sigma / Delta) - e^eps Phi(-Delta / (2 sigma) - eps sigma / Delta)  <=  delta

With the per-sample outputs ``phi(x)`` on the unit sphere (:func:`unit_sphere`) ``B_phi = 1``; ``L_psi`` is the
Lipschitz constant of the linear map after the pooling (its spectral norm; 1 for plain averaging).
``|D|`` is the client's *own* data-set size, so larger clients need less noise.

:func:`privatize_pooled` adds the noise one step earlier, to the pooled vector ``m = mean_{x in D} phi(x)``
(sensitivity ``2 B / |D|``, L = 1), and then applies psi: psi is post-processing, so the guarantee is the same
(eps, delta). It never loses utility against noise on e: the noise reaching e is ``W n`` with covariance
``sigma^2 W W^T``, below the ``sigma^2 L^2 I`` of :func:`privatize_embedding` (``W W^T <= L^2 I``). With a
strongly anisotropic psi (ODPFL-HN's standardized encoder scales some dimensions by ~1e3) the spectral-norm
noise on e swamps every dimension; noise on m keeps each dimension's signal-to-noise ratio that of m.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import numpy as np

__all__ = ["analytic_gaussian_sigma", "classic_gaussian_sigma", "gaussian_sigma", "privacy_loss_delta",
           "privatize_embedding", "privatize_pooled", "sensitivity", "unit_sphere"]


def check_budget(epsilon: float, delta: float) -> None:
    """ValueError (one line) unless ``epsilon`` > 0 (``math.inf``: no privacy) and ``delta`` lies in (0, 1)."""
    if not _real(epsilon) or math.isnan(epsilon) or epsilon <= 0:
        raise ValueError(f"epsilon must be > 0 (math.inf for no privacy), got {epsilon!r}")
    if not _real(delta) or not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")


def _real(value: object) -> bool:
    """A real number (numpy's scalars too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _check(epsilon: float, delta: float, set_size: int, bound: float, lipschitz: float) -> None:
    check_budget(epsilon, delta)
    if int(set_size) != set_size or set_size < 1:
        raise ValueError(f"set_size (the client's number of samples |D|) must be an integer >= 1, got {set_size!r}")
    if not (bound >= 0 and math.isfinite(bound)):
        raise ValueError(f"bound B must be finite and >= 0, got {bound!r}")
    if not (lipschitz >= 0 and math.isfinite(lipschitz)):
        raise ValueError(f"lipschitz L must be finite and >= 0, got {lipschitz!r}")


def sensitivity(set_size: int, bound: float = 1.0, lipschitz: float = 1.0) -> float:
    """L2 sensitivity of a mean-pooled deep-set encoder, ``Delta = 2 L B / |D|`` (Lemma 2)."""
    _check(1.0, 0.5, set_size, bound, lipschitz)
    return 2.0 * lipschitz * bound / int(set_size)


def _phi(t: float) -> float:
    """Standard normal CDF."""
    return 0.5 * math.erfc(-t / math.sqrt(2.0))


def _exp_phi_neg(epsilon: float, t: float) -> float:
    """``e^eps * Phi(-t)`` for t >= 0, in log space (e^eps alone overflows past eps = 709)."""
    tail = 0.5 * math.erfc(t / math.sqrt(2.0))
    return math.exp(epsilon + math.log(tail)) if tail > 0.0 else 0.0


def privacy_loss_delta(epsilon: float, sigma: float, sensitivity_: float = 1.0) -> float:
    """The smallest delta for which ``N(0, sigma^2)`` noise on an L2-sensitivity-``Delta`` query is
    (epsilon, delta)-DP (Balle & Wang 2018, Thm. 8):
    ``Phi(Delta/(2 sigma) - eps sigma/Delta) - e^eps Phi(-Delta/(2 sigma) - eps sigma/Delta)``.

    >>> round(privacy_loss_delta(1.0, analytic_gaussian_sigma(1.0, 1e-5)), 12)
    1e-05
    """
    a, b = sensitivity_ / (2.0 * sigma), epsilon * sigma / sensitivity_
    return _phi(a - b) - _exp_phi_neg(epsilon, a + b)


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity_: float = 1.0) -> float:
    """Noise std of the analytic Gaussian mechanism (Balle & Wang 2018, Algorithm 1): the smallest sigma with
    ``privacy_loss_delta(epsilon, sigma, sensitivity_) <= delta``, valid for every eps > 0 (also eps >= 1, where
    the classic calibration has no proof). numpy-free: ``math.erfc`` and bisection to float precision.

    >>> analytic_gaussian_sigma(1.0, 1e-5) < classic_gaussian_sigma(1.0, 1e-5)
    True
    """
    if not (epsilon > 0 and math.isfinite(epsilon)) or not 0.0 < delta < 1.0 or not sensitivity_ >= 0:
        raise ValueError(f"need finite epsilon > 0, delta in (0, 1), sensitivity >= 0; got {epsilon!r}, "
                         f"{delta!r}, {sensitivity_!r}")
    delta0 = 0.5 - _exp_phi_neg(epsilon, math.sqrt(2.0 * epsilon))  # B(0): where the two branches meet
    if delta >= delta0:  # v* = sup{v >= 0: B+(v) <= delta}, B+ increasing; alpha = sqrt(1 + v/2) - sqrt(v/2)
        def b_plus(v: float) -> float:
            return _phi(math.sqrt(epsilon * v)) - _exp_phi_neg(epsilon, math.sqrt(epsilon * (v + 2.0)))
        v = _bisect(lambda v: b_plus(v) <= delta, lower_ok=True)
        alpha = 1.0 / (math.sqrt(1.0 + v / 2.0) + math.sqrt(v / 2.0))  # the same, without cancellation
    else:  # u* = inf{u >= 0: B-(u) <= delta}, B- decreasing; alpha = sqrt(1 + u/2) + sqrt(u/2)
        def b_minus(u: float) -> float:
            return _phi(-math.sqrt(epsilon * u)) - _exp_phi_neg(epsilon, math.sqrt(epsilon * (u + 2.0)))
        u = _bisect(lambda u: b_minus(u) <= delta, lower_ok=False)
        alpha = math.sqrt(1.0 + u / 2.0) + math.sqrt(u / 2.0)
    return alpha * sensitivity_ / math.sqrt(2.0 * epsilon)


def _bisect(ok: Callable[[float], bool], lower_ok: bool) -> float:
    """The boundary of ``{x >= 0: ok(x)}``: a prefix [0, x*] (``lower_ok``: return its sup) or a suffix
    [x*, inf) (return its inf); doubling for a bracket, then bisection until the floats meet."""
    lo, hi = 0.0, 1.0
    while ok(hi) == lower_ok:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if ok(mid) == lower_ok:
            lo = mid
        else:
            hi = mid
    return lo if lower_ok else hi


def classic_gaussian_sigma(epsilon: float, delta: float, sensitivity_: float = 1.0) -> float:
    """The classic calibration ``sqrt(2 ln(1.25/delta)) Delta / eps`` (the paper's Sec. 7; Dwork & Roth,
    Thm. A.1), kept for comparison: proven only for eps < 1, so :func:`gaussian_sigma` does not use it."""
    return math.sqrt(2.0 * math.log(1.25 / delta)) * sensitivity_ / epsilon


def gaussian_sigma(epsilon: float, delta: float, set_size: int, bound: float = 1.0,
                   lipschitz: float = 1.0) -> float:
    """Noise std for (epsilon, delta)-DP of a client's mean-pooled embedding: the analytic Gaussian
    mechanism (:func:`analytic_gaussian_sigma`) for the sensitivity ``2 L B / |D|`` (Lemma 2).

    ``epsilon = math.inf`` means no privacy and returns 0. Raises ``ValueError`` for epsilon <= 0,
    delta outside (0, 1), or set_size < 1.

    >>> round(gaussian_sigma(1.0, 1e-5, set_size=100), 6) == round(analytic_gaussian_sigma(1.0, 1e-5, 0.02), 6)
    True
    """
    _check(epsilon, delta, set_size, bound, lipschitz)
    if math.isinf(epsilon):
        return 0.0
    return analytic_gaussian_sigma(epsilon, delta, sensitivity(set_size, bound, lipschitz))


def privatize_embedding(embedding: np.ndarray, epsilon: float, delta: float, set_size: int,
                        rng: np.random.Generator, bound: float = 1.0, lipschitz: float = 1.0) -> np.ndarray:
    """``e + N(0, sigma^2 I)`` with sigma from :func:`gaussian_sigma`; ``embedding`` [E] -> [E] (float64).

    ``set_size`` must be the number of samples the embedding was pooled over (the client's own |D|).
    """
    e = np.asarray(embedding, dtype=np.float64)
    sigma = gaussian_sigma(epsilon, delta, set_size, bound, lipschitz)
    if sigma == 0.0:
        return e.copy()
    return e + rng.normal(0.0, sigma, size=e.shape)


def privatize_pooled(pooled: np.ndarray, psi_weight: np.ndarray, psi_bias: np.ndarray, epsilon: float, delta: float,
                     set_size: int, rng: np.random.Generator) -> np.ndarray:
    """``psi(m + N(0, sigma^2 I))`` with ``psi(v) = W v + b`` and sigma for sensitivity ``2 / |D|``: ``pooled`` is
    the mean of the client's unit-sphere per-sample vectors ``m`` [F], ``psi_weight`` [E, F], ``psi_bias`` [E];
    returns the private embedding [E] (float64). ``set_size`` is the client's own |D|."""
    m = np.asarray(pooled, dtype=np.float64)
    w, b = np.asarray(psi_weight, dtype=np.float64), np.asarray(psi_bias, dtype=np.float64)
    if m.ndim != 1 or w.shape != (b.shape[0], m.shape[0]) or b.ndim != 1:
        raise ValueError(f"need pooled [F], psi_weight [E, F], psi_bias [E]; got {m.shape}, {w.shape}, {b.shape}")
    if np.linalg.norm(m) > 1.0 + 1e-6:  # a mean of vectors of norm <= 1 (B = 1); else the sensitivity is wrong
        raise ValueError(f"pooled has norm {np.linalg.norm(m):.4g} > 1: it must be the mean of unit-sphere vectors")
    sigma = gaussian_sigma(epsilon, delta, set_size)
    noisy = m + rng.normal(0.0, sigma, size=m.shape) if sigma > 0.0 else m
    return w @ noisy + b


def unit_sphere(rows: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Per-sample vectors [N, F] scaled to L2 norm 1 (``B_phi = 1``); an all-zero row stays zero (norm <= 1)."""
    arr = np.asarray(rows, dtype=np.float64)
    norm = np.linalg.norm(arr, axis=-1, keepdims=True)
    return arr / np.maximum(norm, eps)
