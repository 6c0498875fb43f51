"""Differentially private client embeddings (ODPFL-HN paper, Sec. 7 and App. D). numpy only.

A novel client sends its deep-set embedding ``e = psi(mean_{x in D} phi(x))`` plus Gaussian noise
(Gaussian mechanism, Dwork et al. 2006):

    Delta g  <=  2 L_psi B_phi / |D|                          (Lemma 2: sensitivity of a mean-pooled deep set)
    sigma^2  =   2 (Delta g)^2 ln(1.25 / delta) / eps^2       (Sec. 7)

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

import numpy as np

__all__ = ["gaussian_sigma", "privatize_embedding", "privatize_pooled", "sensitivity", "unit_sphere"]


def _check(epsilon: float, delta: float, set_size: int, bound: float, lipschitz: float) -> None:
    if math.isnan(epsilon) or epsilon <= 0:
        raise ValueError(f"epsilon must be > 0 (math.inf for no privacy), got {epsilon!r}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
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


def gaussian_sigma(epsilon: float, delta: float, set_size: int, bound: float = 1.0,
                   lipschitz: float = 1.0) -> float:
    """Noise std of the Gaussian mechanism, ``sigma = sqrt(2 Delta^2 ln(1.25/delta)) / eps`` (Sec. 7).

    ``epsilon = math.inf`` means no privacy and returns 0. Raises ``ValueError`` for epsilon <= 0,
    delta outside (0, 1), or set_size < 1.
    """
    _check(epsilon, delta, set_size, bound, lipschitz)
    if math.isinf(epsilon):
        return 0.0
    delta_g = sensitivity(set_size, bound, lipschitz)
    return math.sqrt(2.0 * delta_g ** 2 * math.log(1.25 / delta)) / epsilon


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
