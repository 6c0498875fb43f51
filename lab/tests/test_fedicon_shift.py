"""The fedicon-shift experiment (lab.shift): online memories, local test sets by label mix, the harness end to end."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_server.algorithms import build_algorithm
from fl_server.data.federated import make_federated
from fl_server.models import build_model

from lab.experiments import get_experiment
from lab.runner import run_experiment
from lab.shift import _online_memories, assign_by_label, run_shift_seed


def test_fedicon_shift_online_memory_is_the_clients_training_data(mnist_all) -> None:  # type: ignore[no-untyped-def]
    fed = make_federated(mnist_all.subset(np.arange(2000)), "dirichlet", num_clients=4, new_fraction=0.0,
                         alpha=0.5, seed=0)
    model = build_model("mlp", (1, 28, 28), 10, seed=0)
    batch = build_algorithm("FedICON", model, 4, seed=0)
    assert _online_memories(batch, fed, 0, torch.device("cpu"), torch.float32) is None
    online = build_algorithm("FedICON", model, 4, seed=0, tta_mode="online", memory_size=16)
    memories = _online_memories(online, fed, 0, torch.device("cpu"), torch.float32)
    assert memories is not None and len(memories) == fed.num_train_clients
    for memory, train in zip(memories, fed.train):
        assert memory.shape == (16, 1, 28, 28)
        own = torch.from_numpy(fed.dataset.x[train]).flatten(1)
        assert bool((memory.flatten(1)[:, None] == own[None]).all(-1).any(1).all())


def test_fedicon_shift_quick_experiment(tmp_path, data_root) -> None:  # type: ignore[no-untyped-def]
    """The harness end to end at CI size: every method, shifted conditions, rows per shift."""
    exp = get_experiment("fedicon-shift")
    rows = run_experiment(exp, ["mnist"], list(exp.methods), 1, tmp_path / "results", tmp_path / "runs",
                          quick=True, progress=False, data_root=str(data_root))
    got = {(r["method"], r["split"], r["shift"]) for r in rows}
    for method in exp.methods:
        for shift in ("clean", "gaussian_noise-3", "covariate-s3", "digits"):
            assert (method, "test", shift) in got
        assert (method, "val", "clean") in got
    assert all(0.0 <= r["mean"] <= 100.0 for r in rows)
    # trainings are shared: one FedAvg and one FedICON run folder
    assert sorted(p.name for p in (tmp_path / "runs" / "fedicon-shift" / "mnist").iterdir()) == ["FedAvg", "FedICON"]
    by = {(r["method"], r["shift"]): r["mean"] for r in rows if r["split"] == "test"}
    assert by[("FedAvg", "clean")] > by[("FedAvg", "digits")]  # the domain shift costs accuracy


def test_bn_affine_tent_is_refused_without_batch_normalisation(tmp_path, data_root) -> None:  # type: ignore[no-untyped-def]
    """Before training anything (no run folder is written)."""
    protocol = get_experiment("fedicon-shift").protocols["mnist"].quick()
    with pytest.raises(ValueError, match=r"^TENT \(BN affine\) needs a batch-normalised model and mlp has none"):
        run_shift_seed(protocol, "TENT (BN affine)", 0, tmp_path / "runs" / "TENT_BN_affine" / "seed0",
                       device="cpu", progress=False, data_root=str(data_root))
    assert not (tmp_path / "runs").exists()


def test_local_test_sets_follow_each_clients_label_mix() -> None:
    labels = np.repeat(np.arange(3), [100, 200, 300])
    counts = np.array([[10, 0, 30], [30, 20, 0], [0, 20, 30]])
    parts = assign_by_label(labels, counts, np.random.default_rng(0))
    assert sorted(np.concatenate(parts).tolist()) == list(range(600))  # every test sample, exactly once
    got = np.stack([np.bincount(labels[p], minlength=3) for p in parts])
    assert got.tolist() == [[25, 0, 150], [75, 100, 0], [0, 100, 150]]
