"""The ``map-incomplete`` protocol (MAP Sec. 5): the *train* split over clients with incomplete classes
(each observes 2..C random classes), 80/20 local train/test, a fraction Q of the clients per round.

All five methods run in the MAP family (:mod:`fl_server.algorithms.map`) so they share the paper's
optimiser (SGD momentum 0.9, lr 0.03, wd 1e-5) and the same personalisation procedure:
FedAvg = alpha 1, one stage, no HPM; FedProx = FedAvg + mu/2 ||psi - psi_server||^2; FedRS; FedPHP (FedAvg
+ HPM); MAP; FedAvg-2stage (MAP's schedule with neither RS nor HPM: what the upload after E/2 costs); and
MAP (code), MAP with the client procedure of the authors' released code (``authors_code_procedure``).
Reported (final round, as the paper): ``personalization`` = mean over all clients of the local-test
accuracy of the personalised model after one client procedure from the final global model (the engine's
``val``): psi_hat for the methods without an HPM, the HPM updated by that procedure for FedPHP / MAP
(Algorithm 1's client model, see ``MAP.val_params``); ``aggregation`` = accuracy of the final global model
on the official test split.
"""
from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path
from typing import Any

import torch

from fl_server.algorithms.map import authors_code_procedure
from lab.protocol import Protocol
from lab.runner import build_federated, own_simulation
from fl_server.data import load_dataset
from fl_server.data.federated import FederatedData
from fl_server.torch_device import describe
from fl_server.engine import Simulation


# display name -> MAP-family overrides
MAP_METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"alpha": 1.0, "stage1_fraction": 1.0, "hpm": False},
    "FedProx": {"alpha": 1.0, "stage1_fraction": 1.0, "hpm": False, "prox_mu": 0.001},
    "FedRS": {"alpha": 0.9, "stage1_fraction": 1.0, "hpm": False},
    # FedPHP [27] = FedAvg + HPM: KD on every step, psi_hat uploaded (MAP Sec. 4.2; the authors' fedphp.py)
    "FedPHP": {"alpha": 1.0, "stage1_fraction": 0.0, "hpm": True},
    "MAP": {"alpha": 0.9, "stage1_fraction": 0.5, "hpm": True},
    # control for FedPHP / MAP: their two-stage schedule (upload after E/2) without RS and without HPM
    "FedAvg-2stage": {"alpha": 1.0, "stage1_fraction": 0.5, "hpm": False},
    # MAP with the client procedure of the authors' released code (fedap.py) instead of Algorithm 1's
    # E/2 + E/2: E epochs of RS uploaded, then a short KD stage (authors_code_procedure)
    "MAP (code)": {"alpha": 0.9, "hpm": True},
}
AUTHORS_CODE_METHODS = {"MAP (code)"}


def build_map_simulation(protocol: Protocol, method: str, seed: int, run_dir: Path | None, device: str = "auto",
                         mode: str = "auto", progress: bool = True, data_root: str | None = None,
                         fed: FederatedData | None = None) -> Simulation:
    """The engine run of one map-incomplete method and seed (the method's MAP configuration)."""

    if method not in MAP_METHODS:
        raise ValueError(f"map-incomplete has no method {method!r}; choose one of {', '.join(MAP_METHODS)}")
    fed = fed if fed is not None else build_federated(protocol, seed, data_root)
    hp = {**MAP_METHODS[method], "local_iterations": protocol.local_iterations,
          "expected_selections": protocol.client_fraction * protocol.rounds, **protocol.method_hp.get(method, {})}
    if method in AUTHORS_CODE_METHODS:  # the protocol's steps are E epochs; the code adds its KD stage
        hp.update(authors_code_procedure(protocol.local_iterations))
    return own_simulation(protocol, "MAP", seed, run_dir, fed, device, mode, progress, data_root, hyper=hp,
                          local_iterations=hp["local_iterations"])


def run_map_seed(protocol: Protocol, method: str, seed: int, run_dir: Path | None, device: str = "auto",
                 mode: str = "auto", progress: bool = True, data_root: str | None = None,
                 fed: FederatedData | None = None) -> dict[str, Any]:
    sim = build_map_simulation(protocol, method, seed, run_dir, device, mode, progress, data_root, fed)
    algo = sim.algorithm
    result = sim.run()
    t0 = time.perf_counter()
    test = load_dataset(protocol.dataset, root=data_root, split="test")
    x = torch.from_numpy(test.x).to(sim.device, sim.dtype)
    with torch.no_grad():
        pred = torch.cat([algo.predict(sim.server_state["params"], x[s:s + 4096]).argmax(-1)
                          for s in range(0, len(x), 4096)]).cpu().numpy()
    aggregation = 100 * float((pred == test.y).mean())
    personalization = 100 * result.last["val"]
    curve = [{"round": r["round"], "personalization": 100 * r["val"]} for r in result.history if "val" in r]
    return {
        "dataset": protocol.dataset, "method": method, "seed": seed, "model": protocol.model,
        "rounds": protocol.rounds, "best_round": protocol.rounds - 1,
        "val": personalization, "test": aggregation,
        "results": [{"split": "personalization", "value": personalization},
                    {"split": "aggregation", "value": aggregation}],
        "wall_s": round(result.wall_s + time.perf_counter() - t0, 2), "device": describe(sim.device),
        "mode": sim.mode, "hyper": dataclasses.asdict(algo.hp), "protocol_note": protocol.note,
        "host": platform.node(), "curve": curve,
    }
