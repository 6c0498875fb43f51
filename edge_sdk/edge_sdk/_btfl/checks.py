"""Input checks shared by BTFL's device math: one ValueError line naming the argument."""
from __future__ import annotations

import math

import numpy as np


def float_array(name: str, x: object) -> np.ndarray:
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be numeric, got {type(x).__name__}") from exc
    return arr


def require_finite(name: str, x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite (no NaN/inf)")


def require_2d(name: str, x: np.ndarray, cols: int | None = None, rows: int | None = None) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {x.shape}")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got shape {x.shape}")
    if cols is not None and x.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns, got shape {x.shape}")


def positive_scalar(name: str, x: float) -> float:
    v = float(x)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
    return v



def require_nonnegative_finite(name: str, x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite (no NaN/inf)")
    if (x < 0).any():
        raise ValueError(f"{name} must be non-negative (post-ReLU); fsq maps R+ to {{0, ..., levels-1}}")

