"""The binary weights format (edge_sdk._tensors) and the BTFL device's local head fit: numpy only."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from edge_sdk import _tensors as tensors
from edge_sdk._btfl import fit_local_head


def test_weights_roundtrip_and_layout() -> None:
    rng = np.random.default_rng(0)
    w = {"psi.net.0.weight": rng.normal(size=(5, 3)).astype(np.float32), "psi.net.0.bias": np.arange(5.0),
         "psi.scalar": np.float32(2.5) * np.ones(())}
    body = tensors.encode(w, {"bundle_id": "ab" * 32})
    got, meta = tensors.decode(body)
    assert meta == {"bundle_id": "ab" * 32} and list(got) == list(w)
    for k, v in w.items():
        assert got[k].dtype == np.float32 and got[k].shape == np.shape(v)
        np.testing.assert_array_equal(got[k], np.asarray(v, dtype=np.float32))
    (n,) = struct.unpack_from("<Q", body)  # safetensors layout: u64 length, 8-aligned JSON, raw LE float32
    assert n % 8 == 0 and len(body) == 8 + n + 4 * (15 + 5 + 1)
    header = json.loads(body[8:8 + n])
    assert header["psi.net.0.bias"] == {"dtype": "F32", "shape": [5], "data_offsets": [60, 80]}
    np.testing.assert_array_equal(np.frombuffer(body[8 + n + 60:8 + n + 80], "<f4"), np.arange(5.0))


@pytest.mark.parametrize("cut", [0, 4, 9, -1])
def test_truncated_or_malformed_bodies_are_refused(cut: int) -> None:
    body = tensors.encode({"a": np.ones((4, 4), np.float32)})
    with pytest.raises(ValueError):
        tensors.decode(body[:cut] if cut else b"")
    n = struct.unpack_from("<Q", body)[0]
    for header in (b'{"a": {"dtype": "F64", "shape": [4, 4], "data_offsets": [0, 64]}}',
                   b'{"a": {"dtype": "F32", "shape": [4, 5], "data_offsets": [0, 64]}}', b"[1, 2]", b"not json",
                   b'{"a": {"dtype": "F32", "shape": [1180591620717411303424], "data_offsets": [0, 64]}}',
                   b'{"a": {"dtype": ["F32"], "shape": [4, 4], "data_offsets": [0, 64]}}',
                   b'{"__metadata__": "text"}', b'{"__metadata__": [1]}', b"[" * 50_000 + b"]" * 50_000):
        with pytest.raises(ValueError):
            tensors.decode(struct.pack("<Q", len(header)) + header + body[8 + n:])


def test_local_head_learns_a_separable_task() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, size=300)
    z = np.maximum(rng.normal(size=(300, 8)) * 0.3 + np.eye(3, 8)[y] * 2.0, 0.0)  # post-ReLU features
    w = fit_local_head(z, y, num_classes=4)
    assert w.shape == (4, 8)
    assert ((z @ w.T).argmax(1) == y).mean() > 0.95
    assert np.abs(w[3]).max() < np.abs(w[:3]).max()  # an absent class gets no evidence, only decay
    with pytest.raises(ValueError):
        fit_local_head(z, y, num_classes=2)  # labels outside [0, C)
