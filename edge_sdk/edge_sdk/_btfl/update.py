"""BTFL's Bayesian updates: CBU's entropy-rectified likelihood ratio tau_hat (Sec. 4.4, Eqs. 14-15) and HBU's
events, Beta update and pruning (Sec. 4.3, Eqs. 10-11, Algorithm 1; the event convention is in
:mod:`edge_sdk._btfl`)."""
from __future__ import annotations

import math
from typing import Literal

import numpy as np

from edge_sdk._btfl.checks import float_array, positive_scalar, require_finite

DEFAULT_LAMBDA = 16.0  # prior-strength threshold of Algorithm 1 (paper: results insensitive in [5, 20])
EVENT_EXD = 1  # tau < 1 and inspection passed -> alpha += 1
EVENT_IND = -1  # tau > 1 and inspection passed -> beta += 1
EVENT_NONE = 0

Restart = Literal["paper", "authors"]


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
    hlb = positive_scalar("h_local_bar", h_local_bar)
    hgb = positive_scalar("h_global_bar", h_global_bar)
    lql, lqg, hl, hg = np.broadcast_arrays(
        float_array("log_q_local", log_q_local),
        float_array("log_q_global", log_q_global),
        float_array("h_local", h_local),
        float_array("h_global", h_global),
    )
    if np.isnan(lql).any() or np.isnan(lqg).any():
        raise ValueError("log_q_local / log_q_global must not be NaN")
    require_finite("h_local", hl)
    require_finite("h_global", hg)
    h_bar = np.array([[hlb], [hgb]]).reshape((2,) + (1,) * hl.ndim)
    return log_tau_hat_stacked(np.stack([lql, lqg]), np.stack([hl, hg]) - h_bar, h_bar, True)


def log_tau_hat_stacked(log_q: np.ndarray, dh: np.ndarray, h_bar: np.ndarray, may_be_nan: bool) -> np.ndarray:
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
    saturating at the bounds. (The authors' exact saturating function is not given in the paper; this is our
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
        float_array("log_tau", log_tau), float_array("h_local", h_local), float_array("h_global", h_global)
    )
    return events_from_log_tau(lt, np.stack([hl - float(h_local_bar), hg - float(h_global_bar)]))


def events_from_log_tau(log_tau: np.ndarray, dh: np.ndarray) -> np.ndarray:
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
    ab, a, b = hbu_run(float(alpha), float(beta), np.asarray(events), lam, restart, restart_c)
    return ab[0].copy(), ab[1].copy(), a, b


def hbu_run(
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


