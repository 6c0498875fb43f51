"""Federated partitions of the papers' protocols: pathological shards (McMahan et al.), Dirichlet(alpha) over labels
(Hsu et al.), natural clients, incomplete classes. Every function is a pure function of (labels, rng).

All return ``list[np.ndarray]``: one int64 index array per client, indices into the dataset.
"""
from __future__ import annotations

import numpy as np


def _check_clients(num_clients: int, n: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > n:
        raise ValueError(f"cannot split {n} samples over {num_clients} clients")


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Uniformly random, equal-size (up to one sample) split."""
    _check_clients(num_clients, len(labels))
    return [np.sort(part).astype(np.int64) for part in np.array_split(rng.permutation(len(labels)), num_clients)]


def pathological(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, shards_per_client: int = 2
) -> list[np.ndarray]:
    """McMahan et al. (2017) shards with a strict class bound: ``num_clients * shards_per_client`` shards,
    each cut from a single class (shards per class proportional to the class size, largest remainder), and
    each client receives ``shards_per_client`` random shards -> at most ``shards_per_client`` classes.
    (Cutting the label-sorted array into equal shards, as the original does, lets a shard straddle two
    classes; this variant keeps the bound exact at the cost of +-5% client sizes.)"""
    n_shards = num_clients * shards_per_client
    _check_clients(n_shards, len(labels))
    classes, counts = np.unique(labels, return_counts=True)
    if n_shards < len(classes):
        raise ValueError(f"the pathological partition cuts {shards_per_client} single-class shards per client: "
                         f"{num_clients} clients make {n_shards} shards, fewer than the data's {len(classes)} "
                         f"classes; use at least {-(-len(classes) // shards_per_client)} clients or another "
                         f"partition (dirichlet, iid)")
    quota = counts / counts.sum() * n_shards
    per_class = np.floor(quota).astype(int)
    per_class[np.argsort(per_class - quota)[: n_shards - per_class.sum()]] += 1  # largest remainders
    shards = [chunk for c, k in zip(classes, per_class)
              for chunk in np.array_split(rng.permutation(np.flatnonzero(labels == c)), k)]
    shard_ids = rng.permutation(n_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[s] for s in ids])).astype(np.int64) for ids in shard_ids]


def dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator, min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Hsu et al. (2019): for each class draw client proportions ~ Dir(alpha); resample until every client
    holds at least ``min_size`` samples."""
    if alpha <= 0:
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}")
    _check_clients(num_clients, len(labels))
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha)))[:-1] * len(idx)).astype(int)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        clients = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(c) for c in clients) >= min_size:
            return clients
    raise ValueError(
        f"could not draw a Dirichlet({alpha}) partition of {len(labels)} samples over {num_clients} clients with "
        f">= {min_size} samples each in {max_tries} tries; use fewer clients (num_clients, --clients), a larger alpha "
        f"or more samples"
    )


def incomplete_classes(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, min_classes: int = 2,
    max_classes: int | None = None,
) -> list[np.ndarray]:
    """MAP's incomplete-classes setting: client k observes c_k ~ U{min_classes..C} random classes; each
    class's samples are split evenly (at random) among the clients that observe it."""
    _check_clients(num_clients, len(labels))
    classes = np.unique(labels)
    max_classes = len(classes) if max_classes is None else max_classes
    if not 1 <= min_classes <= max_classes <= len(classes):
        raise ValueError(f"need 1 <= min_classes <= max_classes <= {len(classes)}")
    owned = [rng.choice(classes, size=rng.integers(min_classes, max_classes + 1), replace=False)
             for _ in range(num_clients)]
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in classes:
        holders = [k for k in range(num_clients) if c in owned[k]]
        if not holders:  # nobody drew this class: give it to a random client
            holders = [int(rng.integers(num_clients))]
        for k, chunk in zip(holders, np.array_split(rng.permutation(np.flatnonzero(labels == c)), len(holders))):
            parts[k].append(chunk)
    return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts]


def split_new_clients(
    num_clients: int, new_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Hold out ``round(new_fraction * num_clients)`` random clients as new clients (never trained on).
    Returns (training client ids, new client ids), both sorted."""
    if not 0.0 <= new_fraction < 1.0:
        raise ValueError(f"new_fraction must be in [0, 1), got {new_fraction}")
    n_new = int(round(new_fraction * num_clients))
    perm = rng.permutation(num_clients)
    return np.sort(perm[n_new:]), np.sort(perm[:n_new])


def train_val_split(
    indices: np.ndarray, val_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Random split of one client's indices into (train, val); UPFL uses val_fraction = 0.15."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    perm = rng.permutation(indices)
    n_val = int(round(val_fraction * len(indices)))
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def subsample(indices: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Keep ``round(fraction * n)`` (at least one) of a client's n indices (UPFL Sec. 4.4 data-size sweep):
    the first ones of a random permutation, so generators in the same state give *nested* subsets (a smaller
    fraction is a subset of a bigger one) and the rng advances by the same amount whatever the fraction."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    keep = max(1, int(round(fraction * len(indices))))
    return np.sort(rng.permutation(indices)[:keep])


def hold_out(n: int, size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random ``size`` of ``n`` sample indices set aside (e.g. HeteroFedTTA's public unlabeled set D_p).
    Returns (kept, held out), both sorted and disjoint."""
    if not 0 <= size < n:
        raise ValueError(f"cannot hold out {size} of {n} samples")
    perm = rng.permutation(n)
    return np.sort(perm[size:]), np.sort(perm[:size])
