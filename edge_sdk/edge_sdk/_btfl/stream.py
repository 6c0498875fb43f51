"""BTFL's streaming predictor (:class:`BTFLStream`) and the switches between the paper and the authors' code,
collected in one :class:`BTFLVariant`."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from edge_sdk._btfl.checks import float_array, positive_scalar, require_2d, require_finite, require_nonnegative_finite
from edge_sdk._btfl.dle import TANH_HALF, DLESmoothing, check_freqs, fsq_codes
from edge_sdk._btfl.update import (DEFAULT_LAMBDA, EVENT_EXD, EVENT_IND, EVENT_NONE, Restart, events_from_log_tau, hbu_run,
                                   log_tau_hat_stacked, hbu_update, soft_clip_log_tau)
from edge_sdk._btfl.weight import DEFAULT_CACHE_SIZE, WeightIntegral, trapezoid_from_log_tau
from edge_sdk._numerics import log_softmax

Mixing = Literal["prob", "logprob"]
Integral = Literal["exact", "trapezoid100"]


def _softmax_entropy(x: list[float], exp=math.exp, log=math.log, mul=operator.mul  # type: ignore[no-untyped-def]
                     ) -> tuple[list[float], float, float, float]:
    """Python floats: logits -> (exp(x - max), their sum S, entropy H = log Z - sum p x, log Z); p = exp / S.
    (The defaults bind the functions as locals: this runs twice per streamed sample.)"""
    m = max(x)
    ex = [exp(v - m) for v in x]
    s = sum(ex)
    lz = m + log(s)
    return ex, s, lz - sum(map(mul, ex, x)) / s, lz



@dataclass(frozen=True)
class BTFLVariant:
    """Every switch between BTFL as the paper writes it (the defaults, :meth:`paper`) and the authors' code
    (:meth:`authors`), plus the prior's hyperparameters, in one object:

    * ``lam``: the prior-strength threshold of Algorithm 1; ``alpha0``, ``beta0``: the prior Beta(alpha0, beta0).
    * ``mixing``: "prob" -> Y = e softmax(g) + (1-e) softmax(l) (Eq. 21); "logprob" (authors' code) ->
      Y = softmax(e log_softmax(g) + (1-e) log_softmax(l)) (a renormalised geometric mixture).
    * ``tau_clip_kb``: None, or kb for the authors' soft clip of tau_hat to [1/(kb+1), kb+1] (kb = 4).
    * ``integral``: "exact" (:func:`expected_global_weight`) or "trapezoid100" (authors' 100-point trapezoid on
      [0.01, 0.99], :func:`trapezoid_global_weight`).
    * ``restart``: "paper" (Algorithm 1: alpha <- 1 + alpha/(alpha+beta)) or "authors"
      (alpha <- alpha/(alpha+beta) * restart_c/10 + 1; restart_c = 10 equals the paper, they use 5..3000).
    * ``smoothing``: :class:`DLESmoothing` for both DLEs (None: the authors' 0.6 p + 0.4/levels).
    * ``rectify_h_global_bar``: None (the paper: H_g_bar), or the constant that replaces H_g_bar in the global
      head's rectification r_g of Eq. 15 only; the authors' code hard-codes ln(100) there. The inspection pi
      (Eq. 10) keeps H_g_bar.
    """

    lam: float = DEFAULT_LAMBDA
    smoothing: DLESmoothing | None = None
    mixing: Mixing = "prob"
    tau_clip_kb: float | None = None
    integral: Integral = "exact"
    restart: Restart = "paper"
    restart_c: float = 10.0
    rectify_h_global_bar: float | None = None
    alpha0: float = 1.0
    beta0: float = 1.0

    def __post_init__(self) -> None:
        if self.mixing not in ("prob", "logprob"):
            raise ValueError(f"mixing must be 'prob' or 'logprob', got {self.mixing!r}")
        if self.integral not in ("exact", "trapezoid100"):
            raise ValueError(f"integral must be 'exact' or 'trapezoid100', got {self.integral!r}")
        if self.restart not in ("paper", "authors"):
            raise ValueError(f"restart must be 'paper' or 'authors', got {self.restart!r}")
        for name in ("lam", "restart_c", "alpha0", "beta0"):
            object.__setattr__(self, name, positive_scalar(name, getattr(self, name)))
        for name in ("tau_clip_kb", "rectify_h_global_bar"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, positive_scalar(name, getattr(self, name)))

    @classmethod
    def paper(cls) -> BTFLVariant:
        """Eqs. 9-21 and Algorithm 1 as written (lambda = 16, exact e, probability mixing)."""
        return cls()

    @classmethod
    def authors(cls, restart_c: float = 10.0) -> BTFLVariant:
        """The authors' code: log-probability mixing, tau_hat soft-clipped (kb = 4), the 100-point trapezoid, their
        restart with strength ``restart_c`` and ln(100) in r_g."""
        return cls(mixing="logprob", tau_clip_kb=4.0, integral="trapezoid100", restart="authors",
                   restart_c=restart_c, rectify_h_global_bar=math.log(100))


class BTFLStream:
    """BTFL test-time interpolation of a local and a global head over a stream of samples.

    State: the Beta(alpha, beta) prior on m = P(EXD) (starts at Beta(alpha0, beta0) = Beta(1, 1)), the local
    and global DLEs ([D, L] frequencies), and the mean training entropies H_l_bar, H_g_bar (nats).

    Semantics: sample t is weighted with the prior built from samples < t, then updates it, so a batch of B
    samples gives exactly the same outputs as B calls with one sample each (tested bit-for-bit).

    ``variant``: the paper-versus-authors switches and the prior's hyperparameters (:class:`BTFLVariant`; default
    the paper). ``cache_size``: Beta states whose integration grid the batch-1 path keeps (least recently used
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
        variant: BTFLVariant | None = None,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        loc = check_freqs(local_dle)
        glo = check_freqs(global_dle)
        if loc.shape != glo.shape:
            raise ValueError(f"local_dle {loc.shape} and global_dle {glo.shape} must have the same shape")
        self.dim, self.levels = loc.shape
        v = self.variant = BTFLVariant() if variant is None else variant
        if not isinstance(v, BTFLVariant):
            raise ValueError(f"variant must be a BTFLVariant, got {type(v).__name__}")
        self.smoothing = DLESmoothing.authors(self.levels) if v.smoothing is None else v.smoothing
        self.h_local_bar = positive_scalar("h_local_bar", h_local_bar)
        self.h_global_bar = positive_scalar("h_global_bar", h_global_bar)
        self.lam, self.restart_c, self.alpha0, self.beta0 = v.lam, v.restart_c, v.alpha0, v.beta0
        self.mixing, self.integral, self.restart, self.tau_clip_kb = v.mixing, v.integral, v.restart, v.tau_clip_kb
        # [2, D, L] smoothed log-likelihood tables (local, global); -inf only without smoothing
        self._log_tables = np.stack([self.smoothing.log_table(loc), self.smoothing.log_table(glo)])
        self._tables_may_be_inf = not bool(np.isfinite(self._log_tables).all())
        self._dim_index = np.arange(self.dim)
        self._h_bar = np.array([[self.h_local_bar], [self.h_global_bar]])  # [2, 1]
        self._neg_h_bar = -self._h_bar
        # H_bar of the rectification (Eq. 15); differs from _h_bar only with rectify_h_global_bar
        self.rectify_h_global_bar = self.h_global_bar if v.rectify_h_global_bar is None else v.rectify_h_global_bar
        self._h_bar_rect = np.array([[self.h_local_bar], [self.rectify_h_global_bar]])  # [2, 1]
        self._rect_shift = self._h_bar - self._h_bar_rect  # (H - H_bar_rect) = (H - H_bar) + shift
        # batch-1 fast path (predict_one), 2 levels and finite tables: with code c_d in {0, 1},
        # log q = (sum_d T[d, 0] + sum_d c_d (T[d, 1] - T[d, 0])) / D, one [2, D] @ [D] product per sample
        self._q_delta: np.ndarray | None = None
        if self.levels == 2 and not self._tables_may_be_inf:
            self._q_base = (self._log_tables[:, :, 0].sum(1) / self.dim).tolist()
            self._q_delta = (self._log_tables[:, :, 1] - self._log_tables[:, :, 0]) / self.dim
            self._codes = np.empty(self.dim)  # c_d as 0.0 / 1.0, rewritten by every _step_one
        self._grids = WeightIntegral(cache_size)  # e's grids and prior terms per Beta state
        self.alpha, self.beta = self.alpha0, self.beta0
        self.last_weights: np.ndarray | None = None  # e per sample of the last predict call, [B]
        self.last_alphas: np.ndarray | None = None  # prior alpha used per sample, [B]
        self.last_betas: np.ndarray | None = None
        self.last_events: np.ndarray | None = None  # EVENT_* per sample, [B]
        self.last_log_tau_hat: np.ndarray | None = None
        self.last_weight: float | None = None  # e of the last predict_one call
        self.last_event: int | None = None

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], variant: BTFLVariant | None = None) -> BTFLStream:
        """From a BTFL bundle's ``btfl`` weights (``local_dle``, ``global_dle``, ``h_bar`` = (H_l_bar, H_g_bar));
        ``variant`` as in the constructor."""
        missing = {"local_dle", "global_dle", "h_bar"} - set(arrays)
        if missing:
            raise ValueError(f"BTFL arrays lack {', '.join(sorted(missing))} (is this a BTFL bundle's 'btfl' set?)")
        h_bar = np.asarray(arrays["h_bar"], dtype=np.float64).ravel()
        if h_bar.shape != (2,):
            raise ValueError(f"h_bar must hold (H_l_bar, H_g_bar), got shape {h_bar.shape}")
        return cls(arrays["local_dle"], arrays["global_dle"], float(h_bar[0]), float(h_bar[1]), variant)

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
        lo = float_array("local_logits", local_logits)
        gl = float_array("global_logits", global_logits)
        ft = float_array("features", features)
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
        codes = np.greater_equal(ft, TANH_HALF, out=self._codes, casting="unsafe")  # Eq. 5: round(tanh z)
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
            e = self._grids.one(a, b, lt)
        else:
            e = float(trapezoid_from_log_tau(np.array([a]), np.array([b]), np.array([lt]))[0])
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
        lo = float_array("local_logits", local_logits)
        gl = float_array("global_logits", global_logits)
        ft = float_array("features", features)
        require_2d("local_logits", lo)
        require_2d("global_logits", gl, cols=lo.shape[1], rows=lo.shape[0])
        require_2d("features", ft, cols=self.dim, rows=lo.shape[0])
        if lo.shape[0] == 0:
            raise ValueError("empty batch: local_logits, global_logits and features have 0 rows")
        if lo.shape[1] < 2:
            raise ValueError(f"need at least 2 classes, got local_logits shape {lo.shape}")
        require_finite("local_logits", lo)
        require_finite("global_logits", gl)
        require_nonnegative_finite("features", ft)
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
        codes = fsq_codes(ft, self.levels)
        log_q = np.add.reduce(self._log_tables[:, self._dim_index, codes], axis=-1) / self.dim
        # HBU events from tau = Q_l / Q_g (Eq. 9, the sign of log q_l - log q_g) and pi (Eq. 10)
        events = events_from_log_tau(log_q[0] - log_q[1], dh)
        # CBU: tau_hat (Eq. 15), optionally soft-clipped (authors' code)
        lt_hat = log_tau_hat_stacked(log_q, dh + self._rect_shift, self._h_bar_rect, self._tables_may_be_inf)
        if self.tau_clip_kb is not None:
            lt_hat = soft_clip_log_tau(lt_hat, self.tau_clip_kb)
        # the prior of each sample (built from the samples before it), then e for the whole batch at once
        ab, self.alpha, self.beta = hbu_run(self.alpha, self.beta, events, self.lam, self.restart, self.restart_c)
        if self.integral == "exact":
            e = self._grids.batch(ab, np.exp(np.minimum(lt_hat, 709.0)))
        else:
            e = trapezoid_from_log_tau(ab[0], ab[1], lt_hat)
        self.last_weights, self.last_alphas, self.last_betas = e, ab[0], ab[1]
        self.last_events, self.last_log_tau_hat = events, lt_hat
        w = e[:, None]
        if self.mixing == "prob":  # Eq. 21
            return w * prob[1] + (1.0 - w) * prob[0]
        return np.exp(log_softmax(w * log_p[1] + (1.0 - w) * log_p[0]))
