"""Client data of the UPFL side experiments on real data: rotated MNIST (App. F) and the data-size subsets."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fl_server.data.federated import make_federated, rotation_concept_shift

from lab.data_size import FRACTIONS, new_client_subsets


def _bilinear_ccw(img: np.ndarray, angle: float) -> tuple[np.ndarray, np.ndarray]:
    """Independent reference: the image rotated counter-clockwise by ``angle`` degrees about its centre,
    out(p) = in(R(-angle) p), bilinear; returns (values, mask of output pixels whose source is interior)."""
    h, w = img.shape
    c_r, c_c = (h - 1) / 2, (w - 1) / 2
    rows, cols = np.mgrid[0:h, 0:w].astype(np.float64)
    x, y = cols - c_c, c_r - rows  # y points up
    t = np.deg2rad(angle)
    xs, ys = x * np.cos(t) + y * np.sin(t), -x * np.sin(t) + y * np.cos(t)  # R(-angle) (x, y)
    src_r, src_c = c_r - ys, xs + c_c
    inside = (src_r >= 0) & (src_r <= h - 2) & (src_c >= 0) & (src_c <= w - 2)
    r0, c0 = np.clip(np.floor(src_r), 0, h - 2).astype(int), np.clip(np.floor(src_c), 0, w - 2).astype(int)
    fr, fc = src_r - r0, src_c - c0
    val = (img[r0, c0] * (1 - fr) * (1 - fc) + img[r0 + 1, c0] * fr * (1 - fc)
           + img[r0, c0 + 1] * (1 - fr) * fc + img[r0 + 1, c0 + 1] * fr * fc)
    return val, inside


def test_rotated_mnist_rotates_each_client_by_its_angle(mnist_all) -> None:
    fed = rotation_concept_shift(mnist_all, seed=0)
    src = np.asarray(fed.info["source_index"])
    assert len(fed.train) == len(fed.new) == 25 and len(src) == len(np.unique(src)) == 1000
    assert all(len(t) + len(v) == 20 for t, v in zip(fed.train, fed.val)) and all(len(n) == 20 for n in fed.new)
    clients = [np.concatenate([t, v]) for t, v in zip(fed.train, fed.val)] + fed.new
    angles = fed.info["train_angles"] + fed.info["new_angles"]
    assert set(fed.info["train_angles"]) == {0, 30, 60} and set(fed.info["new_angles"]) == {15, 45}
    np.testing.assert_array_equal(fed.dataset.y, mnist_all.y[src])
    for idx, angle in zip(clients, angles):
        for i in idx[:3]:
            out = fed.dataset.x[i, 0]
            want, inside = _bilinear_ccw(mnist_all.x[src[i], 0].astype(np.float64), angle)
            assert np.abs(out - want)[inside].max() < 1e-4, (i, angle)
            if angle:  # not merely any rotation: the image differs from the same digit at other angles
                other, _ = _bilinear_ccw(mnist_all.x[src[i], 0].astype(np.float64), -angle)
                assert np.abs(out - other)[inside].max() > 0.2


def test_rotated_mnist_is_seeded(mnist_all) -> None:
    a, b, c = (rotation_concept_shift(mnist_all, seed=s) for s in (0, 0, 1))
    assert np.array_equal(a.dataset.x, b.dataset.x) and a.info == b.info
    assert all(np.array_equal(x, y) for x, y in zip(a.train + a.new, b.train + b.new))
    assert a.info["source_index"] != c.info["source_index"]
    assert a.info["train_angles"] + a.info["new_angles"] != c.info["train_angles"] + c.info["new_angles"]


def test_data_size_subsets_are_exact_and_nested(fashion_all) -> None:
    fed = make_federated(fashion_all, "pathological", 100, seed=0)
    subsets = {a: new_client_subsets(fed.new, a, seed=0) for a in FRACTIONS}
    for j, full in enumerate(fed.new):
        for a in FRACTIONS:
            assert len(subsets[a][j]) == round(a * len(full))
            assert np.isin(subsets[a][j], full).all()
        for small, big in zip(FRACTIONS, FRACTIONS[1:]):
            assert np.isin(subsets[small][j], subsets[big][j]).all()
        assert np.array_equal(subsets[1.0][j], full)
    # a fresh call gives the same subsets; another seed other ones; the training clients are untouched
    assert all(np.array_equal(x, y) for x, y in zip(subsets[0.25], new_client_subsets(fed.new, 0.25, seed=0)))
    assert not all(np.array_equal(x, y) for x, y in zip(subsets[0.25], new_client_subsets(fed.new, 0.25, seed=1)))


def test_subsample_keeps_at_least_one_and_rejects_bad_fractions() -> None:
    from fl_server.data.partitions import subsample

    assert len(subsample(np.arange(3), 0.1, np.random.default_rng(0))) == 1
    with pytest.raises(ValueError, match="fraction"):
        subsample(np.arange(3), 0.0, np.random.default_rng(0))


def test_data_size_shares_the_table1_training_only_for_the_same_protocol(tmp_path) -> None:
    from lab.data_size import _training_dir
    from lab.experiments import EXPERIMENTS

    protocol = EXPERIMENTS["upfl-data-size"].protocols["fashion_mnist"]
    run_dir = tmp_path / "upfl-data-size" / "fashion_mnist" / "FedTTApp" / "seed2"
    assert _training_dir(protocol, run_dir) == tmp_path / "upfl-table1" / "fashion_mnist" / "FedTTApp" / "seed2"
    assert _training_dir(protocol.quick(), run_dir) == run_dir  # its smoke profile differs from table1's
    assert _training_dir(replace(protocol, rounds=10), run_dir) == run_dir
