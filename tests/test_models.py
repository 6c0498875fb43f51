"""Model zoo: shapes, separate features/head, post-ReLU features, seeded init."""
from __future__ import annotations

import pytest
import torch

from fl_server.models import MODELS, AdaptationMLP, build_model


# a LayerNorm on the pooled features makes them signed: such a model is not a BTFL model
SIGNED_FEATURES = {"resnet8_gn"}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_classifier_shapes(name: str, shape: tuple[int, int, int]) -> None:
    model = build_model(name, shape, 10, seed=0)
    x = torch.rand(4, *shape)
    z = model.features(x)
    assert z.shape == (4, model.feature_dim)
    if name not in SIGNED_FEATURES:
        assert (z >= 0).all()  # post-ReLU features (BTFL's DLE quantises them)
    assert torch.allclose(model.head(z), model(x))
    assert model.head.in_features == model.feature_dim and model.head.out_features == 10


def test_btfl_cnn_feature_dim() -> None:
    assert build_model("btfl_cnn", (3, 32, 32), 10).feature_dim == 64


def test_convnet_sizes_grow() -> None:
    n = [sum(p.numel() for p in build_model(m, (1, 28, 28), 10).parameters())
         for m in ("convnet_small", "convnet", "convnet_big")]
    assert n[0] < n[1] < n[2]


def test_seeded_init_is_reproducible_and_leaves_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("mlp", (1, 8, 8), 10, seed=5)
    after = torch.rand(1)
    b = build_model("mlp", (1, 8, 8), 10, seed=5)
    assert torch.equal(before, after)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_adaptation_mlp() -> None:
    g = AdaptationMLP(10, width=32)
    assert g(torch.randn(7, 10)).shape == (7,)
    assert [m.out_features for m in g.net if isinstance(m, torch.nn.Linear)] == [32, 32, 32, 1]


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        build_model("resnet", (1, 28, 28), 10)
