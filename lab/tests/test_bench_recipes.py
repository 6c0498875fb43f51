"""The experiments with their own procedure (fedicon-shift, map-incomplete, upfl-hetero, odpfl-dp, btgfl) build
their engine runs through the recipe layer, and the recipe-built run is the run they built before: the same
fingerprint (their checkpoints resume, their committed results stay current) and the same state after a first
round, on real MNIST / Fashion-MNIST with a few clients. ``legacy`` is how they built a run before recipes."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fl_server.algorithms import build_algorithm
from fl_server.data import load_dataset
from fl_server.data.federated import FederatedData
from fl_server.engine import RunConfig, Simulation
from fl_server.functional import to_numpy_flat
from fl_server.models import build_model

from lab.experiments import get_experiment
from lab.protocol import Protocol
from lab.runner import build_federated


def legacy(protocol: Protocol, method: str, fed: FederatedData, seed: int = 0, model: str | None = None,
           hyper: dict[str, Any] | None = None, local_iterations: int | None = None,
           client_fraction: float | None = None, checkpoint_every: int = 10) -> Simulation:
    """A run as the experiment built it before recipes (``Protocol.run_config`` over ``build_model`` and
    ``build_algorithm``)."""
    net = build_model(model or protocol.model, fed.dataset.x.shape[1:], fed.dataset.num_classes, seed=seed)
    algo = build_algorithm(method, net, fed.num_train_clients, seed=seed,
                           **(protocol.method_hp.get(method, {}) if hyper is None else hyper))
    cfg = RunConfig(rounds=protocol.rounds, local_iterations=local_iterations or protocol.local_iterations,
                    batch_size=protocol.batch_size,
                    client_fraction=protocol.client_fraction if client_fraction is None else client_fraction,
                    eval_every=protocol.eval_every, seed=seed, mode="loop", device="cpu", progress=False,
                    checkpoint_every=checkpoint_every)
    return Simulation(algo, fed, cfg)


def same_first_round(old: Simulation, new: Simulation) -> None:
    assert new.fingerprint == old.fingerprint
    assert new.cfg.identity() == old.cfg.identity() and new.cfg.checkpoint_every == old.cfg.checkpoint_every
    assert new.cfg.test_at_best_only == old.cfg.test_at_best_only
    for sim in (old, new):
        sim.run_round(0)
    a, b = to_numpy_flat(old.server_state), to_numpy_flat(new.server_state)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def tiny(protocol: Protocol, data_root: Path, clients: int = 8, samples: int = 1200) -> FederatedData:
    return build_federated(replace(protocol, num_clients=clients,
                                   options={**protocol.options, "max_samples": samples}), 0, str(data_root))


def test_shift_runs_are_the_runs_before_recipes(data_root: Path) -> None:
    from lab.shift import SHIFT_METHODS, build_shift_simulation, training_hyper

    exp = get_experiment("fedicon-shift")
    feds: dict[tuple[str, str], FederatedData] = {}
    for name, protocol in exp.protocols.items():  # every protocol and method: the fingerprints
        fed = feds.setdefault((protocol.dataset, protocol.split), tiny(protocol, data_root))
        for method in (*exp.methods, *exp.optional_methods):
            train = SHIFT_METHODS[method][0]
            new = build_shift_simulation(protocol, method, 0, None, fed, "cpu", "loop", False, str(data_root))
            old = legacy(protocol, train, fed, hyper=training_hyper(protocol, train))
            assert new.fingerprint == old.fingerprint, (name, method)
    protocol = exp.protocols["mnist"]
    fed = feds[(protocol.dataset, protocol.split)]
    same_first_round(legacy(protocol, "FedICON", fed, hyper=training_hyper(protocol, "FedICON")),
                     build_shift_simulation(protocol, "FedICON", 0, None, fed, "cpu", "loop", False, str(data_root)))


def test_map_incomplete_runs_are_the_runs_before_recipes(data_root: Path) -> None:
    from fl_server.algorithms.map import authors_code_procedure
    from lab.map_incomplete import AUTHORS_CODE_METHODS, MAP_METHODS, build_map_simulation

    def old(protocol: Protocol, method: str, fed: FederatedData) -> Simulation:
        hp = {**MAP_METHODS[method], "local_iterations": protocol.local_iterations,
              "expected_selections": protocol.client_fraction * protocol.rounds, **protocol.method_hp.get(method, {})}
        if method in AUTHORS_CODE_METHODS:
            hp.update(authors_code_procedure(protocol.local_iterations))
        return legacy(protocol, "MAP", fed, hyper=hp, local_iterations=hp["local_iterations"])

    exp = get_experiment("map-incomplete")
    fed = tiny(exp.protocols["fashion_mnist"], data_root, clients=10)
    for name, protocol in exp.protocols.items():
        for method in exp.methods:
            new = build_map_simulation(protocol, method, 0, None, "cpu", "loop", False, str(data_root), fed)
            assert new.fingerprint == old(protocol, method, fed).fingerprint, (name, method)
    protocol = exp.protocols["fashion_mnist"]
    same_first_round(old(protocol, "MAP (code)", fed),
                     build_map_simulation(protocol, "MAP (code)", 0, None, "cpu", "loop", False, str(data_root), fed))


def test_hetero_groups_are_the_runs_before_recipes(data_root: Path) -> None:
    from fl_server.algorithms.fedtta import FedTTA
    from fl_server.algorithms.hetero_fedtta import SIZE_GROUPS
    from lab.hetero import HeteroRun, split_by_size

    protocol = get_experiment("upfl-hetero").protocols["fashion_mnist"]
    protocol = replace(protocol, options={**protocol.options, "public_size": 64})
    fed = tiny(protocol, data_root, clients=24, samples=2400)
    hp = protocol.method_hp.get("HeteroFedTTA", {})
    method = FedTTA.family_member(hp)  # FedTTA++: the protocol's patience (lab/hetero.py names it so)
    assert method == "FedTTA++"
    short = replace(protocol, local_iterations=1)  # the first round of all three sizes, at one local step
    for p in (protocol, short):
        run = HeteroRun(p, fed, 0, 0.1, "cpu", "loop", str(data_root))
        for name, group in split_by_size(fed, 0).items():
            arch, width = SIZE_GROUPS[name]
            old = legacy(p, method, group, model=arch, hyper={**hp, "adapt_width": width})
            assert run.sims[name].cfg.progress is False
            if p is short:
                same_first_round(old, run.sims[name])
            else:
                assert run.sims[name].fingerprint == old.fingerprint, name


def test_odpfl_dp_runs_are_the_runs_before_recipes(data_root: Path) -> None:
    from lab.odpfl import build_dp_simulation

    protocol = get_experiment("odpfl-dp").protocols["fashion_mnist"]
    protocol = replace(protocol, num_clients=6, options={**protocol.options, "pool": 100, "eval_size": 20})
    for method in ("FedAvg", "ODPFL-HN"):
        new, split = build_dp_simulation(protocol, method, 0, None, "cpu", "loop", False, str(data_root))
        old = legacy(protocol, method, split.fed)
        if method == "FedAvg":
            same_first_round(old, new)
        else:  # ODPFL-HN's round is the slow one: its fingerprint and initial state
            assert new.fingerprint == old.fingerprint
            a, b = to_numpy_flat(old.server_state), to_numpy_flat(new.server_state)
            assert all(np.array_equal(a[k], b[k]) for k in a) and sorted(a) == sorted(b)


def test_btgfl_run_is_the_run_before_recipes(data_root: Path) -> None:
    from lab.btgfl import StreamConfig, _body_iterations, build_btfl_simulation, build_data

    exp = get_experiment("btgfl")
    dataset = load_dataset("mnist", root=str(data_root), split="all")
    dataset = dataset.subset(np.arange(0, len(dataset), 50))
    for name, protocol in exp.protocols.items():
        small = replace(protocol, num_clients=4)
        data = build_data(dataset, small, 0, StreamConfig(max_stream=10))
        hyper = {**protocol.method_hp.get("BTFL", {}), "body_iterations": _body_iterations(protocol.local_iterations)}
        old = legacy(protocol, "BTFL", data.fed, hyper=hyper, client_fraction=1.0, checkpoint_every=5)
        new = build_btfl_simulation(protocol, 0, None, data.fed, "cpu", "loop", False, str(data_root))
        if name == "mnist":
            same_first_round(old, new)
        else:
            assert new.fingerprint == old.fingerprint, name


def test_recipe_built_runs_record_their_recipe(data_root: Path, tmp_path: Path) -> None:
    """A run folder of these experiments now holds run.json (method, hyperparameters, model, protocol), so
    ``fl-server export`` can rebuild its model like any recipe run's."""
    from lab.map_incomplete import build_map_simulation
    from fl_server.rundir import read_run

    protocol = replace(get_experiment("map-incomplete").protocols["fashion_mnist"], rounds=1, local_iterations=2,
                       eval_every=1)
    fed = tiny(protocol, data_root, clients=6, samples=600)
    sim = build_map_simulation(protocol, "FedRS", 0, tmp_path / "run", "cpu", "loop", False, str(data_root), fed)
    sim.run()
    run = read_run(tmp_path / "run")
    assert run["method"] == "MAP" and run["model"] == protocol.model
    assert run["hyper"]["alpha"] == 0.9 and run["hyper"]["hpm"] is False  # FedRS = MAP with RS and no HPM
    assert run["protocol"]["dataset"] == "fashion_mnist" and run["input_shape"] == [1, 28, 28]


RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _changed_hyper(record: dict[str, Any], built: Any) -> dict[str, tuple[Any, Any]]:
    """The hyperparameters where a committed record and the run built now differ (a field added after the record
    was written must keep its default, which reproduces the older behaviour)."""
    import dataclasses
    import json

    now = json.loads(json.dumps(dataclasses.asdict(built), default=str))
    fields = {f.name: f for f in dataclasses.fields(built)}
    out = {}
    for key, value in now.items():
        if key in record["hyper"]:
            if record["hyper"][key] != value:
                out[key] = (record["hyper"][key], value)
        elif getattr(built, key) != fields[key].default:
            out[key] = ("(absent)", value)
    return out


def test_committed_results_are_what_the_recipe_built_runs_would_train(data_root: Path) -> None:
    """Every committed raw result of map-incomplete and btgfl recorded the hyperparameters and rounds the
    recipe-built run of its protocol has now: the committed tables stay current (odpfl-dp's and the others'
    hyperparameters are in the fingerprints the tests above compare)."""
    import json

    from lab.btgfl import StreamConfig, build_btfl_simulation, build_data
    from lab.map_incomplete import build_map_simulation
    from lab.runner import raw_path

    checked = 0
    exp = get_experiment("map-incomplete")
    fed = tiny(exp.protocols["fashion_mnist"], data_root, clients=10)
    for name, protocol in exp.protocols.items():
        for method in exp.methods:
            files = sorted(raw_path(RESULTS, exp.name, name, method, 0).parent.glob("seed*.json"))
            if files:
                sim = build_map_simulation(protocol, method, 0, None, "cpu", "loop", False, str(data_root), fed)
            for f in files:
                record = json.loads(f.read_text())
                assert record["rounds"] == protocol.rounds and not _changed_hyper(record, sim.algorithm.hp), f
                checked += 1
    exp = get_experiment("btgfl")
    dataset = load_dataset("mnist", root=str(data_root), split="all")
    data = build_data(dataset.subset(np.arange(0, len(dataset), 50)), replace(exp.protocols["mnist"], num_clients=4),
                      0, StreamConfig(max_stream=10))
    for name, protocol in exp.protocols.items():
        sim = build_btfl_simulation(protocol, 0, None, data.fed, "cpu", "loop", False, str(data_root))
        for f in sorted((RESULTS / "raw" / exp.name / name).glob("*/seed*.json")):
            record = json.loads(f.read_text())
            assert record["rounds"] == protocol.rounds and not _changed_hyper(record, sim.algorithm.hp), f
            checked += 1
    assert checked >= 140  # 87 map-incomplete and 56 btgfl files when this test was written
