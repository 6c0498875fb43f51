"""FedTHE test-time head ensemble, numpy only: "Test-Time Robust Personalization for Federated Learning" (Jiang and
Lin, ICLR 2023, arXiv:2205.10920).

The BTFL paper's main baseline. Two heads on one frozen feature z: global logits
g and local (personal) logits l. For every test batch, per-sample ensemble weights w_i = softmax(a_i) with a_i
initialised to (1, 1) minimise

    L = mean_i [ s_i H(softmax(o_i)) + (1 - s_i) (w_g,i d_g,i + w_l,i d_l,i) ],   o_i = w_g,i g_i + w_l,i l_i

with s_i = cos(softmax(g_i), softmax(l_i)), d_* = ||z~_i - mu_*|| (mu_local = the client's mean training feature,
mu_global = the server's mean of those) and z~_i = 0.1 z_i + 0.9 h_i, where the test history is the feature EMA
h_i = 0.1 z_i + 0.9 h_{i-1} over the stream (h_1 = z_1). Adam (lr 0.1) on a for 20 steps; a batch stops early
when the norm of its gradient falls below 1e-5. Prediction: argmax o.

Vectorisation: the loss is a mean of per-sample terms and Adam is per coordinate, so every batch of a stream is
optimised at once: the gradient is analytic (no autograd), the batch coupling (1/B scale, the per-batch stop test)
is kept exactly. The EMA is a first-order linear recurrence, computed in closed form over blocks (:func:`ema`).
``variant="code"`` reproduces two facts of the authors' code (LINs-lab/FedTHE, ``THE_worker.py``) that the paper's
formulation drops: (1) the history loop never feeds the first sample of a batch into the EMA, so at batch size 1
the history stays at the stream's first feature forever; (2) z~ = 0.3 z + 0.7 h is re-assigned inside the
optimisation loop, so at step t it is 0.3^t z + (1 - 0.3^t) h. (1) is what makes FedTHE batch-size dependent.
"""
from __future__ import annotations

import math

import numpy as np

from edge_sdk._numerics import log_softmax

__all__ = ["code_history", "ema", "feature_history", "fedthe_predict"]

_EMA_LOG_RANGE = 600.0  # a block spans decay^k for |log decay^k| <= 600: e^+-600 is far from float64's e^+-709
_EMA_MAX_BLOCK = 1024  # rows per block (bounds the block arrays when decay is near 1)


def ema(x: np.ndarray, decay: float, initial: np.ndarray) -> np.ndarray:
    """First-order linear recurrence over axis 0: x [N, D] -> h [N, D], h_t = decay h_{t-1} + (1 - decay) x_t from
    h_0 = ``initial`` [D] (what ``scipy.signal.lfilter([1 - decay], [1, -decay], x, axis=0, zi=decay * initial)``
    gives, in numpy alone).

    Closed form per block of L rows starting after state s: h_k = decay^(k+1) s + (1 - decay) decay^(k-c)
    sum_{j<=k} decay^(c-j) x_j (c = L // 2), one cumulative sum for all blocks at once; L keeps every power
    within e^+-600 (no overflow or underflow even for decay near 0). Only the block-end states are carried by a
    loop, over [D] vectors (N / L iterations). Rounding is that of the plain recurrence (each partial sum is
    rescaled by the same power that the recurrence applies term by term)."""
    x = np.asarray(x, dtype=np.float64)
    s = np.asarray(initial, dtype=np.float64).reshape(-1)
    decay = float(decay)
    if x.ndim != 2 or s.shape != (x.shape[1],):
        raise ValueError(f"need x [N, D] and initial [D], got shapes {x.shape} and {s.shape}")
    if not math.isfinite(decay):
        raise ValueError(f"decay must be finite, got {decay}")
    n, d = x.shape
    if decay == 0.0 or n == 0:  # no memory: h = x
        return x.copy()
    log_a = abs(math.log(abs(decay)))
    length = max(1, min(n, _EMA_MAX_BLOCK, int(_EMA_LOG_RANGE / log_a) if log_a > 0 else n))
    blocks, mid = -(-n // length), length // 2
    k = np.arange(length)
    padded = np.zeros((blocks * length, d))
    padded[:n] = x
    # zero-state response of every block: (1 - decay) sum_{j<=k} decay^(k-j) x_j, all blocks at once
    zero = np.cumsum(padded.reshape(blocks, length, d) * (decay ** (mid - k))[:, None], axis=1)
    zero *= ((1.0 - decay) * decay ** (k - mid))[:, None]
    carry = decay ** (k + 1)  # how the state before a block reaches its row k
    starts = np.empty((blocks, d))  # the state before each block: the only sequential part
    for m in range(blocks):
        starts[m] = s
        s = carry[-1] * s + zero[m, -1]
    return (zero + carry[:, None] * starts[:, None, :]).reshape(-1, d)[:n]


def feature_history(z: np.ndarray, decay: float = 0.9, initial: np.ndarray | None = None) -> np.ndarray:
    """EMA test history over a stream: z [N, D] -> h [N, D], h_i = (1-decay) z_i + decay h_{i-1} with
    h_0 = ``initial`` (the history of the stream's earlier samples), or h_1 = z_1 for a new stream."""
    z = np.asarray(z, dtype=np.float64)
    if z.ndim != 2 or len(z) == 0:
        raise ValueError(f"features must be a non-empty [N, D] array, got shape {z.shape}")
    return ema(z, decay, z[0] if initial is None else initial)


def code_history(z: np.ndarray, batch_size: int, decay: float = 0.9) -> np.ndarray:
    """The authors' history: the EMA skips the first sample of every batch (h_1 = z_1; at a batch start
    h_i = h_{i-1}). Computed as :func:`feature_history` over the other samples, forward-filled."""
    z = np.asarray(z, dtype=np.float64)
    pos = np.arange(len(z))
    keep = np.flatnonzero(pos % batch_size != 0)
    if len(keep) == 0:  # batch size 1: the history never moves
        return np.broadcast_to(z[0], z.shape).copy()
    h_keep = ema(z[keep], decay, z[0])
    last = np.maximum.accumulate(np.where(pos % batch_size != 0, pos, 0))  # last kept position <= i (0: none)
    return np.where((last > 0)[:, None], h_keep[np.searchsorted(keep, last)], z[0])


def _entropy_grad(o: np.ndarray) -> np.ndarray:
    """d H(softmax(o)) / d o = -p (log p + H), o [N, C] -> [N, C]."""
    log_p = log_softmax(o)
    p = np.exp(log_p)
    h = -(p * log_p).sum(-1, keepdims=True)
    return -p * (log_p + h)


def fedthe_predict(global_logits: np.ndarray, local_logits: np.ndarray, features: np.ndarray,
                   mu_local: np.ndarray, mu_global: np.ndarray, batch_size: int, steps: int = 20,
                   lr: float = 0.1, tol: float = 1e-5, history_decay: float = 0.9,
                   feature_mix: float = 0.1, variant: str = "spec",
                   initial_history: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One client's test stream, in order, cut into batches of ``batch_size``.

    global_logits, local_logits [N, C]; features [N, D]; mu_* [D] -> (ensembled logits o [N, C],
    weights [N, 2] = (w_global, w_local)). ``variant``: "spec" (the paper's formulation) or "code" (the authors'
    history and z~, module docstring; ``feature_mix`` is then 0.3). ``initial_history`` [D] ("spec"): the
    feature history after the stream's earlier samples, when a stream arrives over several calls.
    """
    if variant not in ("spec", "code"):
        raise ValueError(f"variant must be 'spec' or 'code', got {variant!r}")
    if variant == "code" and initial_history is not None:
        raise ValueError("initial_history applies to variant='spec' only")
    g = np.asarray(global_logits, dtype=np.float64)
    l_ = np.asarray(local_logits, dtype=np.float64)
    z = np.asarray(features, dtype=np.float64)
    n = len(g)
    if g.shape != l_.shape or g.ndim != 2 or z.shape[0] != n:
        raise ValueError(f"logits must both be [N, C] and features [N, D]; got {g.shape}, {l_.shape}, {z.shape}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if variant == "spec":
        hist = feature_history(z, history_decay, initial_history)
        z_t = feature_mix * z + (1.0 - feature_mix) * hist
        d = np.stack([np.linalg.norm(z_t - mu_global, axis=1), np.linalg.norm(z_t - mu_local, axis=1)], 1)  # [N, 2]
    else:
        hist = code_history(z, batch_size, history_decay)
    p_g, p_l = np.exp(log_softmax(g)), np.exp(log_softmax(l_))
    s = (p_g * p_l).sum(1) / np.maximum(np.linalg.norm(p_g, axis=1) * np.linalg.norm(p_l, axis=1), 1e-6)  # cos
    batch = np.arange(n) // batch_size
    inv_b = 1.0 / np.bincount(batch)[batch]  # the batch mean's 1/B, per sample
    a = np.ones((n, 2))
    m = np.zeros((n, 2))
    v = np.zeros((n, 2))
    active = np.ones(batch[-1] + 1, dtype=bool)
    b1, b2, eps = 0.9, 0.999, 1e-8
    for t in range(1, steps + 1):  # Adam over all batches at once (steps is small and inherently serial)
        if variant == "code":  # z~ re-mixed with the history at every step (authors' code)
            z_t = 0.3 ** t * z + (1.0 - 0.3 ** t) * hist
            d = np.stack([np.linalg.norm(z_t - mu_global, axis=1), np.linalg.norm(z_t - mu_local, axis=1)], 1)
        w = np.exp(a - a.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
        o = w[:, :1] * g + w[:, 1:] * l_
        dh = _entropy_grad(o)
        dl_dw = s[:, None] * np.stack([(dh * g).sum(1), (dh * l_).sum(1)], 1) + (1.0 - s)[:, None] * d
        gw = w[:, 0] * w[:, 1] * (dl_dw[:, 0] - dl_dw[:, 1]) * inv_b  # softmax Jacobian: dL/da_g = -dL/da_l
        grad = np.stack([gw, -gw], 1)
        active &= np.sqrt(np.bincount(batch, weights=2.0 * gw * gw)) >= tol  # authors: break before the step
        if not active.any():
            break
        live = active[batch][:, None]
        m = np.where(live, b1 * m + (1 - b1) * grad, m)
        v = np.where(live, b2 * v + (1 - b2) * grad * grad, v)
        # each live batch has taken exactly t steps (a stopped batch never restarts)
        step = lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        a = np.where(live, a - step, a)
    w = np.exp(a - a.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    return w[:, :1] * g + w[:, 1:] * l_, w
