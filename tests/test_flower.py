"""Federated training on Flower: a real SuperLink and 3 SuperNodes as processes on loopback, each SuperNode
loading only its own MNIST partition; the final server weights equal the in-process engine's for the same recipe,
seed, clients and batch draws (``batch_stream="per_client"``), and the run exports to a bundle that a torch-free
device personalises."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fl_server import rundir

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install 'fl-edge[flower]')")

from fl_server.engine.simulation import load_state  # noqa: E402
from fl_server.flower.task import FlowerRecipe  # noqa: E402
from fl_server.flower.wire import state_to_record  # noqa: E402
from fl_server.functional import to_numpy_flat  # noqa: E402
from flower_local import LocalDeployment, write_node_data  # noqa: E402  (beside this file)

# 10 clients, 70% new: 3 training clients (one per SuperNode); 6000 random MNIST samples keep the rounds short
RECIPE = {"dataset": "mnist", "num-clients": 10, "new-fraction": 0.7, "max-samples": 6000, "rounds": 3,
          "local-iterations": 10, "dtype": "float64", "seed": 0}


def in_process(config: dict) -> tuple[dict[str, np.ndarray], float]:
    """The engine's final server state and last-round validation for the same recipe (per-client batches)."""
    recipe = FlowerRecipe.from_config(config)
    sim = recipe.in_process()
    for r in range(recipe.rounds):
        sim.run_round(r)
    return to_numpy_flat(sim.server_state), sim.evaluate_val(recipe.rounds - 1)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, data_root: Path):  # type: ignore[no-untyped-def]
    with LocalDeployment(num_nodes=3, workdir=tmp_path_factory.mktemp("flower"),
                         env={"FL_DATA_DIR": str(data_root)}) as dep:
        yield dep


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["FedAvg", "FedTTA"])
def test_flower_deployment_matches_in_process_engine(deployment: LocalDeployment, method: str) -> None:
    run_dir = deployment.workdir / f"run-{method}"
    config = {**RECIPE, "method": method}
    deployment.run({**config, "run-dir": str(run_dir)}, timeout=500)
    flower = to_numpy_flat(load_state(run_dir / "final.npz"))
    engine, engine_val = in_process(config)
    assert sorted(flower) == sorted(engine)
    assert all(flower[k].dtype == np.float64 for k in flower)
    diff = max(float(np.abs(flower[k] - engine[k]).max()) for k in engine)
    assert diff <= 1e-6, f"{method}: Flower and in-process weights differ by {diff}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[-1]["val"] == pytest.approx(engine_val, abs=1e-9)
    run = json.loads((run_dir / "run.json").read_text())
    assert run["method"] == method and run["engine"] == "flower"


def export_to_device(deployment: LocalDeployment, run_dir: Path, name: str, script: str,
                     x: np.ndarray) -> dict[str, Any]:
    """`fl-server export` the run into ``workdir/name``, then run the device ``script`` on it and ``x`` in a fresh
    interpreter; its last output line (JSON), checked to come from a process that never imported torch."""
    bundle, sample = deployment.workdir / name, deployment.workdir / f"{name}-input.npz"
    subprocess.run([sys.executable, "-m", "fl_server.cli", "export", str(run_dir), "--out", str(bundle)],
                   check=True, capture_output=True, timeout=300)
    np.savez(sample, x=x)
    out = subprocess.run([sys.executable, "-c", script, str(bundle), str(sample)], check=True,
                         capture_output=True, text=True, timeout=300)
    device = json.loads(out.stdout.strip().splitlines()[-1])
    assert device.pop("torch") is False
    return device


DEVICE = """
import sys, json
import numpy as np
from edge_sdk import open_bundle
device = open_bundle(sys.argv[1], safeguard=False)  # the step itself, as the server's torch personalisation
x = np.load(sys.argv[2])["x"]
adaptation = device.personalize(x)
print(json.dumps({"torch": "torch" in sys.modules, "steps": adaptation.steps,
                  "pred": device.predict(x).argmax(1).tolist()}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flower_run_exports_and_a_torch_free_device_personalises(deployment: LocalDeployment,
                                                                   mnist_all) -> None:  # type: ignore[no-untyped-def]
    """The Flower run's directory exports like an in-process one; a device without torch personalises the
    bundle (FedTTA's Eq. 5 step on onnxruntime) and predicts what the server's torch personalisation predicts."""
    import torch

    run_dir = deployment.workdir / "run-FedTTA"
    if not (run_dir / "best.npz").exists():
        deployment.run({**RECIPE, "method": "FedTTA", "run-dir": str(run_dir)}, timeout=500)
    # a new client's unlabeled digits (samples the 6000-sample federation never saw: the last 500 of MNIST)
    x = mnist_all.x[-500:].astype(np.float32)
    device = export_to_device(deployment, run_dir, "bundle", DEVICE, x)
    assert json.loads((deployment.workdir / "bundle" / "manifest.json").read_text())["method"] == "FedTTA"
    assert device["steps"] == 1  # FedTTA: one adaptation step (Eq. 5) on the device
    recipe = FlowerRecipe.from_config({**RECIPE, "method": "FedTTA"})
    algorithm = recipe.build_algorithm(3)
    state = {k: {n: v.float() for n, v in d.items()} for k, d in load_state(run_dir / "best.npz").items()}
    server_pred = algorithm.predict(algorithm.personalize(state, torch.from_numpy(x)), torch.from_numpy(x))
    agree = float(np.mean(np.array(device["pred"]) == server_pred.argmax(-1).numpy()))
    assert agree >= 0.99, f"device and server personalisation agree on {agree:.3f} of the samples"


def test_a_built_in_run_is_the_data_sets_preset_recipe_with_the_overrides() -> None:
    """Without a recipe file the run config names a built-in data set and method: its preset recipe
    (fl_server.recipes.presets, UPFL Table 1's protocol and hyperparameters) with the run config's overrides."""
    from fl_server.recipes.presets import builtin_recipe

    recipe = FlowerRecipe.from_config({**RECIPE, "method": "fedtta++"}).recipe
    preset = builtin_recipe("mnist", "FedTTA++")
    assert recipe.method == "FedTTA++" and recipe.hyper == preset.hyper and recipe.model == preset.model == "mlp"
    assert (recipe.rounds, recipe.local_iterations, recipe.federation.num_clients) == (3, 10, 10)
    assert (recipe.federation.new_fraction, recipe.federation.max_samples) == (0.7, 6000)
    with pytest.raises(ValueError, match="no built-in recipe for data set 'cifar'"):
        FlowerRecipe.from_config({"dataset": "cifar"})
    with pytest.raises(ValueError, match=r"unknown run-config key\(s\) experiment"):
        FlowerRecipe.from_config({"experiment": "upfl-table1"})


@pytest.mark.parametrize("method, reason", [
    ("ODPFL-HN", "two-phase training and standardize_init build the server's state from every client's data"),
    ("Local", r"nothing is aggregated \(each client trains only its own model\), so a federated run has no model")])
def test_a_method_that_cannot_train_on_flower_is_refused_with_its_reason(method: str, reason: str) -> None:
    from fl_server.algorithms import NotApplicable
    from fl_server.flower.task import check_supported

    recipe = FlowerRecipe.from_config({**RECIPE, "method": method})
    algorithm = recipe.build_algorithm(3)
    if method == "ODPFL-HN":  # its one-phase training runs on Flower; two-phase is refused
        check_supported(algorithm)
        algorithm = recipe.recipe.replace(hyper={**recipe.recipe.hyper, "two_phase": True, "phase1_rounds": 1}) \
            .build_algorithm(recipe.recipe.build_model(0), 3, 0)
    with pytest.raises(NotApplicable, match=f"^{method} cannot run on Flower: {reason}"):
        check_supported(algorithm)
    for method in ("FedAvg", "MAP", "FedRS", "FedPHP"):  # no refusal (MAP's family: the clients send class sets)
        check_supported(FlowerRecipe.from_config({**RECIPE, "method": method}).build_algorithm(3))


def local_ask(recipe: FlowerRecipe, parts: list, states: list) -> Any:
    """The server's exchange without the transport: each client's reply is the ClientApp's own answer
    (``fl_server.flower.client_app.answer``) on its data, with its context state ``states[client]``; no message
    carries another client's rows of the server state (its per-client entries come in a client's own ``state``,
    the ``client_start`` row, or ``own``, one row each)."""
    from flwr.app import RecordDict

    from fl_server.flower.client_app import answer

    per_client = set(recipe.build_algorithm(len(parts)).per_client_keys)

    def ask(kind: str, payloads: dict) -> dict:
        replies = {}
        for client, msg in payloads.items():
            if "server" in msg:
                keys = {key.split("/")[0] for key in msg["server"]}
                assert not keys & per_client, (kind, keys)
            if "own" in msg:
                assert {key.split("/")[0] for key in msg["own"]} <= per_client
                assert all(msg["own"][key].shape[0] == 1 for key in msg["own"]), kind
            replies[client] = answer(kind, msg, recipe, parts[client], states[client])
            assert isinstance(replies[client], RecordDict)
        return replies
    return ask


def query_replies(recipe: FlowerRecipe, parts: list) -> list[dict[str, Any]]:
    """Each client's answer to the run's first message (``query``, with what the method asks of its data), as the
    server reads it."""
    from flwr.app import RecordDict

    from fl_server.flower.client_app import answer
    from fl_server.flower.server_app import query_config

    return [dict(answer("query", RecordDict({"config": query_config(recipe)}), recipe, d, RecordDict())["info"])
            for d in parts]


def flower_rounds_without_transport(config: dict, rounds: int | None = None) -> tuple[Any, list, list, Any]:
    """The Flower app's two sides (FederatedRun on the server, the ClientApp's answers on each client's own
    partition, the states through the wire format) without the processes: what each method computes over Flower
    in ``rounds`` (default: the recipe's) rounds. Returns the run, the clients' data, their context states and the
    exchange."""
    from flwr.app import RecordDict

    from fl_server.flower.server_app import FederatedRun
    from fl_server.flower.task import load_partition

    recipe = FlowerRecipe.from_config(config)
    parts = [load_partition(recipe, 0)]
    parts += [load_partition(recipe, p) for p in range(1, parts[0].num_partitions)]
    run = FederatedRun(recipe, query_replies(recipe, parts))
    states = [RecordDict() for _ in parts]  # each client's context state (BTFL's local head), never sent
    ask = local_ask(recipe, parts, states)
    for r in range(recipe.rounds if rounds is None else rounds):
        result = run.train_round(ask, np.arange(len(parts)), r)
        assert result.aggregated and result.replied == list(range(len(parts))) and result.loss > 0
    return run, parts, states, ask


METHODS = ["FedProx", "TENT", "FedTTA-Prox", "FedTTA++", "FedICON", "BTFL", "ODPFL-HN"]


@pytest.mark.parametrize("method", METHODS)
def test_each_methods_flower_sides_match_the_engine(method: str, data_root: Path) -> None:
    """FedICON: 2 rounds are 1 encoder round and 1 classifier round (``FedICON.fit_hyper``), both phases compared."""
    config = {**RECIPE, "method": method, "rounds": 2, "local-iterations": 6, "max-samples": 3000}
    run, _, _, ask = flower_rounds_without_transport(config)
    flower = to_numpy_flat(run.server_state)
    engine, engine_val = in_process(config)
    private = set(run.algorithm.client_private.values())  # BTFL's heads: the server's copy is never trained
    assert sorted(flower) == sorted(engine)
    diff = max(float(np.abs(flower[k] - engine[k]).max()) for k in engine if k.split("/")[0] not in private)
    assert diff <= 1e-6, f"{method}: {diff}"
    if method == "ODPFL-HN":  # validated on the models generated from the clients' own embeddings
        assert run.validate(ask, np.arange(run.k), run.recipe.rounds - 1)[0] == pytest.approx(engine_val, abs=1e-9)


def test_btfl_on_flower_keeps_heads_on_clients_and_its_global_dle_equals_the_engines(data_root: Path) -> None:
    """BTFL over Flower: the local heads never reach the server (its copy keeps the initial draw), the clients'
    heads equal the engine's, and the finalize weights built from the clients' uploads (global DLE, clients behind
    it, mean feature) equal the in-process finalize's."""
    import torch

    from fl_server.algorithms.btfl import BTFL
    from fl_server.flower.task import client_btfl_upload

    config = {**RECIPE, "method": "BTFL", "rounds": 2, "local-iterations": 6, "max-samples": 3000}
    from fl_server.flower.wire import record_to_state

    run, parts, states, _ = flower_rounds_without_transport(config)
    kept = [record_to_state(s["fl-edge-private"]) for s in states]
    recipe = FlowerRecipe.from_config(config)
    sim = recipe.in_process()
    initial_heads = sim.server_state["local_heads"].clone()
    for r in range(recipe.rounds):
        sim.run_round(r)
    assert torch.equal(run.server_state["local_heads"], initial_heads)  # nothing of the clients' heads arrived
    for k, own in enumerate(kept):
        assert float((own["local_head"] - sim.server_state["local_heads"][k]).abs().max()) <= 1e-9
    engine = sim.finalize(sim.server_state, recipe.rounds - 1)["btfl"]
    flower = BTFL.finalize_from_uploads([client_btfl_upload(run.algorithm, run.server_state, d, recipe)
                                         for d in parts])["btfl"]
    assert sorted(flower) == sorted(engine) == ["dle_clients", "global_dle", "mu_global"]
    for key in engine:
        np.testing.assert_allclose(flower[key], engine[key], atol=1e-12, err_msg=key)


@pytest.mark.parametrize("method", ["MAP", "FedRS", "FedPHP"])
def test_class_set_methods_train_on_flower_like_the_engine(method: str, data_root: Path) -> None:
    """MAP / FedRS / FedPHP over Flower: each client's query reply carries its class set (which classes its
    training split holds, nothing else of its data), the server builds the method's state from them, and 2
    rounds of 20 local steps (MAP's two stages; the HPM's distillation from the second round) end with the
    engine's weights, HPMs, selection counts and class sets. A client's validation, sent only its own rows of
    the per-client state, scores what the server's whole state with that client's batches scores."""
    from fl_server.flower.task import client_validation, validation_metrics

    config = {**RECIPE, "method": method, "rounds": 2, "local-iterations": 20, "max-samples": 3000}
    run, parts, _, ask = flower_rounds_without_transport(config)
    flower = to_numpy_flat(run.server_state)
    engine, _ = in_process(config)
    assert sorted(flower) == sorted(engine)
    diff = max(float(np.abs(flower[k] - engine[k]).max()) for k in engine)
    assert diff <= 1e-6, f"{method}: {diff}"
    observed = run.server_state["observed"].numpy()
    for k, data in enumerate(parts):  # the pathological partition: each client holds 2 of the 10 digits
        assert np.flatnonzero(observed[k]).tolist() == sorted(set(data.y_train.tolist())) and observed[k].sum() == 2
    assert run.server_state["count"].tolist() == [2.0 * run.algorithm.hp.hpm] * 3  # FedRS keeps no HPM
    accuracy, _ = run.validate(ask, np.arange(run.k), 1)
    whole = np.mean([validation_metrics(client_validation(run.algorithm, run.server_state, d, run.recipe, 1),
                                        d)["accuracy"] for d in parts])
    assert accuracy == pytest.approx(whole, abs=1e-12) and accuracy > 0.5


SIMULATION = """
import json, sys
from flwr.simulation import run_simulation
from fl_server.flower.client_app import make_client_app
from fl_server.flower.server_app import make_server_app
cfg = json.loads(sys.argv[1])
run_simulation(make_server_app(cfg), make_client_app(cfg), num_supernodes=3,
               backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}})
"""


@pytest.mark.timeout(300)
def test_map_on_flowers_simulation_engine_ends_with_the_engines_weights(tmp_path: Path, data_root: Path) -> None:
    """MAP on Flower's simulation engine (Ray; the ServerApp and the ClientApps exchange Flower messages, the
    class sets come in the nodes' query replies, validation sends each client its own rows): a round ends with the
    in-process engine's weights, HPMs and class sets (the two stages and the distillation over rounds: the test
    above), and the run validates on the clients."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs Ray (pip install 'flwr[simulation]')")
    config = {**RECIPE, "method": "MAP", "rounds": 1, "max-samples": 3000}
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", SIMULATION, json.dumps({**config, "run-dir": str(run_dir),
                                                                        "min-nodes": 3})],
                         capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert (run_dir / "final.npz").exists(), out.stderr[-3000:]
    flower = to_numpy_flat(load_state(run_dir / "final.npz"))
    engine, _ = in_process(config)
    assert sorted(flower) == sorted(engine) and "observed" in {k.split("/")[0] for k in flower}
    diff = max(float(np.abs(flower[k] - engine[k]).max()) for k in engine)
    assert diff <= 1e-6, diff
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["clients"]) for r in rows] == [(0, 3)] and rows[-1]["val"] > 0.5


def test_a_nodes_class_set_reply_is_checked(data_root: Path) -> None:
    """The query asks a node for its class set only when the method declares it needs it (FedAvg's reply has
    none); a missing or malformed one (not integer labels, empty, repeated, out of range) is refused with one
    line naming the node; the node refuses to compute a fact it does not know."""
    from flwr.app import ConfigRecord, RecordDict

    from fl_server.flower.client_app import answer
    from fl_server.flower.server_app import FederatedRun, FlowerError
    from fl_server.flower.task import load_partition

    config = {**RECIPE, "method": "FedRS", "rounds": 1, "max-samples": 3000}
    recipe = FlowerRecipe.from_config(config)
    parts = [load_partition(recipe, p) for p in range(3)]
    infos = query_replies(recipe, parts)
    assert [i["class_set"] for i in infos] == [[0, 4], [3, 5], [0, 2]]
    assert "class_set" not in query_replies(FlowerRecipe.from_config({**config, "method": "FedAvg"}), parts)[0]
    FederatedRun(recipe, infos, [7, 8, 9])
    no_set = {k: v for k, v in infos[1].items() if k != "class_set"}
    with pytest.raises(FlowerError, match=r"^query: node 8 \(client 1\) sent no class_set, which FedRS needs; run "):
        FederatedRun(recipe, [infos[0], no_set, infos[2]], [7, 8, 9])
    for bad, why in [("0,4", "expected a list of integer labels, got '0,4'"),
                     ([0.0, 4.0], r"expected a list of integer labels, got \[0.0, 4.0\]"),
                     ([True], "expected a list of integer labels"),
                     ([], "empty: a training client holds at least one class"),
                     ([4, 4], r"repeats a label: \[4, 4\]"),
                     ([3, 10], r"labels \[3, 10\] outside 0 .. 9")]:
        with pytest.raises(FlowerError, match=rf"^query: node 8 \(client 1\) sent a malformed class_set: {why}"):
            FederatedRun(recipe, [infos[0], {**infos[1], "class_set": bad}, infos[2]], [7, 8, 9])
    with pytest.raises(ValueError, match=r"^query: unknown client fact\(s\) histogram; this node computes class_set"):
        answer("query", RecordDict({"config": ConfigRecord({"facts": ["histogram"]})}), recipe, parts[0], RecordDict())


BN_DEVICE = """
import sys, json
import numpy as np
from edge_sdk import open_bundle
device = open_bundle(sys.argv[1], safeguard=False)  # the step itself, as the server's torch personalisation
x = np.load(sys.argv[2])["x"]
print(json.dumps({"torch": "torch" in sys.modules, "whole": device.predict(x).tolist(),
                  "one_at_a_time": [row.tolist() for row in device.stream(x[:40])]}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_btfl_on_a_bn_model_over_the_deployment_finalizes_and_exports(deployment: LocalDeployment,
                                                                      mnist_all) -> None:  # type: ignore[no-untyped-def]
    """BTFL on a batch-normalised CNN on the real SuperLink + SuperNodes: the finalize step's device.npz (the
    population statistics summed from the clients' uploads, then the global DLE and mean feature the clients
    computed with them) equals the in-process finalize of the same best weights on the same clients, and the
    exported bundle's torch-free device predicts what torch predicts with those statistics, one sample at a time
    as on the whole client."""
    import torch

    from fl_server.models.norm import norm_mode, set_statistics

    run_dir = deployment.workdir / "run-BTFL-bn"
    config = {**RECIPE, "method": "BTFL", "rounds": 1, "model": "btfl_cnn_bn"}
    deployment.run({**config, "run-dir": str(run_dir)}, timeout=500)
    recipe = FlowerRecipe.from_config(config)
    sim = recipe.in_process()
    best = load_state(run_dir / "best.npz")
    engine = sim.finalize(best, 0)  # the engine's finalize (population statistics, then BTFL's) of those weights
    served = rundir.read_device(run_dir)
    assert sorted(served) == sorted(engine) == ["btfl", "stats"]
    assert sorted(served["stats"]) == sorted(engine["stats"]) and len(engine["stats"]) == 4  # two BN layers
    for key, value in engine["stats"].items():
        np.testing.assert_allclose(served["stats"][key], value, atol=1e-5, err_msg=key)
    for key, value in engine["btfl"].items():
        np.testing.assert_allclose(served["btfl"][key], value, atol=1e-12, err_msg=key)
    assert int(served["btfl"]["dle_clients"][0]) == 3

    x = mnist_all.x[-300:].astype(np.float32)  # a new client's digits, never in the 6000-sample federation
    device = export_to_device(deployment, run_dir, "bundle-btfl-bn", BN_DEVICE, x)
    algorithm = recipe.build_algorithm(3)
    params = {n: v.float() for n, v in best["params"].items()}
    set_statistics(algorithm.model, served["stats"])
    with norm_mode(algorithm.model, "population"), torch.no_grad():
        reference = torch.log_softmax(algorithm.predict(params, torch.from_numpy(x)), -1).numpy()
    whole = np.array(device["whole"])
    np.testing.assert_allclose(whole, reference, atol=1e-3)
    assert np.array_equal(whole.argmax(1), reference.argmax(1))
    np.testing.assert_allclose(np.array(device["one_at_a_time"]), whole[:40], atol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flower_benchmark_runs_at_smoke_size(tmp_path: Path, data_root: Path) -> None:
    """benchmarks/flower.py (docs/benchmarks/flower.json) at its smoke size: every path runs and is timed."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs Ray (pip install 'flwr[simulation]')")
    out = tmp_path / "flower.json"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "benchmarks" / "flower.py"), "--smoke", "--out", str(out),
                    "--data-dir", str(data_root)], check=True, capture_output=True, timeout=850, cwd=tmp_path)
    result = json.loads(out.read_text())
    for path in ("in_process_vmap", "in_process_loop", "flower_deployment", "flower_simulation",
                 "flower_simulation_many"):
        assert result[path]["median_s_per_round"] > 0, path
    assert result["flower_simulation_many"]["clients"] == 20


USER_RECIPE = '''
import os
import numpy as np
from torch import nn
from fl_server.data import load_dataset
from fl_server.recipes import DataSpec, Federation, ModelSpec, Recipe


class TinyNet(nn.Module):
    """A user's own CNN, its linear head at ``fc``."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(input_shape[0], 4, 3, stride=2), nn.GroupNorm(2, 4), nn.ReLU(),
                                  nn.Flatten(), nn.Linear(4 * 13 * 13, 16), nn.ReLU())
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.fc(self.body(x))


fashion = load_dataset("fashion_mnist", root=os.environ["FL_DATA_DIR"], split="test")
idx = np.random.default_rng(0).choice(len(fashion), 600, replace=False)
x = np.round(fashion.x[idx] * 255).astype(np.uint8).transpose(0, 2, 3, 1)  # raw NHWC images
RECIPE = Recipe(model=ModelSpec(TinyNet, head="fc"), data=DataSpec.from_arrays(x, fashion.y[idx], layout="NHWC"),
                federation=Federation(partition="iid", num_clients=3, new_fraction=0.0), method="FedTTA",
                rounds=2, local_iterations=3, batch_size=16, hyper={"inner_lr": 0.05, "lr": 0.1, "adapt_lr": 0.001})
'''


def test_a_users_recipe_file_trains_on_flower_like_in_process(tmp_path: Path, data_root: Path) -> None:
    """Any recipe (here a user's nn.Module on raw uint8 arrays, loaded from its file on every side) trains through
    the Flower app's two sides to the in-process engine's weights."""
    source = tmp_path / "my_recipe.py"
    source.write_text(USER_RECIPE)
    config = {"recipe": f"{source}:RECIPE", "dtype": "float64", "seed": 0}
    recipe = FlowerRecipe.from_config(config)
    assert recipe.recipe.source == f"{source}:RECIPE" and recipe.method == "FedTTA" and recipe.rounds == 2
    run, parts, _, _ = flower_rounds_without_transport(config)
    assert len(parts) == 3 and parts[0].x_train.dtype == np.float32  # preprocessed by the recipe on the client
    flower = to_numpy_flat(run.server_state)
    engine, _ = in_process(config)
    assert sorted(flower) == sorted(engine)
    diff = max(float(np.abs(flower[k] - engine[k]).max()) for k in engine)
    assert diff <= 1e-6, diff


# ---------------------------------------------------------------------- recipe + run-config overrides
def test_run_config_overrides_apply_over_a_recipe_file_and_clashing_keys_are_refused(tmp_path: Path) -> None:
    """``rounds`` and the other recipe keys set in the run config apply over a recipe file as over a preset ("":
    the recipe's own); ``dataset``, ``method`` or ``model`` beside a recipe file are refused with one line."""
    from fl_server.recipes import RecipeError
    from fl_server.recipes.presets import builtin_recipe

    source = tmp_path / "mine.py"
    source.write_text("from fl_server.recipes.presets import builtin_recipe\n"
                      "RECIPE = builtin_recipe('digits', 'FedTTA', rounds=7, num_clients=20)\n")
    unset = {key: "" for key in ("rounds", "local-iterations", "num-clients", "dataset", "method", "model")}
    own = FlowerRecipe.from_config({**unset, "recipe": f"{source}:RECIPE"}).recipe
    assert (own.rounds, own.local_iterations, own.federation.num_clients, own.method) == (7, 20, 20, "FedTTA")
    changed = FlowerRecipe.from_config({**unset, "recipe": f"{source}:RECIPE", "rounds": 2, "num-clients": 4,
                                        "val-fraction": 0.25}).recipe
    assert (changed.rounds, changed.federation.num_clients, changed.federation.val_fraction) == (2, 4, 0.25)
    assert changed.method == "FedTTA" and changed.hyper == own.hyper and changed.source == own.source
    assert FlowerRecipe.from_config({**unset, "dataset": "digits"}).recipe.rounds == builtin_recipe("digits").rounds
    with pytest.raises(RecipeError, match=r"^run config: method='TENT' beside recipe=.*sets its own method; drop"):
        FlowerRecipe.from_config({**unset, "recipe": f"{source}:RECIPE", "method": "TENT"})
    with pytest.raises(RecipeError, match=r"rounds must be an integer >= 1, got 0"):
        FlowerRecipe.from_config({"recipe": f"{source}:RECIPE", "rounds": 0})


# ---------------------------------------------------------------------- node-local data
FASHION = {"dataset": "fashion_mnist", "model": "mlp", "method": "FedAvg", "seed": 0}


def test_node_data_is_checked_at_load_and_split_on_the_node(tmp_path: Path,
                                                            fashion_all) -> None:  # type: ignore[no-untyped-def]
    """A node's own image folder or arrays file: preprocessed as the recipe's data, split with the run's seed;
    a wrong shape, labels out of range or no labels (a new client) refused with one line."""
    import os

    from fl_server.flower.task import load_node_data
    from fl_server.recipes import RecipeError

    recipe = FlowerRecipe.from_config(FASHION)
    (folder, arrays, _), idx = write_node_data(fashion_all, tmp_path, per_node=60)
    images, stored = load_node_data(recipe, tmp_path / folder), load_node_data(recipe, tmp_path / arrays)
    for data in (images, stored):
        assert data.local and data.input_shape == (1, 28, 28) and data.x_train.dtype == np.float32
        assert (len(data.y_train), len(data.y_val)) == (51, 9)  # the recipe's val_fraction 0.15 of 60
    with np.load(tmp_path / arrays) as f:  # the arrays come back as they were, split by the run's seed
        x, y = f["x"], f["y"]
    again = load_node_data(recipe, tmp_path / arrays)
    np.testing.assert_array_equal(again.x_val, stored.x_val)
    assert sorted(np.concatenate([stored.y_train, stored.y_val]).tolist()) == sorted(y.tolist())
    other = load_node_data(FlowerRecipe.from_config({**FASHION, "seed": 1}), tmp_path / arrays)
    assert not np.array_equal(other.y_val, stored.y_val) or not np.array_equal(other.x_val, stored.x_val)
    # the PNGs' samples are the node's Fashion-MNIST images (to uint8 rounding), their folders its labels
    got = np.concatenate([images.x_train, images.x_val]).reshape(60, -1)
    labels = np.concatenate([images.y_train, images.y_val])
    order, want = np.argsort(got.sum(1)), np.argsort(fashion_all.x[idx[0]].reshape(60, -1).sum(1))
    np.testing.assert_allclose(got[order], fashion_all.x[idx[0]].reshape(60, -1)[want], atol=0.5 / 255 + 1e-6)
    np.testing.assert_array_equal(labels[order], fashion_all.y[idx[0]][want])
    placed = stored.placed({"client-id": 2, "num-clients": 3})
    assert (placed.partition_id, placed.num_partitions) == (2, 3)

    def refused(name: str, pattern: str, **arrays: np.ndarray) -> None:
        np.savez(tmp_path / name, **arrays)
        with pytest.raises(RecipeError, match=pattern):
            load_node_data(recipe, tmp_path / name)

    refused("new.npz", r"^node data \S*new\.npz: no labels \(array 'y'\); a node without labels is a new client .* "
                       r"cannot train$", x=x)  # said once, not wrapped as "unreadable arrays"
    refused("big.npz", r"labels in \[\d, 10\], the recipe has 10 classes \(0 .. 9\)", x=x, y=np.where(y == 0, 10, y))
    refused("hwc.npz", r"expected raw images \[N, 1, 28, 28\]", x=x.transpose(0, 2, 3, 1), y=y)
    refused("raw.npz", r"expects raw pixels in \[0, 1\] \(float32\)", x=x * 255, y=y)
    refused("text.npz", r"labels must be integers, one per image \(60\)", x=x, y=y.astype(np.float32))
    unlabeled = tmp_path / "phone"
    unlabeled.mkdir()
    for png in sorted((tmp_path / folder).glob("*/*.png"))[:3]:
        os.link(png, unlabeled / png.name)
    with pytest.raises(RecipeError, match=r"images without class subfolders have no labels; .* cannot train"):
        load_node_data(recipe, unlabeled)
    (tmp_path / folder / "boots").mkdir()
    (unlabeled / sorted(os.listdir(unlabeled))[0]).rename(tmp_path / folder / "boots" / "a.png")
    with pytest.raises(RecipeError, match=r"class folder\(s\) boots are not the recipe's classes"):
        load_node_data(recipe, tmp_path / folder)
    with pytest.raises(RecipeError, match=r"node data nowhere.npz \(/.*nowhere.npz\): no such image folder"):
        load_node_data(recipe, "nowhere.npz")


def test_nodes_holding_their_own_data_are_numbered_and_a_mix_or_partitioning_keys_are_refused() -> None:
    from fl_server.flower.server_app import FlowerError, clients_of

    local = {"partition-id": -1, "num-partitions": 0}
    assert clients_of({}, {9: local, 4: local})[0] == {0: 4, 1: 9}  # clients numbered by node id
    with pytest.raises(FlowerError, match=r"^1 SuperNodes hold their own data .*, 1 a partition"):
        clients_of({}, {9: local, 4: {"partition-id": 0, "num-partitions": 2}})
    with pytest.raises(FlowerError, match=r"^run config num-clients, max-samples: these split a shared data set"):
        clients_of({"num-clients": 10, "new-fraction": "", "max-samples": 600}, {9: local, 4: local})


NODE_RUN = {**FASHION, "rounds": 1, "local-iterations": 10, "batch-size": 32, "dtype": "float64"}


def node_rounds_without_transport(config: dict, sources: list[Path]) -> dict[str, np.ndarray]:
    """The Flower app's two sides on node-local data, client i holding ``sources[i]``: the final server state."""
    from fl_server.flower.server_app import FederatedRun
    from fl_server.flower.task import client_round, load_node_data
    from fl_server.flower.wire import record_to_state

    recipe = FlowerRecipe.from_config(config)
    data = [load_node_data(recipe, s) for s in sources]
    run = FederatedRun(recipe, [{"input-shape": list(d.input_shape), "num-train": len(d.y_train)} for d in data])
    client = recipe.build_algorithm(len(data))
    for r in range(recipe.rounds):
        ids = np.arange(len(data))
        states = [client_round(client, record_to_state(msg["state"]), record_to_state(msg["server"]),
                               data[k].placed(msg["config"]), recipe, r, None)[0]
                  for k, msg in zip(ids, run.train_payloads(ids, r))]
        run.aggregate(ids, states)
    return to_numpy_flat(run.server_state)


@pytest.mark.timeout(300)
def test_supernodes_train_on_the_data_each_holds(tmp_path: Path, fashion_all) -> None:  # type: ignore[no-untyped-def]
    """Three SuperNodes, each given only its own Fashion-MNIST samples (an image folder or an arrays file, paths
    relative to the SuperNode's working directory), no partition-id and no data set anywhere else: one FedAvg
    round trains to the weights the app's two sides compute on the same node data (the nodes numbered by their
    random node ids: one order of the three matches), validated on the nodes' own splits; the relative run-dir
    lands in the SuperLink's directory."""
    import itertools

    sources, _ = write_node_data(fashion_all, tmp_path)
    with LocalDeployment(num_nodes=3, workdir=tmp_path, env={"FL_DATA_DIR": str(tmp_path / "no-data-here")},
                         node_configs=[f"data='{s}'" for s in sources]) as dep:
        dep.run({**NODE_RUN, "run-dir": "run-local"}, timeout=240)
    run_dir = tmp_path / "run-local"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0] and rows[0]["val"] > 0.2  # chance: 0.1
    assert json.loads((run_dir / "run.json").read_text())["engine"] == "flower"
    flower = to_numpy_flat(load_state(run_dir / "final.npz"))
    diffs = []
    for order in itertools.permutations(sources):
        engine = node_rounds_without_transport(NODE_RUN, [tmp_path / s for s in order])
        diffs.append(max(float(np.abs(flower[k] - engine[k]).max()) for k in engine))
    assert min(diffs) <= 1e-9 < max(diffs), diffs


# ---------------------------------------------------------------------- TLS + SuperNode authentication
def write_pki(root: Path, nodes: int) -> None:
    """A CA (``ca.crt``), the SuperLink's certificate for 127.0.0.1 signed by it (``server.pem``, ``server.key``)
    and ``nodes`` SuperNode key pairs (``node{i}``, OpenSSH private key; ``node{i}.pub``), P-384 throughout."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
             ext: x509.ExtensionType) -> x509.Certificate:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(ext, critical=False).sign(signer, hashes.SHA256()))

    pem = serialization.Encoding.PEM
    ca_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca = cert("fl-edge test CA", ca_key, name("fl-edge test CA"), ca_key, x509.BasicConstraints(ca=True, path_length=0))
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    (root / "ca.crt").write_bytes(ca.public_bytes(pem))
    (root / "server.pem").write_bytes(cert("127.0.0.1", key, ca.subject, ca_key, san).public_bytes(pem))
    (root / "server.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    for i in range(nodes):
        node = ec.generate_private_key(ec.SECP384R1())
        (root / f"node{i}").write_bytes(node.private_bytes(pem, serialization.PrivateFormat.OpenSSH,
                                                           serialization.NoEncryption()))
        (root / f"node{i}.pub").write_bytes(node.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                           serialization.PublicFormat.OpenSSH))


@pytest.mark.timeout(300)
def test_tls_and_supernode_authentication(tmp_path: Path, fashion_all) -> None:  # type: ignore[no-untyped-def]
    """The production setup of the README: a SuperLink with TLS (a CA generated here) and
    --enable-supernode-auth, two SuperNode public keys registered with ``flwr supernode register``; the two
    nodes train a round over TLS, and a SuperNode with an unregistered key is refused (exits without joining)."""
    pytest.importorskip("cryptography", reason="generating the test CA needs the cryptography package")
    pki = tmp_path / "pki"
    pki.mkdir()
    write_pki(pki, 3)
    sources, _ = write_node_data(fashion_all, tmp_path, nodes=2, per_node=60)
    ca = str(pki / "ca.crt")
    dep = LocalDeployment(num_nodes=2, workdir=tmp_path, node_configs=[f"data='{s}'" for s in sources],
                          link_args=["--ssl-ca-certfile", ca, "--ssl-certfile", str(pki / "server.pem"),
                                     "--ssl-keyfile", str(pki / "server.key"), "--enable-supernode-auth"],
                          node_args=[["--root-certificates", ca, "--auth-supernode-private-key",
                                      str(pki / f"node{i}")] for i in range(3)],
                          connection={"root-certificates": ca})
    flwr = str(Path(sys.executable).parent / "flwr")
    try:
        dep.start_link()
        for i in range(2):
            subprocess.run([flwr, "supernode", "register", str(pki / f"node{i}.pub"), "local-deployment"],
                           env=dep.env, cwd=tmp_path, check=True, capture_output=True, timeout=60)
        # spawned, not started: refused, it may exit before it ever listens (no port to wait for)
        stranger, _ = dep.spawn_node(dep.node_args[2], f"data='{sources[0]}'", "unregistered")
        assert stranger.wait(timeout=60) != 0
        assert "Failed to activate SuperNode" in (tmp_path / "unregistered.log").read_text()
        for i in range(2):
            dep.start_node(dep.node_args[i], dep.node_configs[i], f"supernode-{i}")
        listed = subprocess.run([flwr, "supernode", "list", "local-deployment", "--format", "json"], env=dep.env,
                                cwd=tmp_path, check=True, capture_output=True, text=True, timeout=60).stdout
        dep.run({**NODE_RUN, "local-iterations": 3, "min-nodes": 2, "run-dir": "run-tls"}, timeout=200)
    finally:
        dep.stop()
    assert len(json.loads(listed[listed.index("{"):])["nodes"]) == 2, listed
    rows = [json.loads(line) for line in (tmp_path / "run-tls" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0] and 0.0 <= rows[0]["val"] <= 1.0


@pytest.mark.parametrize("method, lost_at", [("FedAvg", "train"), ("ODPFL-HN", "train"),
                                             ("ODPFL-HN", "query.embed")])
def test_a_round_aggregates_the_replies_that_came(method: str, lost_at: str, data_root: Path) -> None:
    """A client whose reply never comes (its node died): the round equals the round of the clients that replied,
    weighted by their sizes only; with fewer replies than the minimum the server state stays as it was."""
    config = {**RECIPE, "method": method, "rounds": 1, "local-iterations": 4, "max-samples": 3000}
    run, _, _, ask = flower_rounds_without_transport(config, rounds=0)
    both, _, _, _ = flower_rounds_without_transport(config, rounds=0)

    def lossy(kind: str, payloads: dict) -> dict:
        replies = ask(kind, payloads)
        return {c: r for c, r in replies.items() if not (kind == lost_at and c == 1)}

    before = run.server_state
    skipped = run.train_round(lossy, np.arange(3), 0, min_replies=3)
    assert not skipped.aggregated and skipped.replied == ([0, 2] if lost_at == "train" else [])
    assert run.server_state is before
    result = run.train_round(lossy, np.arange(3), 0)
    assert result.aggregated and result.replied == [0, 2] and result.asked == 3
    assert both.train_round(ask, np.array([0, 2]), 0).replied == [0, 2]
    trained, start = to_numpy_flat(run.server_state), to_numpy_flat(before)
    for key, value in to_numpy_flat(both.server_state).items():
        np.testing.assert_allclose(trained[key], value, atol=1e-12, err_msg=key)
    assert any(not np.array_equal(trained[k], start[k]) for k in start)


def test_a_nodes_data_is_prepared_once_and_read_back_from_its_disk_cache(tmp_path: Path,
                                                                        fashion_all) -> None:  # type: ignore[no-untyped-def]
    """A SuperNode's data is checked, preprocessed and split on the run's first message and kept on its disk
    (Flower starts a fresh ClientApp process per message): later messages read the same arrays back; changed data
    or a changed recipe prepares it anew; a damaged cache file is rebuilt."""
    import os

    from fl_server.flower.task import cached_node_data, data_key, load_node_data

    cache = tmp_path / "cache"
    np.savez(tmp_path / "node.npz", x=fashion_all.x[:60], y=fashion_all.y[:60])
    recipe = FlowerRecipe.from_config({"dataset": "fashion_mnist", "method": "FedAvg"})
    first = cached_node_data(recipe, str(tmp_path / "node.npz"), None, cache=cache)
    (path,) = cache.glob("*.npz")
    again = cached_node_data(recipe, str(tmp_path / "node.npz"), None, cache=cache)
    direct = load_node_data(recipe, tmp_path / "node.npz")
    for k in ("x_train", "y_train", "x_val", "y_val"):
        assert np.array_equal(getattr(again, k), getattr(direct, k)) and np.array_equal(getattr(first, k),
                                                                                       getattr(direct, k))
    assert again.local and again.partition_id == -1 and again.num_classes == 10
    os.utime(path, (0, 0))  # read back, not written again
    cached_node_data(recipe, str(tmp_path / "node.npz"), None, cache=cache)
    assert path.stat().st_mtime == 0
    np.savez(tmp_path / "node.npz", x=fashion_all.x[60:100], y=fashion_all.y[60:100])  # the node's data changed
    assert len(cached_node_data(recipe, str(tmp_path / "node.npz"), None, cache=cache).y_train) < len(first.y_train)
    other = FlowerRecipe.from_config({"dataset": "fashion_mnist", "method": "FedAvg", "val-fraction": 0.5})
    assert len(cached_node_data(other, str(tmp_path / "node.npz"), None, cache=cache).y_val) == 20
    assert len(list(cache.glob("*.npz"))) == 3
    (cache / f"{data_key(recipe, str(tmp_path / 'node.npz'), None, None)}.npz").write_bytes(b"not an npz")
    assert np.array_equal(cached_node_data(recipe, str(tmp_path / "node.npz"), None, cache=cache).y_val,
                          load_node_data(recipe, tmp_path / "node.npz").y_val)


@pytest.mark.parametrize("method", ["FedAvg", "TENT"])
def test_a_batch_normalised_models_validation_on_flower_is_what_its_device_gets(method: str, data_root: Path) -> None:
    """A batch-normalised model's validation on Flower equals the engine's, and both score the model as its
    bundle's device runs it: with the population statistics of the clients' training data (the finalize step's),
    so that a validation sample's prediction is the same alone as in its client's batch. Before, each Flower client
    normalised its validation batch by that batch's own statistics, and the best round was chosen on those."""
    config = {**RECIPE, "method": method, "model": "btfl_cnn_bn", "rounds": 1, "local-iterations": 20,
              "max-samples": 1500}
    run, _, _, ask = flower_rounds_without_transport(config)
    sim = FlowerRecipe.from_config(config).in_process()
    sim.run_round(0)
    engine_val = sim.evaluate_val(0)
    assert run.validate(ask, np.arange(run.k), 0)[0] == pytest.approx(engine_val, abs=1e-9)
    if method == "FedAvg":  # the shared model, as a device runs it: a client's batch, and samples one at a time
        import torch

        params = sim.server_state["params"]
        with sim.device_semantics(sim.server_state):
            per_client = [sim.accuracy(params, idx) for idx in sim.fed.val]
            idx = np.concatenate(sim.fed.val)[:40]
            alone = torch.cat([sim._logits(params, idx[i:i + 1]) for i in range(len(idx))]).argmax(-1)
            assert torch.equal(alone, sim._logits(params, idx).argmax(-1))
        assert engine_val == pytest.approx(float(np.mean(per_client)), abs=1e-9)


def test_a_flower_run_whose_validation_predictions_collapse_says_so(data_root: Path) -> None:
    """A Flower run holds no new clients, so its clients' validation replies carry what the collapse check reads:
    each client's most predicted class and that class's share of its predictions and of its labels (not the
    histograms, which would tell the label mix). A model whose head sends every sample to one class is named in
    the run's warning line, as a run in one process names its new clients'; a working model's pooled counts, or
    data where one class is most of every client's, warn of nothing; replies of older nodes, without the counts,
    leave the chance check."""
    from fl_server.flower.server_app import top_class_counts, validation_warning

    run, _, _, ask = flower_rounds_without_transport({**RECIPE, "method": "FedAvg", "rounds": 1, "partition": "iid",
                                                      "local-iterations": 40})
    accuracy, counts = run.validate(ask, np.arange(run.k), 0)
    assert counts is not None and counts.predicted.sum() > 0 and validation_warning(run, accuracy, counts) is None
    bias = next(k for k, v in reversed(list(run.server_state["params"].items())) if v.shape == (10,))
    run.server_state["params"][bias][3] += 1e4  # every sample to class 3
    accuracy, counts = run.validate(ask, np.arange(run.k), 0)
    assert int(counts.predicted.argmax()) == 3 and counts.predicted[3] == pytest.approx(counts.predicted.sum())
    assert counts.labels[3] < 0.2 * counts.labels.sum()  # iid: class 3 is about a tenth of the labels
    skewed = top_class_counts([{"accuracy": 0.95, "num-examples": 100, "top-class": 3, "top-share": 0.97,
                                "top-label-share": 0.95}] * 3, 10)  # one class is 95% of every client's data
    assert validation_warning(run, 0.95, skewed) is None
    older = top_class_counts([{"accuracy": accuracy, "num-examples": 100}], 10)
    assert older is None and validation_warning(run, 0.12, older).startswith("warning: validation accuracy 12.0% is at "
                                                                              "chance (10.0% for 10 classes)")
    assert validation_warning(run, accuracy, counts) == (
        f"warning: validation predictions collapsed to one class (class 3 takes 100% of them; accuracy "
        f"{100 * accuracy:.1f}%, chance 10.0%): the model learnt no classifier; lower the learning rate or check the "
        f"labels, and do not ship this bundle")


def test_a_nodes_error_reads_as_one_line() -> None:
    """Flower reports a ClientApp's exception as ``<class 'pkg.Name'>:<'message'>``; the run's line reads
    ``Name: message`` (a node with NCHW arrays, as a new user's audit saw it)."""
    from fl_server.flower.server_app import error_reason

    reason = ("<class 'fl_server.recipes.errors.RecipeError'>:<'node data /data/nchw.npz: expected raw images [N, 28, "
              "28, 1] (uint8, layout NHWC), got [200, 1, 28, 28]: pass images of that size and channels'>")
    assert error_reason(reason) == ("RecipeError: node data /data/nchw.npz: expected raw images [N, 28, 28, 1] (uint8, "
                                    "layout NHWC), got [200, 1, 28, 28]: pass images of that size and channels")
    assert error_reason("<class 'ValueError'>:<\"it's\n two lines\">") == "ValueError: it's two lines"
    assert error_reason("Node unavailable") == "Node unavailable"
