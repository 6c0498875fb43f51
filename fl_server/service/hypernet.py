"""ODPFL-HN's server half behind the API: w = f_theta(e) for a new client's embedding e (Algorithm 1,
inference). theta never leaves the server; the client sends only e (optionally DP-noised on the device)."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from fl_server.service.artifacts import ArtifactStore


class HypernetCache:
    """One loaded hypernetwork per bundle id (built from the bundle's manifest and theta's artifact)."""

    def __init__(self, artifacts: ArtifactStore) -> None:
        self.artifacts = artifacts
        self._loaded: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    def embed_dim(self, bundle: dict[str, Any]) -> int:
        return int(bundle["manifest"]["hyperparameters"]["embed_dim"])

    def _load(self, bundle: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
        with self._lock:
            if bundle["id"] not in self._loaded:
                from fl_server.algorithms import build_algorithm
                from fl_server.models import build_model

                m = bundle["manifest"]
                model = build_model(m["model"], tuple(m["input_shape"]), m["num_classes"], seed=m["seed"])
                algorithm = build_algorithm(m["method"], model, 1, seed=m["seed"], **m["hyperparameters"])
                with np.load(self.artifacts.path(bundle["server"]["hn"]), allow_pickle=False) as arrays:
                    theta = {k: torch.from_numpy(arrays[k]).float() for k in arrays.files}
                self._loaded[bundle["id"]] = (algorithm, theta)
            return self._loaded[bundle["id"]]

    def generate(self, bundle: dict[str, Any], embedding: np.ndarray) -> dict[str, np.ndarray]:
        """embedding [E] float -> {param name: float32 array of the target model's shape}."""
        algorithm, theta = self._load(bundle)
        with torch.inference_mode():
            w = algorithm.generate(theta, torch.from_numpy(np.asarray(embedding, dtype=np.float32)))
        return {k: v.numpy() for k, v in w.items()}
