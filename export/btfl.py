"""BTFL device bundles: the frozen feature extractor + global head as one ONNX graph (``features``), plus numpy
state as ``.npz``.

* :func:`export_btfl_client`: one *training* client's bundle (its local head, local / global DLE, mean head
  entropies, FedTHE prototypes), for the BTGFL benchmark's device-side checks.
* :func:`export_btfl_run`: what the coordinator serves to any device (``export_run`` on a BTFL run): the
  global model (``params``: ``features`` and ``forward`` graphs take them as ``psi.*``) and the training
  clients' average DLE and mean feature (``btfl``: ``global_dle`` [D, L], ``dle_clients`` [1], ``mu_global`` [D]). A device trains
  its own local head and fits its own DLE on its labeled data (:mod:`edge_sdk.btfl_device`).

On the device (torch-free): ``features, global_logits = session.run(...)``, ``local_logits = features @
local_head.T`` and :meth:`edge_sdk.btfl.BTFLStream.from_arrays` (or :func:`edge_sdk.fedthe.fedthe_predict`).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import numpy as np

from edge_sdk import btfl as btfl_math
from export.bundle import export_specs, write_bundle
from fl_server.signing import ManifestSigner
from export.steps import StepSpec, _example_x, forward_spec
from fl_server.algorithms.btfl import BTFL, ClientArtifacts
from fl_server.functional import State
from fl_server.recipes import Recipe
from fl_server.recipes.run import client_data


def btfl_features_spec(algorithm: BTFL, params: State, batch: int = 4, frozen: bool = True) -> StepSpec:
    """x -> (features z [N, D], global logits [N, C]). ``frozen``: the weights ``params`` are embedded in the
    graph as initializers (the received global model never changes on the device; bundle format 2); else
    they are graph inputs ``psi.*`` (format 1)."""
    names = list(params)

    def fn(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = dict(zip(names, weights))
        z = algorithm.features(p, x)
        return z, algorithm.global_head(p, z)

    return StepSpec(fn, [_example_x(algorithm.model, params, batch), *params.values()],
                    ["x", *(f"psi.{n}" for n in names)], ["features", "global_logits"],
                    embedded=tuple(f"psi.{n}" for n in names) if frozen else ())


def export_btfl_client(algorithm: BTFL, params: State, artifacts: ClientArtifacts, dest: str | os.PathLike,
                       extra: dict[str, Any] | None = None, frozen: bool = True) -> Path:
    """Write client k's bundle: graph ``features`` (the weights embedded unless ``frozen=False``), weights
    ``psi`` (global model) and ``btfl`` (its state)."""
    params = {n: v.detach().float().cpu() for n, v in params.items()}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        graphs = export_specs({"features": btfl_features_spec(algorithm, params, frozen=frozen)}, Path(tmp))
        weights = {"psi": {n: v.numpy() for n, v in params.items()}, "btfl": artifacts.arrays()}
        return write_bundle(dest, graphs, weights, algorithm.name, asdict(algorithm.hp), extra=extra)


def training_global_dle(algorithm: BTFL, server_state: State, run: dict[str, Any],
                        data_root: str | None = None, recipe: Recipe | None = None
                        ) -> tuple[np.ndarray, int, np.ndarray]:
    """(global DLE [D, L], clients, mu_global [D]): the average of every training client's local DLE on its
    training set with the final features (BTFL Sec. 4.1: every client weighs the same, as in ``btgfl`` and on
    the coordinator), and the mean of their mean features (FedTHE's global prototype, on the same bundle)."""
    fed = client_data(run, data_root, recipe)
    x = torch.from_numpy(fed.dataset.x).float()
    arts = algorithm.client_artifacts(server_state, x, fed.train)
    return btfl_math.average_dles([a.local_dle for a in arts]), len(arts), arts[0].mu_global


def export_btfl_run(algorithm: BTFL, server_state: State, run: dict[str, Any], dest: str | os.PathLike,
                    extra: dict[str, Any], data_root: str | None = None,
                    signer: ManifestSigner | None = None, recipe: Recipe | None = None,
                    global_dle: tuple[np.ndarray, int] | None = None) -> Path:
    """The served BTFL bundle: graphs ``features`` and ``forward``, weights ``params`` and ``btfl``.
    ``global_dle``: (DLE, clients) uploaded by the clients of a Flower run (no data re-read here)."""
    params = {n: v.detach().float().cpu() for n, v in server_state["params"].items()}
    state = {"params": params, "local_heads": server_state["local_heads"].float()}
    if global_dle is not None:  # a Flower run: the clients' uploads (no FedTHE prototype: mu_global is left out)
        (global_dle, clients), mu_global = global_dle, None
    else:
        global_dle, clients, mu_global = training_global_dle(algorithm, state, run, data_root, recipe)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        graphs = export_specs({"features": btfl_features_spec(algorithm, params),
                               "forward": forward_spec(algorithm.model, params)}, Path(tmp))
        served = {"global_dle": global_dle, "dle_clients": np.array([clients], dtype=np.int64)}
        if mu_global is not None:
            served["mu_global"] = np.asarray(mu_global, dtype=np.float64)
        weights = {"params": {n: v.numpy() for n, v in params.items()}, "btfl": served}
        return write_bundle(dest, graphs, weights, algorithm.name, asdict(algorithm.hp), extra=extra, signer=signer)
