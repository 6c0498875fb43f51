"""The odpfl-dp experiment (ODPFL-HN Sec. 7, lab.odpfl): the new clients' split and a tiny seed end to end."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from lab.experiments import get_experiment
from lab.odpfl import dp_split, run_dp_seed
from lab.plots import plot_odpfl_dp


def test_dp_split_gives_disjoint_nested_two_class_new_clients(fashion_all) -> None:  # type: ignore[no-untyped-def]
    split = dp_split(fashion_all, 90, np.random.default_rng(0))
    y = fashion_all.y
    assert len(split.embed_pools) == len(split.eval_sets) == 10
    used = np.concatenate([*split.embed_pools, *split.eval_sets, *split.fed.train, *split.fed.val])
    assert len(used) == len(np.unique(used)) == len(y)  # every sample used once, nothing shared
    for j, (pool, ev) in enumerate(zip(split.embed_pools, split.eval_sets)):
        assert len(pool) == 3000 and len(ev) == 300
        assert set(y[pool]) == set(y[ev]) == {j % 10, (j + 1) % 10}
        for n in (100, 300, 1000, 3000):  # every nested prefix |D| = n keeps the 50/50 class mix
            assert np.bincount(y[pool[:n]], minlength=10).max() == n // 2
    assert split.fed.num_train_clients == 90 and split.fed.new == []
    assert max(len(set(y[np.concatenate([t, v])])) for t, v in zip(split.fed.train, split.fed.val)) <= 2
    with pytest.raises(ValueError, match="samples per class"):
        dp_split(fashion_all.subset(np.arange(5000)), 10, np.random.default_rng(0))


def test_dp_run_scores_every_setting(fashion_all, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A tiny odpfl-dp seed end to end: one result per (|D|, eps) for ODPFL-HN with the DP encoder, one for
    FedAvg's global model, and the plot. (The noise scale per |D|: tests/test_odpfl_hn.py.)"""
    proto = get_experiment("odpfl-dp").protocols["fashion_mnist"]
    proto = replace(proto, rounds=2, num_clients=10, local_iterations=5, eval_every=2,
                    options={"pool": 400, "eval_size": 40, "set_sizes": (100, 400), "epsilons": (0.3, math.inf)})
    rec = run_dp_seed(proto, "ODPFL-HN", 0, None, device="cpu", progress=False)
    settings = {(r["set_size"], r["epsilon"]) for r in rec["results"] if r["split"] == "test"}
    assert settings == {(100, 0.3), (400, 0.3), (100, math.inf), (400, math.inf)}
    assert all(0.0 <= r["value"] <= 100.0 for r in rec["results"])
    assert rec["hyper"]["dp"] is True
    fed_rec = run_dp_seed(proto, "FedAvg", 0, None, device="cpu", progress=False)
    assert [r["setting"] for r in fed_rec["results"] if r["split"] == "test"] == ["global model (ignores D)"]
    rows = [{"method": "ODPFL-HN", "split": "test", "set_size": n, "epsilon": e, "mean": 50.0 + n / 100, "std": 1.0,
             "seeds": 1, "dataset": "fashion_mnist"} for n, e in settings]
    rows.append({"method": "FedAvg", "split": "test", "mean": 40.0, "std": 0.0, "seeds": 1, "dataset": "fashion_mnist"})
    png = plot_odpfl_dp(rows, tmp_path / "odpfl-dp.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
