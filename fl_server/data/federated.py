"""A federated task: one dataset, training clients (train/val indices) and held-out new clients."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_server.data import partitions
from fl_server.data.datasets import ArrayDataset
from fl_server.data.shifts import rotate

PARTITIONS = ("pathological", "dirichlet", "iid", "incomplete")


@dataclass
class FederatedData:
    """Index lists into ``dataset``: ``train[k]`` / ``val[k]`` belong to training client k,
    ``new[j]`` is new client j's whole (unlabeled at adaptation time) data set; ``public`` are samples held
    out from every client (HeteroFedTTA's public unlabeled set D_p; empty unless asked for);
    ``val_clients[j]`` is validation client j's whole data set: a client held out of training and scored
    like a new client to choose the best round (empty unless asked for, see :func:`hold_out_validation_clients`)."""

    dataset: ArrayDataset
    train: list[np.ndarray]
    val: list[np.ndarray]
    new: list[np.ndarray]
    info: dict[str, Any] = field(default_factory=dict)
    public: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    val_clients: list[np.ndarray] = field(default_factory=list)

    @property
    def num_train_clients(self) -> int:
        return len(self.train)

    def summary(self) -> str:
        sizes = [len(t) for t in self.train]
        return (f"{self.dataset.name}: {len(self.train)} training clients "
                f"({min(sizes)}-{max(sizes)} train samples), {len(self.new)} new clients, "
                f"{self.info.get('partition', '?')} partition")


def partition_labels(labels: np.ndarray, partition: str, num_clients: int, rng: np.random.Generator,
                     alpha: float | None = None) -> list[np.ndarray]:
    """Dispatch to :mod:`fl_server.data.partitions` by name."""
    if partition == "pathological":
        return partitions.pathological(labels, num_clients, rng)
    if partition == "dirichlet":
        if alpha is None:
            raise ValueError("the dirichlet partition needs alpha")
        return partitions.dirichlet(labels, num_clients, alpha, rng)
    if partition == "iid":
        return partitions.iid(labels, num_clients, rng)
    if partition == "incomplete":
        return partitions.incomplete_classes(labels, num_clients, rng)
    raise ValueError(f"unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}")


def make_federated(
    dataset: ArrayDataset, partition: str = "pathological", num_clients: int = 100, new_fraction: float = 0.5,
    val_fraction: float = 0.15, seed: int = 0, alpha: float | None = None, new_client_fraction_kept: float = 1.0,
    public_size: int = 0,
) -> FederatedData:
    """UPFL protocol by default: 100 pathological clients, 50% new clients, 85/15 train/val.
    ``new_client_fraction_kept`` < 1 subsamples each new client's data (UPFL Fig. 3).
    ``public_size`` > 0 first sets that many random samples aside as the public set (no client holds any);
    the clients partition the rest. With 0 the draws are those of the plain protocol."""
    rng = np.random.default_rng(seed)
    public = np.zeros(0, np.int64)
    if public_size > 0:
        rest, public = partitions.hold_out(len(dataset), public_size, rng)
        clients = [rest[c] for c in partition_labels(dataset.y[rest], partition, num_clients, rng, alpha)]
    else:
        clients = partition_labels(dataset.y, partition, num_clients, rng, alpha)
    info = {"partition": partition, "num_clients": num_clients, "new_fraction": new_fraction,
            "val_fraction": val_fraction, "seed": seed, "alpha": alpha,
            "new_client_fraction_kept": new_client_fraction_kept}
    if public_size > 0:  # only then: ``info`` enters run fingerprints, existing runs must keep theirs
        info["public_size"] = public_size
    return split_clients(dataset, clients, new_fraction, val_fraction, rng, info, new_client_fraction_kept, public)


def split_clients(dataset: ArrayDataset, clients: list[np.ndarray], new_fraction: float, val_fraction: float,
                  rng: np.random.Generator, info: dict[str, Any], new_client_fraction_kept: float = 1.0,
                  public: np.ndarray | None = None) -> FederatedData:
    """Clients (sample indices each) -> training clients (train/val split) and new clients, drawn from ``rng``."""
    train_ids, new_ids = partitions.split_new_clients(len(clients), new_fraction, rng)
    train, val = zip(*(partitions.train_val_split(clients[k], val_fraction, rng) for k in train_ids))
    new = [clients[k] for k in new_ids]
    if new_client_fraction_kept < 1.0:
        new = [partitions.subsample(c, new_client_fraction_kept, rng) for c in new]
    return FederatedData(dataset, list(train), list(val), new, info,
                         public if public is not None else np.zeros(0, np.int64))


def natural_federated(dataset: ArrayDataset, client_ids: np.ndarray, new_fraction: float = 0.5,
                      val_fraction: float = 0.15, seed: int = 0) -> FederatedData:
    """The user's own partition: sample i belongs to client ``client_ids[i]`` (clients in sorted id order);
    which clients are new and each training client's train/val split are drawn as in :func:`make_federated`."""
    ids, inverse = np.unique(client_ids, return_inverse=True)
    clients = [np.flatnonzero(inverse == k) for k in range(len(ids))]
    info = {"partition": "natural", "num_clients": len(ids), "new_fraction": new_fraction,
            "val_fraction": val_fraction, "seed": seed}
    return split_clients(dataset, clients, new_fraction, val_fraction, np.random.default_rng(seed), info)


def random_subset(dataset: ArrayDataset, keep: int, seed: int) -> ArrayDataset:
    """``keep`` random samples of ``dataset`` (in their order), drawn from ``seed``; all of it when ``keep`` is 0
    or not smaller (smoke runs of the bench and the Flower app)."""
    return dataset if not keep or keep >= len(dataset) else dataset.subset(subset_indices(len(dataset), keep, seed))


def subset_indices(n: int, keep: int, seed: int) -> np.ndarray:
    """The indices (sorted) of :func:`random_subset`'s samples among ``n``; all of them when ``keep`` is 0 or not
    smaller (the raw images behind a run's clients: ``fl-server device-data``)."""
    if not keep or keep >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng([seed, 0x5A3]).choice(n, keep, False))


def hold_out_validation_clients(fed: FederatedData, count: int) -> FederatedData:
    """Client-level validation: the first ``count`` training clients leave training and become validation
    clients (all their samples, scored like new clients), so that model selection sees whether a method
    generalises to clients it never trained on. Per-sample validation splits cannot see that: a method that
    memorises its training clients (ODPFL-HN's hypernetwork mapping their embeddings) scores well on them.
    Training clients are in random order (:func:`partitions.split_new_clients` draws them at random and the
    label partitions are exchangeable across clients), so the first ``count`` are a random choice."""
    if not 0 < count < fed.num_train_clients:
        raise ValueError(f"validation clients must be between 1 and {fed.num_train_clients - 1} "
                         f"(the training clients less one), got {count}")
    held = [np.concatenate([t, v]) for t, v in zip(fed.train[:count], fed.val[:count])]
    return FederatedData(fed.dataset, fed.train[count:], fed.val[count:], fed.new,
                         {**fed.info, "val_clients": count}, fed.public, held)


def rotation_concept_shift(
    dataset: ArrayDataset, seed: int = 0, n_samples: int = 1000, num_clients: int = 50,
    train_angles: tuple[float, ...] = (0, 30, 60), new_angles: tuple[float, ...] = (15, 45),
    val_fraction: float = 0.15,
) -> FederatedData:
    """UPFL App. F: ``n_samples`` random samples, IID over ``num_clients``; half are training clients, each
    rotated by a fixed angle drawn from ``train_angles``; the other half are new clients rotated by an angle
    from ``new_angles``. Returns a new (rotated) dataset with the indices into it."""
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(dataset), size=n_samples, replace=False)
    base = dataset.subset(pick)
    clients = partitions.iid(base.y, num_clients, rng)
    train_ids, new_ids = partitions.split_new_clients(num_clients, 0.5, rng)
    angles = np.zeros(num_clients)
    angles[train_ids] = rng.choice(train_angles, size=len(train_ids))
    angles[new_ids] = rng.choice(new_angles, size=len(new_ids))
    x = base.x.copy()
    for angle in np.unique(angles):  # one vectorised rotation per distinct angle
        idx = np.concatenate([clients[k] for k in np.flatnonzero(angles == angle)])
        x[idx] = rotate(base.x[idx], float(angle))
    rotated = ArrayDataset(f"{dataset.name}-rotated", x, base.y, dataset.num_classes)
    train, val = zip(*(partitions.train_val_split(clients[k], val_fraction, rng) for k in train_ids))
    info = {"partition": "rotation", "num_clients": num_clients, "seed": seed,
            "train_angles": angles[train_ids].tolist(), "new_angles": angles[new_ids].tolist(),
            "source_index": pick.tolist()}  # rotated sample i is dataset[source_index[i]] rotated
    return FederatedData(rotated, list(train), list(val), [clients[k] for k in new_ids], info)
