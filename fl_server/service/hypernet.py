"""ODPFL-HN's server half behind the API: w = f_theta(e) for a new client's embedding e (Algorithm 1,
inference). theta never leaves the server; the client sends only e (optionally DP-noised on the device).

The hypernetwork's output heads are wide (one row of weights per target parameter), so one embedding at a
time is a memory-bound matrix-vector product; concurrent requests are therefore micro-batched: while one
batch [K, E] runs, the next requests queue up and go together (:class:`GenerateBatcher`)."""
from __future__ import annotations

import asyncio
import base64
import json
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

    @staticmethod
    def embed_dim(bundle: dict[str, Any]) -> int:
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

    def generate(self, bundle: dict[str, Any], embeddings: np.ndarray) -> dict[str, np.ndarray]:
        """embeddings [K, E] -> {param name: float32 [K, *shape]} (one batched forward)."""
        algorithm, theta = self._load(bundle)
        with torch.inference_mode():
            w = algorithm.generate(theta, torch.from_numpy(np.asarray(embeddings, dtype=np.float32)))
        return {k: v.numpy() for k, v in w.items()}


def encode_response(bundle_id: str, weights: dict[str, np.ndarray]) -> bytes:
    """The generate response body (schemas.GenerateResponse) assembled directly as bytes: base64 output
    needs no JSON escaping, and skipping json.dumps over ~100s of kB per reply matters under load."""
    parts = []
    for name, v in weights.items():
        data = base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes())
        parts.append(b'%s: {"shape": %s, "dtype": "float32", "data": "%s"}'
                     % (json.dumps(f"psi.{name}").encode(), json.dumps(list(v.shape)).encode(), data))
    return b'{"bundle_id": "%s", "params": {%s}}' % (bundle_id.encode(), b", ".join(parts))


class GenerateBatcher:
    """Coalesces concurrent generate calls per bundle into batched forwards run off the event loop."""

    def __init__(self, cache: HypernetCache, max_batch: int = 64) -> None:
        self.cache, self.max_batch = cache, max_batch
        self._queues: dict[str, list[tuple[np.ndarray, asyncio.Future]]] = {}
        self._busy: set[str] = set()

    async def generate(self, bundle: dict[str, Any], embedding: np.ndarray) -> bytes:
        """The encoded response for one embedding [E]."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queues.setdefault(bundle["id"], []).append((embedding, fut))
        if bundle["id"] not in self._busy:
            self._busy.add(bundle["id"])
            asyncio.get_running_loop().create_task(self._drain(bundle))
        return await fut

    def _run(self, bundle: dict[str, Any], embeddings: np.ndarray) -> list[bytes]:
        w = self.cache.generate(bundle, embeddings)
        return [encode_response(bundle["id"], {k: v[i] for k, v in w.items()}) for i in range(len(embeddings))]

    async def _drain(self, bundle: dict[str, Any]) -> None:
        queue = self._queues[bundle["id"]]
        try:
            while queue:
                batch = queue[:self.max_batch]
                del queue[:self.max_batch]
                try:
                    bodies = await asyncio.to_thread(self._run, bundle, np.stack([e for e, _ in batch]))
                except Exception as exc:  # surfaced to every waiting request
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), body in zip(batch, bodies):
                    if not fut.done():
                        fut.set_result(body)
        finally:
            self._busy.discard(bundle["id"])
