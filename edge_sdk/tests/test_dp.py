"""edge_sdk._dp: the Gaussian mechanism on the pooled vector (numpy only, no torch)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edge_sdk import _dp as dp


def _pooled(rng: np.random.Generator, n: int = 300, width: int = 6) -> np.ndarray:
    return dp.unit_sphere(rng.normal(size=(n, width))).mean(0)


def test_privatize_pooled_is_psi_of_the_noisy_pooled_vector() -> None:
    rng = np.random.default_rng(0)
    m, w, b = _pooled(rng), rng.normal(size=(4, 6)), rng.normal(size=4)
    assert np.allclose(dp.privatize_pooled(m, w, b, math.inf, 0.01, 300, rng), w @ m + b)  # eps = inf: no noise
    out = dp.privatize_pooled(m, w, b, 0.5, 0.01, 300, np.random.default_rng(3))
    sigma = dp.analytic_gaussian_sigma(0.5, 0.01, 2 / 300)  # sensitivity 2 B / |D|, B = 1
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


# Balle & Wang 2018: the analytic Gaussian mechanism (Algorithm 1) against its defining equation (Thm. 8)
GRID = [(eps, delta) for eps in (0.05, 0.3, 1.0, 2.0, 4.0, 8.0, 50.0) for delta in (1e-9, 1e-5, 1e-2, 0.4)]


@pytest.mark.parametrize("eps, delta", GRID)
def test_analytic_sigma_solves_the_defining_equation(eps: float, delta: float) -> None:
    """sigma is the smallest noise that is (eps, delta)-DP: Thm. 8's delta(sigma) equals the target at sigma
    and exceeds it just below (delta(sigma) decreases in sigma); it scales linearly with the sensitivity."""
    sigma = dp.analytic_gaussian_sigma(eps, delta)
    assert dp.privacy_loss_delta(eps, sigma) == pytest.approx(delta, rel=1e-9, abs=1e-15)
    assert dp.privacy_loss_delta(eps, sigma * (1 - 1e-6)) > delta
    assert dp.privacy_loss_delta(eps, sigma * (1 + 1e-6)) < delta
    assert dp.analytic_gaussian_sigma(eps, delta, 0.25) == pytest.approx(0.25 * sigma, rel=1e-12)


def test_analytic_sigma_known_values_and_the_classic_calibration() -> None:
    """eps = 1, delta = 1e-5, Delta = 1: 3.7306 (Balle & Wang's Fig. 2 region; the classic formula gives 4.84).
    For eps >= 1 the classic formula has no proof, and at eps = 8 it is not private: its noise is below the
    analytic minimum and its real delta is larger than the target."""
    assert dp.analytic_gaussian_sigma(1.0, 1e-5) == pytest.approx(3.730632, abs=1e-6)
    assert dp.classic_gaussian_sigma(1.0, 1e-5) == pytest.approx(4.844805, abs=1e-6)
    for eps, delta in ((0.1, 1e-5), (0.5, 1e-3), (0.9, 0.01)):  # eps < 1: the classic calibration is valid, looser
        assert dp.analytic_gaussian_sigma(eps, delta) < dp.classic_gaussian_sigma(eps, delta)
        assert dp.privacy_loss_delta(eps, dp.classic_gaussian_sigma(eps, delta)) < delta
    classic = dp.classic_gaussian_sigma(8.0, 1e-3)
    assert classic < dp.analytic_gaussian_sigma(8.0, 1e-3) and dp.privacy_loss_delta(8.0, classic) > 1e-3


@pytest.mark.parametrize("eps", [1.0, 4.0, 8.0])
def test_epsilon_of_one_and_more_is_calibrated(eps: float) -> None:
    """The SDK's eps >= 1 budgets get the analytic noise: the empirical std of the privatized embedding matches
    it, and the noise keeps shrinking with eps."""
    n, delta = 50, 1e-5
    sigma = dp.gaussian_sigma(eps, delta, n)
    assert sigma == pytest.approx(dp.analytic_gaussian_sigma(eps, delta, dp.sensitivity(n)))
    assert dp.privacy_loss_delta(eps, sigma, dp.sensitivity(n)) == pytest.approx(delta, rel=1e-9)
    assert dp.gaussian_sigma(2 * eps, delta, n) < sigma
    draws = dp.privatize_embedding(np.zeros(20000), eps, delta, n, np.random.default_rng(1))
    assert draws.std() == pytest.approx(sigma, rel=0.03)


@pytest.mark.parametrize("args, message", [
    ((0.0, 1e-5), "finite epsilon > 0"), ((math.inf, 1e-5), "finite epsilon > 0"),
    ((1.0, 0.0), "delta in"), ((1.0, 1.0), "delta in"), ((1.0, 1e-5, -1.0), "sensitivity >= 0"),
])
def test_analytic_sigma_refuses_bad_parameters(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dp.analytic_gaussian_sigma(*args)
