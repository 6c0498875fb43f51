"""BTFL device math (edge_sdk._btfl): the exact weight vs scipy quad, DLE, tau_hat, HBU, the streaming predictor.

The SDK's tests run where scipy is absent (scripts/check_edge_sdk_venv.sh): there the weight is checked against
quad values committed below, and the test that recomputes quad on 2,000 triples is skipped."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from edge_sdk._btfl import (
    EVENT_EXD,
    EVENT_IND,
    EVENT_NONE,
    BTFLStream,
    BTFLVariant,
    DLESmoothing,
    average_dles,
    detect_events,
    dle_log_likelihood,
    expected_global_weight,
    fit_dle,
    fsq_quantize,
    hbu_sequence,
    hbu_update,
    log_tau_hat,
    soft_clip_log_tau,
    tau_hat,
    trapezoid_global_weight,
)
from edge_sdk import _btfl as btfl, entropy, softmax


# ------------------------------------------------------------------------------------------------------
# the exact integral e = E_{m ~ Beta(a, b)}[m / (m + (1 - m) t)]
# ------------------------------------------------------------------------------------------------------
def quad_reference(a: float, b: float, t: float) -> float:
    """Slow per-sample reference: scipy quad of Beta(m; a, b) * m / (m + (1 - m) t) over [0, 1]; the point
    where m_hat = 1/2 (m = t / (1 + t)) is passed as a breakpoint so quad sees the sharp transition."""
    from scipy import integrate  # a test-only reference: the SDK itself has no scipy

    log_norm = _log_beta(a, b)

    def integrand(m: float) -> float:
        if m <= 0.0 or m >= 1.0:
            return 0.0
        pdf = math.exp((a - 1.0) * math.log(m) + (b - 1.0) * math.log1p(-m) - log_norm)
        return pdf * m / (m + (1.0 - m) * t)

    value, _ = integrate.quad(integrand, 0.0, 1.0, points=[t / (1.0 + t)], epsabs=1e-13, epsrel=1e-11, limit=400)
    return value


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


CORNERS = [(a, b, t) for a in (1.0, 20.0) for b in (1.0, 20.0) for t in (1e-6, 1.0, 1e6)] + [
    # the closed form a/(a+b) 2F1(1, b; a+b+1; 1-t) evaluated with scipy.special.hyp2f1 (scipy 1.17) gives
    # +-inf at the first four points and is off by 3e-6 at the fifth (c - a - b integer, z -> 1)
    (1.0, 1.3, 1e-3),
    (1.3, 1.0, 1e3),
    (1.0, 1.3, 1e-6),
    (1.0, 1.0 + 1e-7, 1e-3),
    (2.0, 1.3, 1e-3),
    (2.0, 1.0 + 1e-12, 1e-4),
]


# (alpha, beta, tau_hat, e): quad_reference (scipy 1.17.1) on 24 random triples and on CORNERS, committed for
# where scipy is absent
QUAD_VALUES = [
    (18.206481, 13.127577, 0.643862, 0.6801184304733525),
    (2.467309, 10.096318, 0.000931442, 0.9937065945541795),
    (6.178825, 10.521671, 8.30384, 0.07111205555397479),
    (12.815159, 13.937961, 7.90438e-05, 0.9999067647640482),
    (18.74654, 2.055268, 1.57781e-05, 0.999998172706872),
    (2.613989, 14.942709, 0.782057, 0.18067953370991144),
    (12.955366, 13.412892, 3.99321e-05, 0.9999552019730233),
    (15.735863, 18.100035, 135.599, 0.006734785384980132),
    (10.717427, 12.817089, 24.5628, 0.03537591700083095),
    (15.221647, 19.840379, 0.388551, 0.6579662569355106),
    (17.729338, 10.448102, 0.000261274, 0.99983685556389),
    (10.483786, 14.690838, 0.0657436, 0.9089956764982916),
    (16.103197, 1.818815, 214387.0, 9.156859241035519e-05),
    (2.048273, 5.928851, 176.357, 0.002346115631426626),
    (14.876824, 4.287352, 5339.25, 0.0008464867721581827),
    (15.685152, 11.358823, 6.51084e-05, 0.9999496422434149),
    (2.262929, 9.515587, 429079.0, 6.193250387997442e-07),
    (2.996124, 4.663192, 0.0221063, 0.953243538439722),
    (8.411799, 9.809543, 0.0319875, 0.9598012792490291),
    (7.195685, 3.506857, 0.0347926, 0.9808757602420209),
    (5.782017, 9.573841, 1.56253e-05, 0.9999687187220053),
    (17.015619, 19.178212, 852.163, 0.0010970838982982086),
    (1.134358, 10.70732, 0.00163904, 0.9519932109929403),
    (4.440949, 9.538352, 0.811874, 0.361152812513143),
    (1.0, 1.0, 1e-06, 0.9999871844628111),
    (1.0, 1.0, 1.0, 0.5),
    (1.0, 1.0, 1000000.0, 1.2815537189031546e-05),
    (1.0, 20.0, 1e-06, 0.9997956398904659),
    (1.0, 20.0, 1.0, 0.04761904761904762),
    (1.0, 20.0, 1000000.0, 5.263157309941623e-08),
    (20.0, 1.0, 1e-06, 0.9999999473684272),
    (20.0, 1.0, 1.0, 0.9523809523809526),
    (20.0, 1.0, 1000000.0, 0.0002043601095340108),
    (20.0, 20.0, 1e-06, 0.9999989473696488),
    (20.0, 20.0, 1.0, 0.5000000000000002),
    (20.0, 20.0, 1000000.0, 1.0526303508787826e-06),
    (1.0, 1.3, 0.001, 0.9925314940736069),
    (1.3, 1.0, 1000.0, 0.007468505926392928),
    (1.0, 1.3, 1e-06, 0.9999835702290055),
    (1.0, 1.0000001, 0.001, 0.9940794089324003),
    (2.0, 1.3, 0.001, 0.9987158934570867),
    (2.0, 1.000000000001, 0.0001, 0.9999001542570806),
]


def test_weight_matches_committed_quad_values() -> None:
    a, b, t, ref = np.array(QUAD_VALUES).T
    err = np.abs(expected_global_weight(a, b, t) - ref)
    assert err.max() < 1e-9, (err.max(), QUAD_VALUES[int(err.argmax())])
    assert [row[:3] for row in QUAD_VALUES[-len(CORNERS):]] == CORNERS  # the hard corners are all there


def test_weight_matches_quad_on_10000_triples() -> None:
    pytest.importorskip("scipy", reason="the quad reference needs scipy (the committed values above do not)")
    rng = np.random.default_rng(20250803)
    n = 10_000
    a = rng.uniform(1.0, 20.0, n)
    b = rng.uniform(1.0, 20.0, n)
    t = np.exp(rng.uniform(math.log(1e-6), math.log(1e6), n))
    corners = np.array(CORNERS)
    a, b, t = (np.concatenate([x, corners[:, i]]) for i, x in enumerate((a, b, t)))
    e = expected_global_weight(a, b, t)  # vectorised, all 10,000 + corners in one call
    assert e.shape == a.shape and np.isfinite(e).all() and (e >= 0).all() and (e <= 1).all()
    subset = np.concatenate([rng.choice(n, 2_000, replace=False), np.arange(n, len(a))])
    ref = np.array([quad_reference(a[i], b[i], t[i]) for i in subset])
    err = np.abs(e[subset] - ref)
    assert err.max() < 1e-6, (err.max(), subset[err.argmax()])
    assert err.max() < 1e-9  # what we actually achieve (quad itself is good to ~1e-11 here)


def test_weight_tau_one_is_prior_mean() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.uniform(0.2, 50.0, 500), rng.uniform(0.2, 50.0, 500)
    np.testing.assert_allclose(expected_global_weight(a, b, 1.0), a / (a + b), rtol=0, atol=1e-13)
    assert expected_global_weight(1.0, 1.0, 1.0) == pytest.approx(0.5, abs=1e-15)


def test_weight_limits_symmetry_and_broadcasting() -> None:
    a = np.array([1.0, 2.5, 20.0])
    np.testing.assert_array_equal(expected_global_weight(a, 3.0, 0.0), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(expected_global_weight(a, 3.0, np.inf), [0.0, 0.0, 0.0])
    np.testing.assert_allclose(expected_global_weight(a, 3.0, 1e-300), 1.0, atol=1e-12)
    np.testing.assert_allclose(expected_global_weight(a, 3.0, 1e300), 0.0, atol=1e-12)
    # e(a, b, t) = 1 - e(b, a, 1/t)  (swap IND / EXD)
    rng = np.random.default_rng(2)
    aa, bb, tt = rng.uniform(1, 20, 300), rng.uniform(1, 20, 300), np.exp(rng.uniform(-14, 14, 300))
    np.testing.assert_allclose(
        expected_global_weight(aa, bb, tt), 1 - expected_global_weight(bb, aa, 1 / tt), atol=1e-13
    )
    out = expected_global_weight(np.array([[1.0], [2.0]]), np.array([1.0, 3.0, 5.0]), 0.5)
    assert out.shape == (2, 3)
    assert expected_global_weight(2.0, 3.0, 0.7).shape == ()


def test_weight_is_decreasing_in_tau() -> None:
    taus = np.logspace(-8, 8, 801)
    for a, b in [(1.0, 1.0), (1.0, 20.0), (20.0, 1.0), (7.3, 2.2), (0.3, 0.5), (300.0, 40.0)]:
        e = expected_global_weight(a, b, taus)
        assert (np.diff(e) <= 1e-15).all(), (a, b)
        assert (np.diff(e[::40]) < 0).all(), (a, b)  # strictly, on a coarser grid


@pytest.mark.parametrize(
    ("alpha", "beta", "tau", "message"),
    [
        (0.0, 1.0, 1.0, "alpha must be finite and > 0"),
        (-1.0, 1.0, 1.0, "alpha must be finite and > 0"),
        (np.nan, 1.0, 1.0, "alpha must be finite and > 0"),
        (1.0, 0.0, 1.0, "beta must be finite and > 0"),
        (1.0, [2.0, -3.0], 1.0, "beta must be finite and > 0"),
        (1.0, 1.0, -0.5, "tau_hat must be >= 0 and not NaN"),
        (1.0, 1.0, np.nan, "tau_hat must be >= 0 and not NaN"),
    ],
)
def test_weight_rejects_bad_input(alpha: object, beta: object, tau: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expected_global_weight(alpha, beta, tau)
    with pytest.raises(ValueError, match=message):
        trapezoid_global_weight(alpha, beta, tau)


def trapezoid_loop(a: float, b: float, t: float) -> float:
    """Per-sample restatement of the authors' integral: 100-point trapezoid of Eq. 19 on [0.01, 0.99]."""
    mh = np.linspace(0.01, 0.99, 100)
    m = mh * t / (1 + mh * t - mh)
    pdf = np.exp((a - 1) * np.log(m) + (b - 1) * np.log1p(-m) - _log_beta(a, b)) * t / (1 + mh * t - mh) ** 2
    y = mh * pdf
    return float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(mh)))


def test_trapezoid_variant_matches_its_loop_and_is_close_to_exact_in_the_bulk() -> None:
    rng = np.random.default_rng(3)
    a, b, t = rng.uniform(1, 20, 200), rng.uniform(1, 20, 200), np.exp(rng.uniform(-5, 5, 200))
    vec = trapezoid_global_weight(a, b, t)
    np.testing.assert_allclose(vec, [trapezoid_loop(*x) for x in zip(a, b, t)], rtol=1e-10, atol=1e-13)
    a, b, t = rng.uniform(2, 10, 200), rng.uniform(2, 10, 200), np.exp(rng.uniform(-1, 1, 200))
    assert np.abs(trapezoid_global_weight(a, b, t) - expected_global_weight(a, b, t)).max() < 1e-2


# ------------------------------------------------------------------------------------------------------
# DLE
# ------------------------------------------------------------------------------------------------------
FEATURES = np.array([[0.0, 1.0, 2.0], [0.6, 0.5, 0.0], [3.0, 0.1, 0.55]])
# tanh: [[0, .76, .96], [.54, .46, 0], [.995, .10, .5005]] -> codes [[0,1,1],[1,0,0],[1,0,1]]


def test_fsq_and_fit_dle_hand_example() -> None:
    codes = fsq_quantize(FEATURES)
    np.testing.assert_array_equal(codes, [[0, 1, 1], [1, 0, 0], [1, 0, 1]])
    assert codes.dtype == np.int8
    freqs = fit_dle(FEATURES)
    np.testing.assert_allclose(freqs, [[1 / 3, 2 / 3], [2 / 3, 1 / 3], [1 / 3, 2 / 3]], atol=1e-15)
    np.testing.assert_array_equal(fsq_quantize(np.array([5.0, 1.0, 0.3]), levels=3), [2, 2, 1])  # round(2 tanh z)


def test_dle_log_likelihood_hand_example() -> None:
    freqs = fit_dle(FEATURES)
    codes = np.array([[0, 0, 0], [1, 1, 1], [0, 1, 1]])
    raw = dle_log_likelihood(codes, freqs, DLESmoothing.none())
    expected_raw = [
        (math.log(1 / 3) + math.log(2 / 3) + math.log(1 / 3)) / 3,
        (math.log(2 / 3) + math.log(1 / 3) + math.log(2 / 3)) / 3,
        (math.log(1 / 3) + math.log(1 / 3) + math.log(2 / 3)) / 3,
    ]
    np.testing.assert_allclose(raw, expected_raw, rtol=1e-15)
    # default = authors' log(0.6 p + 0.2): 1/3 -> 0.4, 2/3 -> 0.6
    default = dle_log_likelihood(codes, freqs)
    np.testing.assert_allclose(
        default,
        [
            (2 * math.log(0.4) + math.log(0.6)) / 3,
            (2 * math.log(0.6) + math.log(0.4)) / 3,
            (2 * math.log(0.4) + math.log(0.6)) / 3,
        ],
        rtol=1e-15,
    )
    # additive (Laplace, 1 pseudo-count, n = 3): (n_k + 1) / (3 + 2) -> 1/3 -> 2/5, 2/3 -> 3/5
    lap = dle_log_likelihood(codes, freqs, DLESmoothing.additive(1.0, n_train=3, levels=2))
    np.testing.assert_allclose(lap, default, rtol=1e-14)  # coincides with 0.6 p + 0.2 for n = 3
    assert DLESmoothing.authors(2) == DLESmoothing(0.6, 0.2)
    assert DLESmoothing.authors(4) == DLESmoothing(0.6, 0.1)


def test_smoothing_prevents_minus_inf() -> None:
    freqs = np.array([[1.0, 0.0], [0.5, 0.5]])  # level 1 never seen in dimension 0
    codes = np.array([[1, 0]])
    assert dle_log_likelihood(codes, freqs, DLESmoothing.none())[0] == -np.inf
    for sm in (None, DLESmoothing.authors(2), DLESmoothing.additive(0.5, n_train=100)):
        assert np.isfinite(dle_log_likelihood(codes, freqs, sm)).all()
    # tau_hat and the weight stay defined even with -inf likelihoods (no smoothing)
    lt = log_tau_hat([-np.inf, -np.inf, -1.0], [-np.inf, -1.0, -np.inf], [1.0] * 3, [1.0] * 3, 1.0, 1.0)
    np.testing.assert_array_equal(lt, [0.0, -np.inf, np.inf])
    np.testing.assert_allclose(expected_global_weight(1.0, 1.0, np.exp(lt)), [0.5, 1.0, 0.0], atol=1e-15)


def test_average_dles() -> None:
    f1 = np.array([[1.0, 0.0], [0.5, 0.5]])
    f2 = np.array([[0.0, 1.0], [0.25, 0.75]])
    np.testing.assert_allclose(average_dles([f1, f2]), [[0.5, 0.5], [0.375, 0.625]])
    np.testing.assert_allclose(average_dles([f1, f2], weights=[3, 1]), [[0.75, 0.25], [0.4375, 0.5625]])


def test_dle_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="features must be non-negative"):
        fsq_quantize(np.array([[0.5, -0.1]]))
    with pytest.raises(ValueError, match="features must be finite"):
        fit_dle(np.array([[0.5, np.nan]]))
    with pytest.raises(ValueError, match="features must be 2-D"):
        fit_dle(np.zeros(4))
    with pytest.raises(ValueError, match="levels must be an integer in"):
        fsq_quantize(np.zeros(3), levels=1)
    with pytest.raises(ValueError, match="freqs rows must be probability vectors"):
        dle_log_likelihood(np.zeros((1, 2), dtype=int), np.array([[0.7, 0.7], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="codes must have 2 columns"):
        dle_log_likelihood(np.zeros((1, 3), dtype=int), np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match=r"codes must be integers in \[0, 2\)"):
        dle_log_likelihood(np.array([[0, 2]]), np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="smoothing needs finite a >= 0 and b >= 0"):
        DLESmoothing(0.6, -0.1)


# ------------------------------------------------------------------------------------------------------
# tau_hat (Eq. 15) and the soft clip
# ------------------------------------------------------------------------------------------------------
def test_tau_hat_eq15_hand_example() -> None:
    lql, lqg, hl, hg, hlb, hgb = -0.5, -0.7, 1.0, 0.5, 0.5, 1.0
    q_l, q_g = math.exp(lql), math.exp(lqg)
    expected = q_l ** math.exp((hl - hlb) / hlb) / q_g ** math.exp((hg - hgb) / hgb)
    assert tau_hat(lql, lqg, hl, hg, hlb, hgb) == pytest.approx(expected, rel=1e-14)
    assert log_tau_hat(lql, lqg, hl, hg, hlb, hgb) == pytest.approx(math.log(expected), rel=1e-14)
    # at H = H_bar the exponents are 1 and tau_hat = tau = q_l / q_g (Eq. 9)
    assert tau_hat(lql, lqg, hlb, hgb, hlb, hgb) == pytest.approx(math.exp(lql - lqg), rel=1e-14)
    with pytest.raises(ValueError, match="h_local_bar must be a finite number > 0"):
        tau_hat(lql, lqg, hl, hg, 0.0, hgb)
    with pytest.raises(ValueError, match="must not be NaN"):
        tau_hat(np.nan, lqg, hl, hg, hlb, hgb)


def test_soft_clip() -> None:
    lt = np.linspace(-50, 50, 1001)
    c = soft_clip_log_tau(lt, kb=4.0)
    assert (np.abs(c) <= math.log(5.0)).all() and (np.diff(c) >= 0).all()  # saturates at [1/5, 5]
    assert (np.diff(soft_clip_log_tau(np.linspace(-5, 5, 101))) > 0).all()
    assert soft_clip_log_tau(np.array([0.0]))[0] == 0.0  # tau_hat = 1 stays 1 (no authors' bug)
    assert soft_clip_log_tau(np.array([1e-4]))[0] == pytest.approx(1e-4, rel=1e-6)


# ------------------------------------------------------------------------------------------------------
# HBU: events, update, pruning
# ------------------------------------------------------------------------------------------------------
def test_detect_events_truth_table() -> None:
    # (log tau, H_l, H_g) with H_l_bar = H_g_bar = 1
    cases = [
        (+1.0, 0.5, 1.5, EVENT_IND),  # local fits, local confident, global unsure
        (-1.0, 1.5, 0.5, EVENT_EXD),  # global fits, local unsure, global confident
        (+1.0, 1.5, 0.5, EVENT_NONE),  # inspection fails
        (-1.0, 0.5, 1.5, EVENT_NONE),
        (+1.0, 0.5, 0.5, EVENT_NONE),
        (0.0, 0.5, 1.5, EVENT_NONE),  # tau == 1
        (+1.0, 1.0, 1.5, EVENT_NONE),  # strict inequalities
        (np.nan, 1.5, 0.5, EVENT_NONE),
    ]
    lt, hl, hg, want = (np.array(x) for x in zip(*cases))
    np.testing.assert_array_equal(detect_events(lt, hl, hg, 1.0, 1.0), want)


def test_hbu_update_convention_and_pruning() -> None:
    assert hbu_update(1.0, 1.0, EVENT_EXD) == (2.0, 1.0)  # EXD evidence -> alpha (m = P(EXD))
    assert hbu_update(1.0, 1.0, EVENT_IND) == (1.0, 2.0)
    assert hbu_update(1.0, 1.0, EVENT_NONE) == (1.0, 1.0)
    # Algorithm 1: 15 + 1 + 1 = 17 > 16 -> (1 + 16/17, 1 + 1/17)
    a, b = hbu_update(15.0, 1.0, EVENT_EXD, lam=16.0)
    assert (a, b) == pytest.approx((1 + 16 / 17, 1 + 1 / 17), rel=1e-15)
    assert hbu_update(14.0, 1.0, EVENT_EXD, lam=16.0) == (15.0, 1.0)  # 16 is not > 16
    a, b = hbu_update(15.0, 1.0, EVENT_EXD, lam=16.0, restart="authors", restart_c=300.0)
    assert (a, b) == pytest.approx((16 / 17 * 30 + 1, 1 / 17 * 30 + 1), rel=1e-15)
    a, b = hbu_update(15.0, 1.0, EVENT_EXD, lam=16.0, restart="authors", restart_c=10.0)
    assert (a, b) == pytest.approx((1 + 16 / 17, 1 + 1 / 17), rel=1e-15)  # c = 10 is the paper's rule
    with pytest.raises(ValueError, match="event must be one of"):
        hbu_update(1.0, 1.0, 2)


@pytest.mark.parametrize("lam", [5.0, 16.0, 20.0])
def test_pruning_keeps_strength_bounded(lam: float) -> None:
    events = np.random.default_rng(4).choice([EVENT_EXD, EVENT_IND, EVENT_NONE], size=5_000, p=[0.5, 0.3, 0.2])
    alphas, betas, a_end, b_end = hbu_sequence(1.0, 1.0, events, lam=lam)
    strength = np.append(alphas + betas, a_end + b_end)
    assert strength.max() <= lam  # after every update + pruning step
    assert strength.min() >= 2.0 and (alphas >= 1).all() and (betas >= 1).all()
    assert (strength[1:] < strength[:-1]).any()  # pruning happened
    assert alphas[0] == 1.0 and betas[0] == 1.0  # sample 0 uses the initial Beta(1, 1)


# ------------------------------------------------------------------------------------------------------
# the stream
# ------------------------------------------------------------------------------------------------------
D, C = 16, 5


def _logits_with_entropy_ratio(h_ratio_target: float) -> tuple[np.ndarray, float]:
    """One row of logits and its entropy (used to set H_bar relative to it)."""
    logits = np.array([[2.0, 0.5, 0.0, -0.5, -1.0]])
    return logits, float(entropy(logits)[0]) / h_ratio_target


def _directional_stream(kind: str) -> BTFLStream:
    local = np.tile([0.6, 0.4], (D, 1))  # local DLE: level 0 more likely
    glob = np.tile([0.4, 0.6], (D, 1))  # global DLE: level 1 more likely
    logits, _ = _logits_with_entropy_ratio(1.0)
    h = float(entropy(logits)[0])
    if kind == "EXD":  # H_l > H_l_bar, H_g < H_g_bar; (H - H_bar)/H_bar = +-0.2
        return BTFLStream(local, glob, h_local_bar=h / 1.2, h_global_bar=h / 0.8)
    return BTFLStream(local, glob, h_local_bar=h / 0.8, h_global_bar=h / 1.2)


@pytest.mark.parametrize("kind", ["EXD", "IND"])
def test_stream_of_one_kind_drives_the_weight(kind: str) -> None:
    stream = _directional_stream(kind)
    logits, _ = _logits_with_entropy_ratio(1.0)
    n = 15  # 14 events reach alpha + beta = 16 = lambda; the 15th sample's event is then pruned
    feats = np.full((n, D), 3.0 if kind == "EXD" else 0.0)  # codes all 1 (fits global) / all 0 (fits local)
    stream.predict(np.repeat(logits, n, 0), np.repeat(logits, n, 0), feats)
    e = stream.last_weights
    assert (stream.last_events == (EVENT_EXD if kind == "EXD" else EVENT_IND)).all()
    if kind == "EXD":
        assert (np.diff(e) > 0).all() and e[0] < 0.7 and e[-1] > 0.95
        np.testing.assert_array_equal(stream.last_alphas, np.arange(1.0, n + 1))
    else:
        assert (np.diff(e) < 0).all() and e[0] > 0.3 and e[-1] < 0.05
        np.testing.assert_array_equal(stream.last_betas, np.arange(1.0, n + 1))
    # the event of sample 15 pushes the strength to 17 > 16 -> pruned back to 3
    assert stream.alpha + stream.beta == pytest.approx(3.0)
    assert (stream.alpha > stream.beta) == (kind == "EXD")


def _random_setup(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, float]:
    rng = np.random.default_rng(seed)
    own = rng.exponential(0.5, (400, D)) * (rng.random((400, D)) < np.linspace(0.2, 0.8, D))
    other = rng.exponential(0.9, (400, D))
    local, glob = fit_dle(own), fit_dle(other)
    n = 64
    src = rng.random(n) < 0.5  # mixed stream: half "own" half "other"
    feats = np.where(
        src[:, None], rng.exponential(0.5, (n, D)) * (rng.random((n, D)) < 0.5), rng.exponential(0.9, (n, D))
    )
    lo = rng.normal(0, 1, (n, C)) * rng.uniform(0.3, 4, (n, 1))
    gl = rng.normal(0, 1, (n, C)) * rng.uniform(0.3, 4, (n, 1))
    h_lb, h_gb = float(np.median(entropy(lo))), float(np.median(entropy(gl)))
    return local, glob, feats, lo, gl, h_lb, h_gb


CONFIGS = [
    {},
    {"mixing": "logprob", "tau_clip_kb": 4.0},
    {"integral": "trapezoid100", "restart": "authors", "restart_c": 50.0, "lam": 5.0},
    {"smoothing": DLESmoothing.additive(1.0, n_train=400), "lam": 4.0},
    {"rectify_h_global_bar": math.log(100), "tau_clip_kb": 4.0},
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("batch", [1, 7, 32])
def test_batch_equals_one_at_a_time(batch: int, config: dict) -> None:
    """The vectorised path on a batch of B equals B one-sample calls of it bit for bit; the public predict at
    batch 1 (the scalar path of predict_one) agrees to ~1e-15 and follows the same prior sequence."""
    local, glob, feats, lo, gl, h_lb, h_gb = _random_setup()
    ref_stream = BTFLStream(local, glob, h_lb, h_gb, BTFLVariant(**config))
    ref, ref_w = [], []
    for i in range(len(lo)):  # the vectorised path, one sample at a time
        ref.append(ref_stream._predict_batch(*ref_stream._validate(lo[i : i + 1], gl[i : i + 1], feats[i : i + 1])))
        ref_w.append(ref_stream.last_weights[0])
    ref = np.concatenate(ref)
    stream = BTFLStream(local, glob, h_lb, h_gb, BTFLVariant(**config))
    outs, weights, events = [], [], []
    for s in range(0, len(lo), batch):
        outs.append(stream.predict(lo[s : s + batch], gl[s : s + batch], feats[s : s + batch]))
        weights.append(stream.last_weights)
        events.append(stream.last_events)
    ev = np.concatenate(events)
    assert (ev == EVENT_EXD).sum() >= 3 and (ev == EVENT_IND).sum() >= 3  # the recursion is exercised
    if batch == 1:
        np.testing.assert_allclose(np.concatenate(outs), ref, rtol=0, atol=1e-13)
        np.testing.assert_allclose(np.concatenate(weights), np.array(ref_w), rtol=0, atol=1e-13)
    else:
        sizes = [len(o) for o in outs]
        exact = np.repeat(np.array(sizes) > 1, sizes)  # a trailing batch of one takes the scalar path
        np.testing.assert_array_equal(np.concatenate(outs)[exact], ref[exact])  # bit for bit
        np.testing.assert_array_equal(np.concatenate(weights)[exact], np.array(ref_w)[exact])
    assert (stream.alpha, stream.beta) == (ref_stream.alpha, ref_stream.beta)


def test_stream_agrees_with_the_public_functions() -> None:
    local, glob, feats, lo, gl, h_lb, h_gb = _random_setup(1)
    stream = BTFLStream(local, glob, h_lb, h_gb)
    probs = stream.predict(lo, gl, feats)
    codes = fsq_quantize(feats)
    lql, lqg = dle_log_likelihood(codes, local), dle_log_likelihood(codes, glob)
    hl, hg = entropy(lo), entropy(gl)
    np.testing.assert_array_equal(stream.last_events, detect_events(lql - lqg, hl, hg, h_lb, h_gb))
    np.testing.assert_allclose(
        stream.last_log_tau_hat, log_tau_hat(lql, lqg, hl, hg, h_lb, h_gb), rtol=1e-13, atol=1e-15
    )
    alphas, betas, a_end, b_end = hbu_sequence(1.0, 1.0, stream.last_events)
    np.testing.assert_array_equal(stream.last_alphas, alphas)
    assert (stream.alpha, stream.beta) == (a_end, b_end)
    e = expected_global_weight(alphas, betas, np.exp(stream.last_log_tau_hat))
    np.testing.assert_allclose(stream.last_weights, e, rtol=0, atol=1e-14)
    np.testing.assert_allclose(probs, e[:, None] * softmax(gl) + (1 - e[:, None]) * softmax(lo), atol=1e-14)
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-12)
    stream.reset()
    assert (stream.alpha, stream.beta) == (1.0, 1.0)


def test_rectification_constant_changes_eq15_only() -> None:
    """The authors' ln(100) in r_g (rectify_h_global_bar) changes tau_hat (Eq. 15) but not the inspection
    pi (Eq. 10): same events as the paper's stream, log tau_hat as the public function with H_g_bar = ln 100."""
    local, glob, feats, lo, gl, h_lb, h_gb = _random_setup(3)
    paper = BTFLStream(local, glob, h_lb, h_gb)
    paper.predict(lo, gl, feats)
    authors = BTFLStream(local, glob, h_lb, h_gb, BTFLVariant(rectify_h_global_bar=math.log(100)))
    authors.predict(lo, gl, feats)
    np.testing.assert_array_equal(authors.last_events, paper.last_events)
    codes = fsq_quantize(feats)
    lql, lqg = dle_log_likelihood(codes, local), dle_log_likelihood(codes, glob)
    expect = log_tau_hat(lql, lqg, entropy(lo), entropy(gl), h_lb, math.log(100))
    np.testing.assert_allclose(authors.last_log_tau_hat, expect, rtol=1e-13, atol=1e-15)
    assert np.abs(authors.last_log_tau_hat - paper.last_log_tau_hat).max() > 1e-3
    with pytest.raises(ValueError, match="rectify_h_global_bar"):
        BTFLVariant(rectify_h_global_bar=0.0)


@pytest.mark.parametrize("config", [*CONFIGS, {"smoothing": DLESmoothing.none()}, {"levels": 3}])
def test_predict_one_fast_path_follows_predict(config: dict) -> None:
    """The batch-1 fast path gives the stream's predictions (to rounding), events and final Beta state."""
    local, glob, feats, lo, gl, h_lb, h_gb = _random_setup(2)
    config = dict(config)
    if config.pop("levels", 2) == 3:  # 3 fsq levels: the fast path falls back to predict
        own, other = feats[: len(feats) // 2], feats[len(feats) // 2 :]
        local, glob = fit_dle(own, levels=3), fit_dle(other, levels=3)
    batch = BTFLStream(local, glob, h_lb, h_gb, BTFLVariant(**config))
    ref = batch.predict(lo, gl, feats)
    fast = BTFLStream(local, glob, h_lb, h_gb, BTFLVariant(**config))
    out, w, ev = [], [], []
    for i in range(len(lo)):
        out.append(fast.predict_one(lo[i], gl[i], feats[i]))
        w.append(fast.last_weight)
        ev.append(fast.last_event)
    np.testing.assert_allclose(np.stack(out), ref, rtol=0, atol=1e-14)
    np.testing.assert_allclose(w, batch.last_weights, rtol=0, atol=1e-14)
    np.testing.assert_array_equal(ev, batch.last_events)
    assert (fast.alpha, fast.beta) == (batch.alpha, batch.beta)
    assert len(set(ev)) == 3  # IND, EXD and no-event samples all exercised


def test_predict_one_rejects_bad_input() -> None:
    local = np.full((D, 2), 0.5)
    stream = BTFLStream(local, local, 1.0, 1.0)
    with pytest.raises(ValueError, match="predict_one needs"):
        stream.predict_one(np.zeros((1, C)), np.zeros((1, C)), np.zeros((1, D)))
    with pytest.raises(ValueError, match="predict_one needs"):
        stream.predict_one(np.zeros(C), np.zeros(C), np.zeros(D + 1))
    for bad in (-np.ones(D), np.full(D, np.nan), np.full(D, np.inf)):
        with pytest.raises(ValueError, match="finite and non-negative"):
            stream.predict_one(np.zeros(C), np.zeros(C), bad)
    for bad in (np.nan, np.inf, -np.inf):
        logits = np.zeros(C)
        logits[1] = bad
        with pytest.raises(ValueError, match="logits must be finite"):
            stream.predict_one(logits, np.zeros(C), np.zeros(D))
        with pytest.raises(ValueError, match="logits must be finite"):
            stream.predict_one(np.zeros(C), logits, np.zeros(D))
    assert (stream.alpha, stream.beta) == (1.0, 1.0)  # nothing was consumed


def test_stream_rejects_bad_input() -> None:
    local = np.full((D, 2), 0.5)
    stream = BTFLStream(local, local, 1.0, 1.0)
    lo, gl, ft = np.zeros((2, C)), np.zeros((2, C)), np.zeros((2, D))
    with pytest.raises(ValueError, match="local_logits must be 2-D"):
        stream.predict(np.zeros(C), gl, ft)
    with pytest.raises(ValueError, match=r"global_logits must have 5 columns, got shape \(2, 4\)"):
        stream.predict(lo, np.zeros((2, 4)), ft)
    with pytest.raises(ValueError, match="global_logits must have 2 rows"):
        stream.predict(lo, np.zeros((3, C)), ft)
    with pytest.raises(ValueError, match="features must have 16 columns"):
        stream.predict(lo, gl, np.zeros((2, D + 1)))
    with pytest.raises(ValueError, match="local_logits must be finite"):
        stream.predict(np.full((2, C), np.nan), gl, ft)
    with pytest.raises(ValueError, match="features must be non-negative"):
        stream.predict(lo, gl, -np.ones((2, D)))
    with pytest.raises(ValueError, match="features must be finite"):
        stream.predict(lo, gl, np.full((2, D), np.inf))
    with pytest.raises(ValueError, match="mixing must be 'prob' or 'logprob'"):
        BTFLVariant(mixing="logits")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="integral must be 'exact' or 'trapezoid100'"):
        BTFLVariant(integral="simpson")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="restart must be 'paper' or 'authors'"):
        BTFLVariant(restart="none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="h_global_bar must be a finite number > 0"):
        BTFLStream(local, local, 1.0, 0.0)
    with pytest.raises(ValueError, match="must have the same shape"):
        BTFLStream(local, np.full((D + 1, 2), 0.5), 1.0, 1.0)


def test_import_edge_sdk_does_not_import_torch() -> None:
    code = (
        "import sys, edge_sdk._btfl; s = edge_sdk._btfl.BTFLStream; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert btfl.__name__ == "edge_sdk._btfl"


# ------------------------------------------------------------------------------------------------ batch-1 paths
def test_scalar_weight_path_matches_the_vectorised_path() -> None:
    """expected_global_weight with single numbers takes a scalar path: same values (to 1e-14) and shapes."""
    rng = np.random.default_rng(3)
    a = rng.uniform(0.1, 30.0, 200)
    b = rng.uniform(0.1, 30.0, 200)
    t = np.exp(rng.uniform(-12, 12, 200))
    vec = expected_global_weight(a, b, t)
    one = np.array([float(expected_global_weight(float(ai), float(bi), float(ti))) for ai, bi, ti in zip(a, b, t)])
    np.testing.assert_allclose(one, vec, rtol=0, atol=1e-14)
    assert expected_global_weight(2.0, 3, 1.0).shape == ()
    assert expected_global_weight(np.array([2.0]), 3.0, np.float32(1.0)).shape == (1,)
    assert expected_global_weight(np.array([[2.0]]), np.array([3.0]), 1.0).shape == (1, 1)
    assert float(expected_global_weight(2.0, 3.0, 1.0)) == pytest.approx(0.4, abs=1e-14)  # alpha / (alpha + beta)
    assert float(expected_global_weight(2.0, 3.0, 0.0)) == 1.0
    assert float(expected_global_weight(2.0, 3.0, np.inf)) == 0.0


@pytest.mark.parametrize("alpha, beta, tau, message", [
    (0.0, 1.0, 1.0, "alpha must be finite and > 0"),
    (float("nan"), 1.0, 1.0, "alpha must be finite and > 0"),
    (np.inf, 1.0, 1.0, "alpha must be finite and > 0"),
    (1.0, -2.0, 1.0, "beta must be finite and > 0"),
    (1.0, 1.0, -1.0, "tau_hat must be >= 0 and not NaN"),
    (1.0, 1.0, float("nan"), "tau_hat must be >= 0 and not NaN"),
])
def test_scalar_weight_path_rejects_what_the_vectorised_path_rejects(alpha, beta, tau, message) -> None:  # type: ignore[no-untyped-def]
    for args in ((alpha, beta, tau), ([alpha], [beta], [tau])):
        with pytest.raises(ValueError, match=message):
            expected_global_weight(*args)


def test_predict_at_batch_one_reports_the_batch_fields() -> None:
    local, glob, feats, lo, gl, h_lb, h_gb = _random_setup()
    stream = BTFLStream(local, glob, h_lb, h_gb)
    one = BTFLStream(local, glob, h_lb, h_gb)
    for i in range(5):
        probs = stream.predict(lo[i : i + 1], gl[i : i + 1], feats[i : i + 1])
        a, b = one.alpha, one.beta
        ref = one.predict_one(lo[i], gl[i], feats[i])
        np.testing.assert_array_equal(probs[0], ref)  # the same scalar path
        assert probs.shape == (1, len(lo[i]))
        assert stream.last_weights.tolist() == [one.last_weight] and stream.last_events.tolist() == [one.last_event]
        assert stream.last_alphas.tolist() == [a] and stream.last_betas.tolist() == [b]
        assert stream.last_log_tau_hat.shape == (1,)


def test_stream_grid_cache_is_bounded_and_validated() -> None:
    local, glob, feats, lo, gl, h_lb, h_gb = _random_setup()
    stream = BTFLStream(local, glob, h_lb, h_gb, cache_size=3)
    ref = BTFLStream(local, glob, h_lb, h_gb)
    for i in range(len(lo)):
        np.testing.assert_array_equal(stream.predict_one(lo[i], gl[i], feats[i]), ref.predict_one(lo[i], gl[i], feats[i]))
    assert len(stream._grids) == 3 < len(ref._grids)
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(ValueError, match="cache_size must be an int >= 1"):
            BTFLStream(local, glob, h_lb, h_gb, cache_size=bad)


def test_trapezoid_needs_no_scipy_and_matches_betaln() -> None:
    """The authors' trapezoid variant uses math.lgamma for log B(a, b), not scipy (dropped from the SDK)."""
    import edge_sdk._btfl.weight as module

    a = np.array([0.3, 1.0, 2.5, 17.0, 400.0])
    b = np.array([5.0, 1.0, 0.7, 17.0, 3.0])
    betaln = [0.6342157560993356, 0.0, -0.3398547101503229, -23.71074680542017, -17.2887308824736]  # scipy 1.17.1
    np.testing.assert_allclose(module._betaln(a, b), betaln, rtol=1e-13, atol=1e-13)
    code = ("import sys; sys.modules['scipy'] = None\n"  # any import of scipy now fails
            "from edge_sdk._btfl import trapezoid_global_weight, BTFLStream\n"
            "print(float(trapezoid_global_weight(2.0, 3.0, 1.0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert float(out) == pytest.approx(float(module.trapezoid_global_weight(2.0, 3.0, 1.0)), abs=1e-15)


def test_import_edge_sdk_is_lazy() -> None:
    """``import edge_sdk`` loads neither httpx nor onnxruntime (a device imports them on first use)."""
    code = ("import sys, edge_sdk, edge_sdk._btfl\n"
            "print(sorted(m for m in ('httpx', 'onnxruntime', 'scipy', 'torch') if m in sys.modules))\n"
            "edge_sdk.EdgeClient; from edge_sdk import softmax, EntropyEarlyStopping\n"
            "print('httpx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "True"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import edge_sdk

        edge_sdk.nope  # noqa: B018


def test_two_level_code_threshold_equals_rounded_tanh() -> None:
    """predict_one's Eq. 5 for two levels is one comparison with btfl.dle.TANH_HALF: the same codes as
    round(tanh z) on every float64 within 2^16 ulps of the threshold and on a spread of features."""
    t = btfl.dle.TANH_HALF
    bits = np.array(t).view(np.int64) + np.arange(-(1 << 16), 1 << 16)
    near = bits.view(np.float64)
    spread = np.abs(np.random.default_rng(0).standard_cauchy(100_000))
    for z in (near, spread, np.array([0.0, np.nextafter(t, 0), t, 0.5493061443340549, 1e300])):
        np.testing.assert_array_equal(z >= t, fsq_quantize(z[None], 2)[0] == 1)
    assert np.tanh(t) > 0.5 >= np.tanh(np.nextafter(t, 0))
