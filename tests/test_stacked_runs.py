"""Runs of one configuration stepped together (fl_server/engine/stacked.py): each run's results equal the ones
it gets alone, in float64, also when the runs resume from different rounds; runs that differ in more than their
seed are refused with the reason."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from fl_server.algorithms import build_algorithm
from fl_server.data.federated import make_federated
from fl_server.engine import RunConfig, Simulation
from fl_server.engine.stacked import check_stackable, run_stacked, stacked_round
from fl_server.models import build_model

HP = {"lr": 0.05, "inner_lr": 0.1, "mu": 0.1}  # FedTTA-Prox: its step reads the server state, per run


@pytest.fixture(scope="module")
def subset(mnist_all):  # type: ignore[no-untyped-def]
    return mnist_all.subset(np.arange(1200))


def _sim(subset, seed: int, out: Path | None, method: str = "FedTTA-Prox", mode: str = "vmap",  # type: ignore[no-untyped-def]
         rounds: int = 4, stop_after: int | None = None, model: str = "mlp", **hp) -> Simulation:
    fed = make_federated(subset, "pathological", 8, new_fraction=0.25, seed=seed)
    alg = build_algorithm(method, build_model(model, (1, 28, 28), 10, seed=seed), fed.num_train_clients,
                          seed=seed, **({**HP, **hp} if method.startswith("FedTTA") else hp))
    return Simulation(alg, fed, RunConfig(rounds=rounds, local_iterations=2, batch_size=8, eval_every=2, seed=seed,
                                          mode=mode, dtype="float64", device="cpu", progress=False,
                                          checkpoint_every=2, stop_after=stop_after,
                                          out_dir=str(out) if out else None))


def _assert_same_state(got: Simulation, want: Simulation) -> None:
    for key in ("params", "phi"):
        for name, ref in want.server_state[key].items():
            assert bool(torch.isfinite(ref).all()), (key, name)
            assert float((got.server_state[key][name] - ref).abs().max()) <= 1e-10, (key, name)


def _assert_same_run(got: Simulation, got_result, want: Simulation, want_result) -> None:  # type: ignore[no-untyped-def]
    _assert_same_state(got, want)
    assert got_result.best_round == want_result.best_round
    assert got_result.best_val == pytest.approx(want_result.best_val, abs=1e-12)
    assert got_result.test_at_best == pytest.approx(want_result.test_at_best, abs=1e-12)
    assert [r["round"] for r in got_result.history] == [r["round"] for r in want_result.history]


def test_stacked_runs_equal_their_solo_runs(subset, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two seeds (their own clients, initial weights and batches) stepped together, 4 rounds of FedTTA-Prox's
    second-order step: each ends where it ends alone, validates and picks its best round alike."""
    alone = [_sim(subset, seed, tmp_path / f"alone{seed}") for seed in (0, 1)]
    alone_results = [sim.run() for sim in alone]
    together = [_sim(subset, seed, tmp_path / f"together{seed}") for seed in (0, 1)]
    results = run_stacked(together)
    assert float((alone[0].server_state["phi"]["net.0.weight"] - alone[1].server_state["phi"]["net.0.weight"])
                 .abs().max()) > 1e-3  # the runs differ: stacking did not copy one run into the other
    for got, got_result, want, want_result in zip(together, results, alone, alone_results):
        _assert_same_run(got, got_result, want, want_result)
        assert (got.out_dir / "checkpoint.npz").exists() and (got.out_dir / "best.npz").exists()


def test_stacked_convolutions_equal_solo_rounds(subset) -> None:  # type: ignore[no-untyped-def]
    """On a ConvNet the two vmaps fold both runs' clients into one grouped convolution: one round of FedTTA-Prox
    stepped together equals each run's round alone, and returns what each run's run_round returns (the clients'
    ids and local states before aggregation)."""
    alone = [_sim(subset, seed, None, rounds=1, model="convnet_small") for seed in (0, 1)]
    solo_rounds = [sim.run_round(0) for sim in alone]
    together = [_sim(subset, seed, None, rounds=1, model="convnet_small") for seed in (0, 1)]
    stacked_rounds = stacked_round(together, 0)
    for got, want in zip(together, alone):
        _assert_same_state(got, want)
    for (got_ids, got_states), (want_ids, want_states) in zip(stacked_rounds, solo_rounds):
        assert np.array_equal(got_ids, want_ids)
        for a, b in zip(pytree.tree_leaves(got_states), pytree.tree_leaves(want_states)):
            assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-10


def test_runs_resumed_at_different_rounds_are_brought_level(subset, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Seed 0 stopped after 2 rounds, seed 1 fresh: stepped together they still end as their uninterrupted solo
    runs (seed 1 steps alone until it reaches seed 0's round)."""
    first = _sim(subset, 0, tmp_path / "s0", stop_after=2)
    assert first.run().rounds_done == 2
    together = [_sim(subset, 0, tmp_path / "s0"), _sim(subset, 1, tmp_path / "s1")]
    results = run_stacked(together)
    for seed, got, got_result in zip((0, 1), together, results):
        want = _sim(subset, seed, None)
        _assert_same_run(got, got_result, want, want.run())


def test_runs_that_differ_in_more_than_their_seed_are_refused(subset) -> None:  # type: ignore[no-untyped-def]
    base = _sim(subset, 0, None)
    with pytest.raises(ValueError, match=r"runs of seeds 0 and 1 differ in hyperparameters: only runs that differ "
                                         r"in their seed can be stepped together"):
        check_stackable([base, _sim(subset, 1, None, mu=0.2)])
    with pytest.raises(ValueError, match=r"differ in method, hyperparameters"):
        check_stackable([base, _sim(subset, 1, None, method="FedTTA", mu=0.0)])
    with pytest.raises(ValueError, match=r"runs stepped together need mode 'vmap' \(a run resolved to 'loop'\)"):
        check_stackable([base, _sim(subset, 1, None, mode="loop")])
    with pytest.raises(ValueError, match=r"ODPFL-HN's local step reads Python state"):
        check_stackable([_sim(subset, 0, None, method="ODPFL-HN")])
