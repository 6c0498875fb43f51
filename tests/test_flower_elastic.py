"""An elastic Flower federation: three SuperNodes, each holding only its own Fashion-MNIST image folder, train FedTTA,
BTFL and ODPFL-HN on the real SuperLink, one run after the other. In the first run one SuperNode is SIGKILLed with
its process group after the first round (then started again on its folder: a new node, not a client of that run):
the run still finishes, its second round aggregating over the two nodes that reply, and the ServerApp's per-round
progress lines (``flwr run --stream``) say so. Every run exports to a bundle a device serves (the dropped replies
of BTFL's and ODPFL-HN's own messages: tests/test_flower.py, without the transport; one kill here, since each
costs a ``round-timeout`` of waiting). No process of the deployment outlives it."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install 'fl-edge[flower]')")

from flower_local import LocalDeployment, processes_of, write_node_data  # noqa: E402  (beside this file)

# every method on the zoo MLP at a smoke size; ODPFL-HN's hypernetwork narrow
# (8 units: 1.6M parameters), starting at the MLP's own initial weights
RECIPES = """
from fl_server.recipes.presets import builtin_recipe

def smoke(method, **hyper):
    recipe = builtin_recipe("fashion_mnist", method, model="mlp", rounds=2, local_iterations=20, batch_size=32)
    return recipe.replace(hyper={**recipe.hyper, **hyper})

FEDTTA = smoke("FedTTA")
BTFL = smoke("BTFL")
ODPFL = smoke("ODPFL-HN", hn_width=8, hn_head_init="target", hn_head_scale=0.1)
"""
RUNS = {"FedTTA": "FEDTTA", "BTFL": "BTFL", "ODPFL-HN": "ODPFL"}


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout:.0f} s")
        time.sleep(0.5)


def rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.timeout(600)
def test_runs_survive_a_supernode_killed_mid_run_and_export(tmp_path: Path,
                                                            fashion_all) -> None:  # type: ignore[no-untyped-def]
    sources, idx = write_node_data(fashion_all, tmp_path, nodes=3, per_node=100, folders=3)
    (tmp_path / "recipes.py").write_text(RECIPES)
    dep = LocalDeployment(num_nodes=3, workdir=tmp_path, env={"FL_DATA_DIR": str(tmp_path / "no-data-here")},
                          node_configs=[f"data='{s}'" for s in sources])
    outputs = {}
    try:
        dep.start()
        for k, (method, name) in enumerate(RUNS.items()):
            run = dep.launch({"recipe": f"{tmp_path / 'recipes.py'}:{name}", "run-dir": f"run-{method}",
                              "round-timeout": 45}, name=method)
            if k == 0:  # the first round trained on all three nodes: then one node dies with its process group
                wait_for(lambda: rows(tmp_path / f"run-{method}") or run.poll() is not None, 300, "the first round")
                assert processes_of(tmp_path / "flwr-home")
                dep.kill(dep.nodes[k])
            outputs[method] = dep.finish(run, timeout=400)
            if k == 0:
                dep.start_node(["--insecure"], dep.node_configs[k], f"supernode-{k}-again")  # the device is back
    finally:
        dep.stop()
    assert processes_of(tmp_path / "flwr-home") == []  # nothing of the deployment outlives it

    held_out = np.setdiff1d(np.arange(len(fashion_all.y)), idx.ravel())[:200]
    x, y = fashion_all.x[held_out].astype(np.float32), fashion_all.y[held_out]
    for k, (method, out) in enumerate(outputs.items()):
        run_dir = tmp_path / f"run-{method}"
        first, second = rows(run_dir)
        replied = 2 if k == 0 else 3  # the killed node's run: two replies in its second round
        assert (first["clients"], first["asked"]) == (3, 3), (method, first)
        assert second["clients"] == replied and second["asked"] in ((2, 3) if k == 0 else (3,)), (method, second)
        assert not second.get("skipped") and second["train_loss"] > 0 and 0.0 <= second["val"] <= 1.0
        # the ServerApp's progress, one line per round, streamed by `flwr run --stream`
        assert f"round 1/2: train loss {first['train_loss']:.4f}, 3/3 nodes replied" in out, (method, out[-3000:])
        assert (f"round 2/2: train loss {second['train_loss']:.4f}, val accuracy {second['val']:.4f}, "
                f"{replied}/{second['asked']} nodes replied") in out, (method, out[-3000:])
        assert json.loads((run_dir / "run.json").read_text())["method"] == method
        accuracy = served_accuracy(tmp_path, run_dir, method, x, y)
        assert accuracy > 0.25, (method, accuracy)  # chance: 0.1


def served_accuracy(root: Path, run_dir: Path, method: str, x: np.ndarray, y: np.ndarray) -> float:
    """Export the run (``fl-server export``'s function), open the bundle with the SDK (ODPFL-HN: the run's hypernetwork answering the
    device's embedding, as the coordinator serves it), personalise on ``x`` (BTFL with its labels) and score."""
    import torch

    import edge_sdk
    from fl_server import rundir
    from fl_server.export.run import export_run
    from fl_server.recipes.run import rebuild
    from fl_server.service.hypernet import FusedHypernet

    bundle = export_run(run_dir, root / f"bundle-{method}")
    client = None
    if method == "ODPFL-HN":
        _, _, algorithm = rebuild(rundir.read_run(run_dir))
        net = FusedHypernet(algorithm, {k: torch.from_numpy(v) for k, v in rundir.best_arrays(run_dir, "hn").items()})

        class Hypernetwork:
            def generate(self, embedding: np.ndarray, bundle_id: str) -> dict[str, np.ndarray]:
                return net.split(net(np.asarray(embedding, np.float32)[None])[0])
        client = Hypernetwork()
    device = edge_sdk.open_bundle(bundle, client=client)  # type: ignore[arg-type]
    device.personalize(x, y if method == "BTFL" else None)
    return float((device.predict(x).argmax(1) == y).mean())
