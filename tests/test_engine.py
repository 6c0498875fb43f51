"""Simulation engine: vmap == per-client loop, checkpoint/resume == uninterrupted run, batch sampling."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_server.algorithms import build_algorithm
from fl_server.data.federated import hold_out_validation_clients, make_federated
from fl_server.engine import RunConfig, Simulation
from fl_server.engine.simulation import client_batches
from fl_server.models import build_model


@pytest.fixture(scope="module")
def small_fed(mnist_all):  # type: ignore[no-untyped-def]
    # 20 pathological clients on a 7,000-sample slice of real MNIST: 10 training, 10 new
    sub = mnist_all.subset(np.random.default_rng(0).choice(len(mnist_all), 7000, replace=False))
    return make_federated(sub, "pathological", 20, seed=0)


def _sim(fed, method: str, mode: str, dtype: str = "float64", rounds: int = 2, out: Path | None = None,
         model: str = "mlp", eval_every: int = 1, **hp):  # type: ignore[no-untyped-def]
    alg = build_algorithm(method, build_model(model, (1, 28, 28), 10, seed=0), fed.num_train_clients,
                          **({"lr": 0.1} | hp))
    cfg = RunConfig(rounds=rounds, local_iterations=5, batch_size=32, seed=0, mode=mode, dtype=dtype,
                    device="cpu", progress=False, out_dir=str(out) if out else None, checkpoint_every=1,
                    eval_every=eval_every)
    return Simulation(alg, fed, cfg)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("method", ["FedAvg", "FedProx"])
def test_vmap_equals_loop_float64(small_fed, method: str) -> None:
    sims = {mode: _sim(small_fed, method, mode) for mode in ("vmap", "loop")}
    for s in sims.values():
        s.run()
    assert _max_diff(sims["vmap"].server_state["params"], sims["loop"].server_state["params"]) < 1e-10


def test_vmap_equals_loop_float32_convnet(small_fed) -> None:
    sims = {mode: _sim(small_fed, "FedAvg", mode, dtype="float32", rounds=1, model="convnet") for mode in ("vmap", "loop")}
    for s in sims.values():
        s.run()
    assert _max_diff(sims["vmap"].server_state["params"], sims["loop"].server_state["params"]) < 1e-4


def test_training_moves_params_and_aggregates_by_size(small_fed) -> None:
    sim = _sim(small_fed, "FedAvg", "vmap", rounds=1)
    start = {k: v.clone() for k, v in sim.server_state["params"].items()}
    ids = np.arange(small_fed.num_train_clients)
    states = sim.algorithm.client_start(sim.server_state, ids)
    states = sim.local_train(sim.algorithm.local_step, states, sim.server_state, ids, 5, np.random.default_rng(0))
    w = sim.train_sizes / sim.train_sizes.sum()
    expected = {k: torch.einsum("k,k...->...", w, v) for k, v in states["params"].items()}
    agg = sim.algorithm.aggregate(sim.server_state, ids, states, sim.train_sizes)["params"]
    assert _max_diff(agg, expected) < 1e-12
    assert _max_diff(agg, start) > 1e-3


def test_resume_repeats_the_uninterrupted_run(small_fed, tmp_path: Path) -> None:
    straight = _sim(small_fed, "TENT", "vmap", rounds=4, out=tmp_path / "a")
    res_a = straight.run()
    first = _sim(small_fed, "TENT", "vmap", rounds=4, out=tmp_path / "b")
    first.cfg.rounds = 2  # stop after 2 rounds ...
    first.fingerprint = straight.fingerprint  # ... as if killed mid-run
    first.run()
    resumed = _sim(small_fed, "TENT", "vmap", rounds=4, out=tmp_path / "b")
    res_b = resumed.run()
    assert _max_diff(straight.server_state["params"], resumed.server_state["params"]) == 0.0
    rows_a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa: E731
    assert strip(rows_a) == strip(rows_b) and len(rows_b) == 4
    assert (res_a.best_round, res_a.best_val, res_a.test_at_best) == (res_b.best_round, res_b.best_val, res_b.test_at_best)
    assert (tmp_path / "b" / "best.npz").exists()


def test_kill_between_state_and_json_does_not_repeat_a_round(small_fed, tmp_path: Path) -> None:
    """A kill after checkpoint.npz (round 2) was renamed into place but before checkpoint.json followed (it
    still says round 1) and with a half-written metrics line: the resumed run starts at round 2 (the round is
    stored inside the state file) and ends equal to the uninterrupted run."""
    straight = _sim(small_fed, "FedAvg", "vmap", rounds=3, out=tmp_path / "a")
    straight.run()
    first = _sim(small_fed, "FedAvg", "vmap", rounds=3, out=tmp_path / "b")
    first.cfg.rounds = 1
    first.fingerprint = straight.fingerprint
    first.run()
    stale_json = (tmp_path / "b" / "checkpoint.json").read_text()  # rounds_done = 1
    first.cfg.rounds = 2
    first.run()
    (tmp_path / "b" / "checkpoint.json").write_text(stale_json)
    with open(tmp_path / "b" / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 2, "va')  # the killed process was writing the next row
    resumed = _sim(small_fed, "FedAvg", "vmap", rounds=3, out=tmp_path / "b")
    resumed.run()
    assert _max_diff(straight.server_state["params"], resumed.server_state["params"]) == 0.0
    rows = [json.loads(x)["round"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [0, 1, 2]


def _killed_after(fed, rounds: int, of: int, out: Path, eval_every: int = 1,  # type: ignore[no-untyped-def]
                 method: str = "TENT"):
    """The run directory of an ``of``-round run killed after ``rounds`` rounds (checkpoint every round)."""
    first = _sim(fed, method, "vmap", rounds=of, out=out, eval_every=eval_every)
    first.cfg.stop_after = rounds
    assert first.run().rounds_done == rounds


def _same_result(a, b) -> bool:  # type: ignore[no-untyped-def]
    return (a.best_round, a.best_val, a.test_at_best) == (b.best_round, b.best_val, b.test_at_best)


def test_a_run_cut_short_reports_the_best_state_of_the_checkpoint(small_fed, tmp_path: Path) -> None:
    """A 6-round run checkpoints after 4 rounds, improves in round 5 (best.npz moves on to it) and is killed
    before its next checkpoint: the 4-round run cut out of it reports the best state as of the checkpoint."""
    import shutil

    from fl_server.engine.simulation import checkpoint_meta

    out, kept = tmp_path / "b", tmp_path / "kept"
    _killed_after(small_fed, 4, of=6, out=out, method="FedAvg")
    kept.mkdir()
    for name in ("checkpoint.npz", "checkpoint.json", "best.ckpt.npz"):
        shutil.copy2(out / name, kept / name)
    _killed_after(small_fed, 5, of=6, out=out, method="FedAvg")  # round 5, its checkpoint undone by the kill:
    for name in ("checkpoint.npz", "checkpoint.json", "best.ckpt.npz"):
        (out / name).unlink()  # best.ckpt.npz is a hard link of best.npz: never write through it
        shutil.copy2(kept / name, out / name)
    assert checkpoint_meta(out / "best.npz")["round"] == 4 != checkpoint_meta(out / "checkpoint.npz")["best_round"]
    straight = _sim(small_fed, "FedAvg", "vmap", rounds=4, out=tmp_path / "a").run()
    assert _same_result(straight, _sim(small_fed, "FedAvg", "vmap", rounds=4, out=out).run())


def test_a_run_cut_short_off_the_validation_cadence_validates_its_last_round(small_fed, tmp_path: Path) -> None:
    """Validation every 2 rounds: a 3-round run validates its last round (2) although the 4-round run it is cut
    from did not; a finished 3-round run cannot be extended (that validation is off the longer run's cadence)."""
    _killed_after(small_fed, 3, of=4, out=tmp_path / "b", eval_every=2)
    straight = _sim(small_fed, "TENT", "vmap", rounds=3, out=tmp_path / "a", eval_every=2).run()
    resumed = _sim(small_fed, "TENT", "vmap", rounds=3, out=tmp_path / "b", eval_every=2).run()
    assert _same_result(straight, resumed) and resumed.last["round"] == 2 and resumed.last["val"] is not None
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if r.get("val") is not None] == [1, 2]
    with pytest.raises(ValueError, match="different run"):
        _sim(small_fed, "TENT", "vmap", rounds=4, out=tmp_path / "b", eval_every=2).run()


@pytest.mark.parametrize("legacy", [False, True])
def test_a_run_cut_short_or_extended_resumes_the_other_length(small_fed, tmp_path: Path, legacy: bool) -> None:
    """A 2-round run resumes the checkpoint a 4-round run left after 2 rounds (and a 3-round run goes on from
    it) and ends equal to the uninterrupted run of its own length; ``legacy``: the checkpoint predates
    ``prefix_fingerprint`` and is matched on the totals it could have had."""
    from fl_server.engine.simulation import checkpoint_meta, load_state, save_state

    _killed_after(small_fed, 2, of=4, out=tmp_path / "b")
    ckpt = tmp_path / "b" / "checkpoint.npz"
    if legacy:
        meta = checkpoint_meta(ckpt)
        del meta["prefix_fingerprint"]
        save_state(ckpt, load_state(ckpt), meta)
    for rounds in (2, 3):
        straight = _sim(small_fed, "TENT", "vmap", rounds=rounds, out=tmp_path / f"a{rounds}")
        res_a = straight.run()
        resumed = _sim(small_fed, "TENT", "vmap", rounds=rounds, out=tmp_path / "b")
        res_b = resumed.run()
        assert _max_diff(straight.server_state["params"], resumed.server_state["params"]) == 0.0
        assert _same_result(res_a, res_b)
    # the directory now holds 3 rounds: a 2-round run cannot be cut out of it any more
    with pytest.raises(ValueError, match="different run"):
        _sim(small_fed, "TENT", "vmap", rounds=2, out=tmp_path / "b").run()


def test_resume_refuses_a_different_config(small_fed, tmp_path: Path) -> None:
    _sim(small_fed, "FedAvg", "vmap", rounds=1, out=tmp_path).run()
    with pytest.raises(ValueError, match="different run"):
        _sim(small_fed, "FedAvg", "vmap", rounds=1, out=tmp_path, lr=0.05).run()


def test_validation_clients_choose_the_round(small_fed) -> None:
    """With validation clients, val is the mean over them of the personalised accuracy on all their samples
    (FedAvg: its global model), not the training clients' per-sample validation split."""
    fed = hold_out_validation_clients(small_fed, 3)
    sim = _sim(fed, "FedAvg", "vmap", rounds=1)
    sim.run()
    params = sim.server_state["params"]
    expected = np.mean([sim.accuracy(params, idx) for idx in fed.val_clients])
    per_sample = np.mean([sim.accuracy(params, idx) for idx in fed.val])
    assert sim.evaluate_val(0) == pytest.approx(expected, abs=1e-12)
    assert abs(expected - per_sample) > 1e-3  # the two validations differ, so the test can tell them apart


def test_client_batches_walk_permutations() -> None:
    clients = [np.arange(10), np.arange(100, 103)]
    b = client_batches(clients, iterations=4, batch_size=5, rng=np.random.default_rng(0))
    assert b.shape == (2, 4, 5)
    # client 0: every epoch of 10 samples is a permutation
    assert sorted(b[0, :2].ravel()) == list(range(10)) and sorted(b[0, 2:].ravel()) == list(range(10))
    assert set(b[1].ravel()) == {100, 101, 102}  # fewer samples than a batch: repeats


def test_resolve_mode() -> None:
    from fl_server.engine.simulation import resolve_mode

    cpu, mlp, cnn = torch.device("cpu"), build_model("mlp", (1, 8, 8), 10), build_model("convnet", (1, 8, 8), 10)
    assert resolve_mode("auto", cpu, mlp) == "vmap" and resolve_mode("auto", cpu, cnn) == "loop"
    assert resolve_mode("auto", torch.device("cuda"), cnn) == "vmap" and resolve_mode("loop", cpu, mlp) == "loop"
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        resolve_mode("fast", cpu, mlp)



def test_a_diverged_run_stops_at_the_validation_that_finds_it(small_fed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A learning rate of 1e8 sends FedAvg's weights to NaN/inf in the first round: validation finds them, the run
    stops there (no later round can recover), says so, checkpoints, and a resume trains nothing more."""
    sim = _sim(small_fed, "FedAvg", "vmap", "float32", rounds=6, out=tmp_path, lr=1e8)
    with pytest.warns(RuntimeWarning, match=r"^FedAvg seed 0: the weights are not finite at round 0 \(NaN or inf in "
                                            r"params/[\w.]+ and \d+ more tensors\): training stops here, no later "
                                            r"round can recover them; lower the learning rate"):
        result = sim.run()
    assert (result.diverged_round, result.rounds_done, len(result.history)) == (0, 1, 1)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0] and rows[0]["diverged"].startswith("NaN or inf in params/")
    again = _sim(small_fed, "FedAvg", "vmap", "float32", rounds=6, out=tmp_path, lr=1e8).run()
    assert (again.diverged_round, again.rounds_done, len(again.history)) == (0, 1, 1)


def test_a_diverged_run_leaves_its_stacked_group(small_fed) -> None:  # type: ignore[no-untyped-def]
    """Stepped together, runs that diverge stop as they do alone (here both seeds, at round 0)."""
    from fl_server.engine.stacked import run_stacked

    sims = [_sim(small_fed, "FedAvg", "vmap", "float32", rounds=4, lr=1e8) for _ in range(2)]
    sims[1].cfg.seed = 1
    with pytest.warns(RuntimeWarning, match="not finite at round 0"):
        results = run_stacked(sims)
    assert [(r.diverged_round, r.rounds_done, len(r.history)) for r in results] == [(0, 1, 1), (0, 1, 1)]
