"""Numerically stable softmax / entropy in numpy (the device-side twins of the server's torch losses)."""
from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    """log softmax along ``axis``; stable for large logits."""
    z = logits - np.max(logits, axis=axis, keepdims=True)
    return z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))


def softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.exp(log_softmax(logits, axis))


def entropy(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    """Prediction entropy H = -sum p log p (natural log) per sample: logits [N, C] -> [N]."""
    log_p = log_softmax(logits, axis)
    return -np.sum(np.exp(log_p) * log_p, axis=axis)
