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
from flower_local import LocalDeployment  # noqa: E402  (beside this file)

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
device = open_bundle(sys.argv[1])
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
    ("MAP", "its server state is built from every client's class set"),
    ("FedPHP", "its server state is built from every client's class set"),
    ("ODPFL-HN", "the server embeds each client's data"), ("Local", "its per-client models live in the server")])
def test_a_method_whose_server_needs_client_data_is_refused_with_its_reason(method: str, reason: str) -> None:
    from fl_server.algorithms import NotApplicable
    from fl_server.flower.task import check_supported

    recipe = FlowerRecipe.from_config({**RECIPE, "method": method})
    with pytest.raises(NotApplicable, match=f"^{method} cannot run on Flower yet: {reason}"):
        check_supported(recipe.build_algorithm(3))
    check_supported(FlowerRecipe.from_config({**RECIPE, "method": "FedAvg"}).build_algorithm(3))  # no refusal


def flower_rounds_without_transport(config: dict) -> tuple[Any, list, list]:
    """The Flower app's two sides (FederatedRun on the server, client_round on each client's own partition, the
    states through the wire format) without the processes: what each method computes over Flower."""
    from fl_server.flower.server_app import FederatedRun
    from fl_server.flower.task import client_round, load_partition
    from fl_server.flower.wire import record_to_state

    recipe = FlowerRecipe.from_config(config)
    parts = [load_partition(recipe, 0)]
    parts += [load_partition(recipe, p) for p in range(1, parts[0].num_partitions)]
    infos = [{"input-shape": list(d.input_shape), "num-classes": d.num_classes, "num-train": len(d.y_train)}
             for d in parts]
    run = FederatedRun(recipe, infos)
    client = recipe.build_algorithm(len(parts))
    kept: list = [None] * len(parts)  # each client's own entries (BTFL's local head), never sent
    for r in range(recipe.rounds):
        ids = np.arange(len(parts))
        states = []
        for k, msg in zip(ids, run.train_payloads(ids, r)):
            assert not set(run.algorithm.per_client_keys) & {key.split("/")[0] for key in msg["state"]}
            assert not set(run.algorithm.per_client_keys) & {key.split("/")[0] for key in msg["server"]}
            sent, kept[k] = client_round(client, record_to_state(msg["state"]), record_to_state(msg["server"]),
                                         parts[k], recipe, r, kept[k])
            assert not set(client.client_private) & set(sent)
            states.append(record_to_state(state_to_record(sent)))
        run.aggregate(ids, states)
    return run, parts, kept


METHODS = ["FedProx", "TENT", "FedTTA-Prox", "FedTTA++", "FedICON", "BTFL"]


@pytest.mark.parametrize("method", METHODS)
def test_each_methods_flower_sides_match_the_engine(method: str, data_root: Path) -> None:
    """FedICON: 2 rounds are 1 encoder round and 1 classifier round (``FedICON.fit_hyper``), both phases compared."""
    config = {**RECIPE, "method": method, "rounds": 2, "local-iterations": 6, "max-samples": 3000}
    run, _, _ = flower_rounds_without_transport(config)
    flower = to_numpy_flat(run.server_state)
    engine, _ = in_process(config)
    private = set(run.algorithm.client_private.values())  # BTFL's heads: the server's copy is never trained
    assert sorted(flower) == sorted(engine)
    diff = max(float(np.abs(flower[k] - engine[k]).max()) for k in engine if k.split("/")[0] not in private)
    assert diff <= 1e-6, f"{method}: {diff}"


def test_btfl_on_flower_keeps_heads_on_clients_and_its_global_dle_equals_the_engines(data_root: Path) -> None:
    """BTFL over Flower: the local heads never reach the server (its copy keeps the initial draw), the clients'
    heads equal the engine's, and the finalize weights built from the clients' uploads (global DLE, clients behind
    it, mean feature) equal the in-process finalize's."""
    import torch

    from fl_server.algorithms.btfl import BTFL
    from fl_server.flower.task import client_btfl_upload

    config = {**RECIPE, "method": "BTFL", "rounds": 2, "local-iterations": 6, "max-samples": 3000}
    run, parts, kept = flower_rounds_without_transport(config)
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


BN_DEVICE = """
import sys, json
import numpy as np
from edge_sdk import open_bundle
device = open_bundle(sys.argv[1])
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
    run, parts, _ = flower_rounds_without_transport(config)
    assert len(parts) == 3 and parts[0].x_train.dtype == np.float32  # preprocessed by the recipe on the client
    flower = to_numpy_flat(run.server_state)
    engine, _ = in_process(config)
    assert sorted(flower) == sorted(engine)
    diff = max(float(np.abs(flower[k] - engine[k]).max()) for k in engine)
    assert diff <= 1e-6, diff
