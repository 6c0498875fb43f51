"""edge_sdk.dp: the Gaussian mechanism on the pooled vector (numpy only, no torch)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edge_sdk import dp


def _pooled(rng: np.random.Generator, n: int = 300, width: int = 6) -> np.ndarray:
    return dp.unit_sphere(rng.normal(size=(n, width))).mean(0)


def test_privatize_pooled_is_psi_of_the_noisy_pooled_vector() -> None:
    rng = np.random.default_rng(0)
    m, w, b = _pooled(rng), rng.normal(size=(4, 6)), rng.normal(size=4)
    assert np.allclose(dp.privatize_pooled(m, w, b, math.inf, 0.01, 300, rng), w @ m + b)  # eps = inf: no noise
    out = dp.privatize_pooled(m, w, b, 0.5, 0.01, 300, np.random.default_rng(3))
    sigma = math.sqrt(2 * (2 / 300) ** 2 * math.log(1.25 / 0.01)) / 0.5  # sensitivity 2 B / |D|, B = 1
    assert np.allclose(out, w @ (m + np.random.default_rng(3).normal(0.0, sigma, 6)) + b)


def test_pooled_noise_is_below_the_spectral_norm_noise_on_e() -> None:
    """Same (eps, delta): the noise reaching e has covariance sigma^2 W W^T <= sigma^2 L^2 I."""
    rng = np.random.default_rng(1)
    m, b = _pooled(rng), np.zeros(3)
    w = np.diag([1000.0, 1.0, 0.01]) @ rng.normal(size=(3, 6)) / 3  # strongly anisotropic, like a standardized psi
    lip = float(np.linalg.norm(w, 2))
    draws = np.stack([dp.privatize_pooled(m, w, b, 1.0, 0.01, 100, rng) for _ in range(4000)]) - w @ m
    on_e = dp.gaussian_sigma(1.0, 0.01, 100, lipschitz=lip)
    assert np.all(draws.std(0) <= on_e * 1.05)
    assert draws.std(0)[2] < 1e-3 * on_e  # the small dimension keeps its small noise


@pytest.mark.parametrize("args, message", [
    ({"pooled": np.ones(6)}, "norm 2.449 > 1: it must be the mean of unit-sphere vectors"),
    ({"psi_weight": np.ones((4, 5))}, r"need pooled \[F\], psi_weight \[E, F\], psi_bias \[E\]"),
    ({"set_size": 0}, "set_size"),
    ({"epsilon": 0.0}, "epsilon must be > 0"),
])
def test_privatize_pooled_rejects_bad_input(args: dict, message: str) -> None:
    good = {"pooled": np.full(6, 0.1), "psi_weight": np.ones((4, 6)), "psi_bias": np.zeros(4), "epsilon": 1.0,
            "delta": 0.01, "set_size": 100, "rng": np.random.default_rng(0)}
    with pytest.raises(ValueError, match=message):
        dp.privatize_pooled(**(good | args))
