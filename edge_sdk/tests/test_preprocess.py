"""edge_sdk.preprocess: the device's half of a recipe's preprocessing (numpy only)."""
from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.preprocess import Preprocess


def test_raw_uint8_nhwc_becomes_normalised_nchw() -> None:
    raw = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    pre = Preprocess(layout="NHWC", scale=1 / 255, mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.1))
    out = pre.apply(raw)
    assert out.dtype == np.float32 and out.shape == (2, 3, 4, 4)
    expected = (raw.transpose(0, 3, 1, 2) / 255 - np.array([0.5, 0.4, 0.3]).reshape(1, 3, 1, 1)) / \
        np.array([0.2, 0.2, 0.1]).reshape(1, 3, 1, 1)
    assert np.abs(out - expected).max() < 1e-5
    assert Preprocess(size=(2, 2)).apply(np.ones((1, 1, 4, 4), np.float32)).shape == (1, 1, 2, 2)
    assert Preprocess.identity().apply(raw.transpose(0, 3, 1, 2).astype(np.float32)).max() == raw.max()


@pytest.mark.parametrize("bad, message", [
    ({"layout": "HWC"}, "preprocess layout must be 'NHWC' or 'NCHW', got 'HWC'"),
    ({"size": (0, 4)}, r"preprocess size must be \(height, width\) of positive integers, got \(0, 4\)"),
    ({"std": (0.0,)}, r"preprocess std must be positive, got \(0.0,\)"),
    ({"scale": float("nan")}, "preprocess scale must be a finite non-zero number, got nan"),
])
def test_bad_settings_are_one_line(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        Preprocess(**bad)


def test_from_dict_is_strict_and_round_trips() -> None:
    pre = Preprocess(layout="NHWC", size=(28, 28), scale=1 / 255, mean=(0.1307,), std=(0.3081,))
    assert Preprocess.from_dict(pre.to_dict()) == pre
    with pytest.raises(ValueError, match=r"preprocess mean must be a list of numbers, got '0.5'"):
        Preprocess.from_dict({**pre.to_dict(), "mean": "0.5"})
    with pytest.raises(ValueError, match="preprocess must be an object, got list"):
        Preprocess.from_dict([])
    three = Preprocess(mean=(0.1, 0.2), std=(1.0, 1.0))
    with pytest.raises(ValueError, match=r"^preprocess mean has 2 values for images with 3 channels$"):
        three.apply(np.zeros((1, 3, 2, 2), np.float32))
