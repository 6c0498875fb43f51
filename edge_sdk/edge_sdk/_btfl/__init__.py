"""BTFL test-time head interpolation on the device (numpy only: no torch, no scipy), private to the SDK (the
device runs it through ``open_bundle`` on a BTFL bundle; the coordinator and the benchmarks import it for
parity). By concept: :mod:`.dle` (quantisation, DLEs), :mod:`.weight` (the DPI integral), :mod:`.update` (CBU's
tau_hat, HBU), :mod:`.stream` (:class:`BTFLStream` and the paper-versus-authors :class:`BTFLVariant`),
:mod:`.head` (the device's local head and its participant).

Reference: "BTFL: A Bayesian-based Test-Time Generalization Method for Internal and External Data Distributions in
Federated Learning" (Zhou and Liu, KDD '25, arXiv:2503.06633). Equation numbers below are the paper's.

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
(density on the grid) is memoised by a :class:`WeightIntegral` that each :class:`BTFLStream` owns (batches of
<= 4 samples and the scalar path's grids, sized to the stream with ``cache_size``); nothing is cached at module
level.
"""
from __future__ import annotations

from edge_sdk._btfl.dle import DLESmoothing, average_dles, dle_log_likelihood, fit_dle, fsq_quantize
from edge_sdk._btfl.head import BTFLFit, BTFLParticipant, fit_local_head
from edge_sdk._btfl.stream import BTFLStream, BTFLVariant
from edge_sdk._btfl.update import (DEFAULT_LAMBDA, EVENT_EXD, EVENT_IND, EVENT_NONE, detect_events, hbu_sequence,
                                   hbu_update, log_tau_hat, soft_clip_log_tau, tau_hat)
from edge_sdk._btfl.weight import WeightIntegral, expected_global_weight, trapezoid_global_weight

__all__ = [
    "DEFAULT_LAMBDA",
    "EVENT_EXD",
    "EVENT_IND",
    "EVENT_NONE",
    "BTFLFit",
    "BTFLParticipant",
    "BTFLStream",
    "BTFLVariant",
    "DLESmoothing",
    "WeightIntegral",
    "average_dles",
    "detect_events",
    "dle_log_likelihood",
    "expected_global_weight",
    "fit_dle",
    "fit_local_head",
    "fsq_quantize",
    "hbu_sequence",
    "hbu_update",
    "log_tau_hat",
    "soft_clip_log_tau",
    "tau_hat",
    "trapezoid_global_weight",
]
