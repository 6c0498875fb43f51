"""The coordinator's fused hypernetwork (one matmul for every output head) equals ODPFL-HN's own f_theta, and
its replies decode to the same weights in both formats."""
from __future__ import annotations

import base64
import json

import numpy as np
import torch

from edge_sdk import _tensors as tensors
from fl_server.algorithms.odpfl_hn import ODPFLHN
from fl_server.functional import get_params
from fl_server.models import build_model
from fl_server.service.hypernet import FusedHypernet, encode_json


def _algorithm_and_theta() -> tuple[ODPFLHN, dict[str, torch.Tensor]]:
    alg = ODPFLHN(build_model("mlp", (1, 4, 4), 3, seed=0), seed=0, encoder_model="mlp", embed_dim=5,
                  hn_width=16, hn_layers=2)
    theta = get_params(alg.hypernet, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    return alg, {k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in theta.items()}  # not the init


def test_fused_heads_equal_the_algorithms_generate() -> None:
    alg, theta = _algorithm_and_theta()
    fused = FusedHypernet(alg, theta)
    e = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    rows = fused(e)
    want = alg.generate(theta, torch.from_numpy(e))
    assert rows.shape == (7, sum(v[0].numel() for v in want.values()))
    for k in range(7):
        got = fused.split(rows[k])
        assert list(got) == [f"psi.{n}" for n in want]
        for name, v in want.items():
            np.testing.assert_allclose(got[f"psi.{name}"], v[k].numpy(), rtol=1e-5, atol=1e-6)


def test_binary_row_and_json_reply_carry_the_same_weights() -> None:
    alg, theta = _algorithm_and_theta()
    fused = FusedHypernet(alg, theta)
    row = fused(np.ones((1, 5), np.float32))[0]
    header = tensors.encode_header(dict(zip(fused.names, fused.shapes)), {"bundle_id": "b" * 64})
    binary, meta = tensors.decode(header + row.astype("<f4").tobytes())
    as_json = json.loads(encode_json("b" * 64, fused.split(row)))
    assert meta["bundle_id"] == as_json["bundle_id"] == "b" * 64
    for name, t in as_json["params"].items():
        np.testing.assert_array_equal(binary[name], np.frombuffer(base64.b64decode(t["data"]), "<f4").reshape(t["shape"]))
