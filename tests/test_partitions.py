"""Partitions and the UPFL federated split on real MNIST labels."""
from __future__ import annotations

import numpy as np
import pytest

from fl_server.data import partitions
from fl_server.data.federated import hold_out_validation_clients, make_federated, rotation_concept_shift


def _covers_exactly_once(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n and len(np.unique(allidx)) == n


def test_pathological_two_classes_per_client(mnist_all) -> None:
    parts = partitions.pathological(mnist_all.y, 100, np.random.default_rng(0))
    _covers_exactly_once(parts, 70_000)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 650 and sizes.max() <= 750 and sizes.sum() == 70_000
    classes = [len(np.unique(mnist_all.y[p])) for p in parts]
    assert max(classes) <= 2 and np.mean(classes) > 1.5


def test_partitions_are_seeded(mnist_all) -> None:
    a = partitions.pathological(mnist_all.y, 100, np.random.default_rng(3))
    b = partitions.pathological(mnist_all.y, 100, np.random.default_rng(3))
    c = partitions.pathological(mnist_all.y, 100, np.random.default_rng(4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_dirichlet_skew_and_min_size(mnist_all, alpha: float) -> None:
    parts = partitions.dirichlet(mnist_all.y, 20, alpha, np.random.default_rng(0), min_size=10)
    _covers_exactly_once(parts, 70_000)
    assert min(len(p) for p in parts) >= 10
    # smaller alpha -> more skewed label distributions (mean max-class share)
    share = np.mean([np.bincount(mnist_all.y[p], minlength=10).max() / len(p) for p in parts])
    assert share > (0.5 if alpha == 0.1 else 0.15)


def test_dirichlet_rejects_bad_alpha(mnist_all) -> None:
    with pytest.raises(ValueError, match="alpha must be > 0"):
        partitions.dirichlet(mnist_all.y, 10, 0.0, np.random.default_rng(0))


def test_incomplete_classes(mnist_all) -> None:
    parts = partitions.incomplete_classes(mnist_all.y, 100, np.random.default_rng(0))
    _covers_exactly_once(parts, 70_000)
    counts = [len(np.unique(mnist_all.y[p])) for p in parts]
    assert min(counts) >= 2 and max(counts) <= 10 and len(set(counts)) > 3


def test_upfl_split(mnist_all) -> None:
    fed = make_federated(mnist_all, "pathological", 100, new_fraction=0.5, val_fraction=0.15, seed=0)
    assert len(fed.train) == len(fed.val) == 50 and len(fed.new) == 50
    assert all(abs(len(v) - 0.15 * (len(t) + len(v))) <= 1 for t, v in zip(fed.train, fed.val))
    _covers_exactly_once(fed.train + fed.val + fed.new, 70_000)


def test_new_client_subsample(mnist_all) -> None:
    fed = make_federated(mnist_all, "pathological", 100, seed=0, new_client_fraction_kept=0.1)
    full = make_federated(mnist_all, "pathological", 100, seed=0)
    assert all(len(n) == round(0.1 * len(f)) for n, f in zip(fed.new, full.new))


def test_rotation_concept_shift(mnist_all) -> None:
    fed = rotation_concept_shift(mnist_all, seed=0)
    assert len(fed.train) == 25 and len(fed.new) == 25
    assert set(fed.info["train_angles"]) <= {0, 30, 60} and set(fed.info["new_angles"]) <= {15, 45}
    assert len(fed.dataset) == 1000
    assert sum(len(n) for n in fed.new) == 500


def test_split_errors() -> None:
    with pytest.raises(ValueError, match="new_fraction"):
        partitions.split_new_clients(10, 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="cannot split"):
        partitions.iid(np.zeros(5, np.int64), 6, np.random.default_rng(0))


def test_validation_clients_leave_training_whole(mnist_all) -> None:
    fed = make_federated(mnist_all, "dirichlet", 30, new_fraction=0.1, seed=0, alpha=0.5)
    held = hold_out_validation_clients(fed, 4)
    assert held.num_train_clients == fed.num_train_clients - 4 and held.new is fed.new
    assert held.info["val_clients"] == 4 and "val_clients" not in fed.info
    for j in range(4):  # all of a validation client's samples, and nothing of anyone else's
        assert np.array_equal(np.sort(held.val_clients[j]), np.sort(np.concatenate([fed.train[j], fed.val[j]])))
    training = np.concatenate(held.train + held.val)
    assert not np.intersect1d(training, np.concatenate(held.val_clients)).size
    assert len(training) + sum(map(len, held.val_clients)) == sum(map(len, fed.train + fed.val))
    with pytest.raises(ValueError, match=r"validation clients must be between 1 and 26 \(the training clients less one\), got 27"):
        hold_out_validation_clients(fed, 27)


def test_pathological_with_fewer_shards_than_classes_says_so() -> None:
    """4 clients make 8 single-class shards, too few for 10 classes: one line naming what works (before: numpy's
    'number sections must be larger than 0')."""
    labels = np.repeat(np.arange(10), 20)
    with pytest.raises(ValueError, match=r"^the pathological partition cuts 2 single-class shards per client: 4 "
                                         r"clients make 8 shards, fewer than the data's 10 classes; use at least 5 "
                                         r"clients or another partition \(dirichlet, iid\)$"):
        partitions.pathological(labels, 4, np.random.default_rng(0))
    assert len(partitions.pathological(labels, 5, np.random.default_rng(0))) == 5


def test_a_dirichlet_partition_too_fine_for_the_data_names_the_knobs() -> None:
    """40 samples over 6 clients of at least 10: one line naming the recipe's own settings (before: a min_size no
    recipe has)."""
    labels = np.repeat(np.arange(10), 4)
    with pytest.raises(ValueError, match=r"^could not draw a Dirichlet\(0\.5\) partition of 40 samples over 6 clients "
                                         r"with >= 10 samples each in 1000 tries; use fewer clients \(num_clients, "
                                         r"--clients\), a larger alpha or more samples$"):
        partitions.dirichlet(labels, 6, 0.5, np.random.default_rng(0))
