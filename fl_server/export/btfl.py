"""BTFL device bundles: the frozen feature extractor + global head as one ONNX graph (``features``), plus numpy
state as ``.npz``.

* :func:`export_btfl_client`: one *training* client's bundle (its local head, local / global DLE, mean head
  entropies, FedTHE prototypes), for the BTGFL benchmark's device-side checks.
* :func:`export_btfl_run`: what the coordinator serves to any device (``export_run`` on a BTFL run): the
  global model (``params``: ``features`` and ``forward`` graphs take them as ``psi.*``) and the training
  clients' average DLE and mean feature (``btfl``: ``global_dle`` [D, L], ``dle_clients`` [1], ``mu_global`` [D]),
  computed by the run's finalize step (``BTFL.finalize``) and read from its run directory. A device trains
  its own local head and fits its own DLE on its labeled data (:mod:`edge_sdk._btfl.head`).

On the device (torch-free): ``features, global_logits = session.run(...)``, ``local_logits = features @
local_head.T`` and :meth:`edge_sdk._btfl.BTFLStream.from_arrays` (or :func:`edge_sdk._fedthe.fedthe_predict`).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import numpy as np

from fl_server.export.bundle import export_specs, write_bundle
from fl_server.signing import ManifestSigner
from fl_server.export.steps import StepSpec, example_x, forward_spec, with_norm_statistics
from fl_server.algorithms.btfl import BTFL, ClientArtifacts
from fl_server.functional import State


def btfl_features_spec(algorithm: BTFL, params: State, batch: int = 4, frozen: bool = True) -> StepSpec:
    """x -> (features z [N, D], global logits [N, C]). ``frozen``: the weights ``params`` are embedded in the
    graph as initializers (the received global model never changes on the device; bundle format 2); else
    they are graph inputs ``psi.*`` (format 1)."""
    names = list(params)

    def fn(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = dict(zip(names, weights))
        z = algorithm.features(p, x)
        return z, algorithm.global_head(p, z)

    spec = StepSpec(fn, [example_x(algorithm.model, params, batch), *params.values()],
                    ["x", *(f"psi.{n}" for n in names)], ["features", "global_logits"])
    # a batch-normalised model: the population statistics at momentum 0, whatever the batch (no-op otherwise)
    spec = with_norm_statistics(spec, algorithm.model, momentum=0.0, return_stats=False)
    if frozen:
        spec.embedded = tuple(n for n in spec.input_names if n != "x")
    return spec


def export_btfl_client(algorithm: BTFL, params: State, artifacts: ClientArtifacts, dest: str | os.PathLike,
                       extra: dict[str, Any] | None = None, frozen: bool = True) -> Path:
    """Write client k's bundle: graph ``features`` (the weights embedded unless ``frozen=False``), weights
    ``psi`` (global model) and ``btfl`` (its state)."""
    params = {n: v.detach().float().cpu() for n, v in params.items()}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        graphs = export_specs({"features": btfl_features_spec(algorithm, params, frozen=frozen)}, Path(tmp))
        weights = {"psi": {n: v.numpy() for n, v in params.items()}, "btfl": artifacts.arrays()}
        return write_bundle(dest, graphs, weights, algorithm.name, asdict(algorithm.hp), extra=extra)


def export_btfl_run(algorithm: BTFL, server_state: State, device: dict[str, dict[str, np.ndarray]],
                    dest: str | os.PathLike, extra: dict[str, Any], signer: ManifestSigner | None = None) -> Path:
    """The served BTFL bundle: graphs ``features`` and ``forward``, weights ``params`` and ``btfl`` (the run's
    finalize weights: global DLE, clients behind it, and FedTHE's global prototype ``mu_global``). A batch-normalised model's ``features`` graph embeds the population statistics (``device``'s
    ``stats``), so a feature never depends on the other samples of its batch: a stream of one sample at a time
    gets what a whole client gets."""
    params = {n: v.detach().float().cpu() for n, v in server_state["params"].items()}
    served = {k: np.asarray(v) for k, v in device["btfl"].items()}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        graphs = export_specs({"features": btfl_features_spec(algorithm, params),
                               "forward": forward_spec(algorithm.model, params)}, Path(tmp))
        weights = {"params": {n: v.numpy() for n, v in params.items()}, "btfl": served}
        if "stats" in device:
            weights["stats"] = device["stats"]
        return write_bundle(dest, graphs, weights, algorithm.name, asdict(algorithm.hp), extra=extra, signer=signer)
