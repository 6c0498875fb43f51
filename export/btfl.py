"""BTFL device bundle for one client: the frozen feature extractor + global head as one ONNX graph, and the
client's numpy state (local head, local / global DLE, mean head entropies, FedTHE prototypes) as ``.npz``.

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

from export.bundle import export_specs, write_bundle
from export.steps import StepSpec, _example_x
from fl_server.algorithms.btfl import BTFL, ClientArtifacts
from fl_server.functional import State


def btfl_features_spec(algorithm: BTFL, params: State, batch: int = 4) -> StepSpec:
    """(x, psi) -> (features z [N, D], global logits [N, C]) with the weights as graph inputs."""
    names = list(params)

    def fn(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = dict(zip(names, weights))
        z = algorithm.features(p, x)
        return z, algorithm.global_head(p, z)

    return StepSpec(fn, [_example_x(algorithm.model, params, batch), *params.values()],
                    ["x", *(f"psi.{n}" for n in names)], ["features", "global_logits"])


def export_btfl_client(algorithm: BTFL, params: State, artifacts: ClientArtifacts, dest: str | os.PathLike,
                       extra: dict[str, Any] | None = None) -> Path:
    """Write client k's bundle: graph ``features``, weights ``psi`` (global model) and ``btfl`` (its state)."""
    params = {n: v.detach().float().cpu() for n, v in params.items()}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        graphs = export_specs({"features": btfl_features_spec(algorithm, params)}, Path(tmp))
        weights = {"psi": {n: v.numpy() for n, v in params.items()}, "btfl": artifacts.arrays()}
        return write_bundle(dest, graphs, weights, algorithm.name, asdict(algorithm.hp), extra=extra)
