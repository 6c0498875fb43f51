"""New clients from a domain the federation never saw: the 8x8 digits upsampled to MNIST's 28x28, and
two-class clients drawn from any labelled pool (UPFL's pathological new clients).

    from fl_server.data.domains import two_class_clients, upsampled_digits

    digits = upsampled_digits()                    # x [1797, 1, 28, 28] in [0, 1], y [1797]
    clients = two_class_clients(digits.y, 10, 100, np.random.default_rng(0))   # 10 index arrays of 100
"""
from __future__ import annotations

import numpy as np

from fl_server.data.datasets import ArrayDataset, load_dataset
from fl_server.data.shifts import resize


def upsampled_digits(size: tuple[int, int] = (28, 28)) -> ArrayDataset:
    """scikit-learn's 1,797 8x8 digits, bilinearly upsampled to ``size`` (values in [0, 1], labels 0-9)."""
    digits = load_dataset("digits", split="all")
    return ArrayDataset("digits-28", resize(digits.x, size), digits.y, digits.num_classes)


def two_class_clients(labels: np.ndarray, num_clients: int, per_client: int,
                      rng: np.random.Generator) -> list[np.ndarray]:
    """``num_clients`` index arrays into ``labels``: each client two distinct random classes with
    ``per_client // 2`` samples of each (drawn without replacement within the client; clients may share
    samples). Raises ValueError when a class has fewer than ``per_client // 2`` samples or fewer than two
    classes are present."""
    classes = np.unique(labels)
    half = per_client // 2
    if len(classes) < 2 or half < 1:
        raise ValueError(f"need >= 2 classes and per_client >= 2, got {len(classes)} classes, {per_client}")
    pools = {int(c): np.flatnonzero(labels == c) for c in classes}
    if (small := min(len(p) for p in pools.values())) < half:
        raise ValueError(f"a class has {small} samples, fewer than the {half} a client needs")
    out = []
    for _ in range(num_clients):  # a handful of clients
        pair = rng.choice(classes, 2, replace=False)
        out.append(np.sort(np.concatenate([rng.choice(pools[int(c)], half, replace=False) for c in pair])))
    return out
