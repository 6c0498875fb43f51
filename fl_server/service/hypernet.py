"""ODPFL-HN's server half behind the API: w = f_theta(e) for a new client's embedding e (Algorithm 1,
inference). theta never leaves the server; the client sends only e (optionally DP-noised on the device).

The hypernetwork's output heads are wide (one row of weights per target parameter), so one embedding at a
time is a memory-bound matrix-vector product; concurrent requests are therefore micro-batched: while one
batch [K, E] runs, the next requests queue up and go together (:class:`GenerateBatcher`). There is no
batching window: a lone request runs at once. Forwards run on one worker thread with torch's intra-op threads
bounded by ``fl-server serve`` (1), so they never block the event loop nor take every core."""
from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from edge_sdk.shared import encode_weights_header
from fl_server.service.artifacts import ArtifactStore
from fl_server.service.batching import MicroBatcher


class FusedHypernet:
    """f_theta of one ODPFL-HN bundle with its output heads fused: the heads' [out_i, width] matrices are
    concatenated once into W [P, width], so a batch is the body (a few small layers) plus ONE matmul producing
    every target parameter as a row of [K, P], in the bundle's parameter order. Each torch call releases the GIL
    and must take it back; with the event loop holding it under load, one call instead of one per head keeps the
    worker thread from queueing behind the loop (the interpreter's switch interval) once per head."""

    def __init__(self, algorithm: Any, theta: dict[str, torch.Tensor]) -> None:
        net = algorithm.hypernet
        # The body is Linear/ReLU pairs (odpfl_hn.HyperNetwork): kept as plain (W^T, b) so a batch is a few
        # addmm calls, without functional_call's per-call parameter swapping (Python work that needs the GIL
        # the event loop holds under load).
        kinds = [type(m) for m in net.body]
        if kinds != [torch.nn.Linear, torch.nn.ReLU] * (len(kinds) // 2):
            raise ValueError(f"the hypernetwork body must be (Linear, ReLU) pairs, got {kinds}")
        self.layers = [(theta[f"body.{i}.weight"].T.contiguous(), theta[f"body.{i}.bias"])
                       for i, m in enumerate(net.body) if isinstance(m, torch.nn.Linear)]
        self.names = [f"psi.{n}" for n in net.names]
        self.shapes = [tuple(s) for s in net.shapes]
        self.weight_t = torch.cat([theta[f"heads.{i}.weight"] for i in range(len(net.names))]).T
        self.bias = torch.cat([theta[f"heads.{i}.bias"] for i in range(len(net.names))])

    def __call__(self, embeddings: np.ndarray) -> np.ndarray:
        """[K, E] -> [K, P] float32: row k holds every parameter of client k, flattened, back to back."""
        with torch.inference_mode():
            h = torch.from_numpy(embeddings)
            for w_t, b in self.layers:
                h = torch.addmm(b, h, w_t).relu_()
            return torch.addmm(self.bias, h, self.weight_t).numpy()

    def split(self, row: np.ndarray) -> dict[str, np.ndarray]:
        """One row of [K, P] -> {psi.<name>: array of its shape} (views)."""
        out, start = {}, 0
        for name, shape in zip(self.names, self.shapes):
            size = int(np.prod(shape, dtype=np.int64))
            out[name] = row[start:start + size].reshape(shape)
            start += size
        return out


class HypernetCache:
    """One loaded (fused) hypernetwork per bundle id, built from the bundle's manifest and theta's artifact."""

    def __init__(self, artifacts: ArtifactStore) -> None:
        self.artifacts = artifacts
        self._loaded: dict[str, FusedHypernet] = {}
        self._lock = threading.Lock()

    @staticmethod
    def embed_dim(bundle: dict[str, Any]) -> int:
        return int(bundle["manifest"]["hyperparameters"]["embed_dim"])

    def preload(self, bundle: dict[str, Any]) -> None:
        """Load in the background (a daemon thread), so the first generate does not pay for it."""
        threading.Thread(target=self.get, args=(bundle,), name="hypernet-preload", daemon=True).start()

    def get(self, bundle: dict[str, Any]) -> FusedHypernet:
        with self._lock:
            if bundle["id"] not in self._loaded:
                from fl_server.recipes.run import rebuild

                m = bundle["manifest"]
                _, _, algorithm = rebuild({**m, "hyper": m["hyperparameters"]})
                # read() checks the bytes against their address (raises Corrupt and quarantines them)
                with np.load(io.BytesIO(self.artifacts.read(bundle["server"]["hn"])), allow_pickle=False) as arrays:
                    theta = {k: torch.from_numpy(arrays[k]).float() for k in arrays.files}
                self._loaded[bundle["id"]] = FusedHypernet(algorithm, theta)
            return self._loaded[bundle["id"]]


def encode_json(bundle_id: str, weights: dict[str, np.ndarray]) -> bytes:
    """The JSON generate body (schemas.GenerateResponse) assembled directly as bytes: base64 output
    needs no JSON escaping, and skipping json.dumps over ~100s of kB per reply matters under load."""
    parts = []
    for name, v in weights.items():
        data = base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes())
        parts.append(b'%s: {"shape": %s, "dtype": "float32", "data": "%s"}'
                     % (json.dumps(name).encode(), json.dumps(list(v.shape)).encode(), data))
    return b'{"bundle_id": "%s", "params": {%s}}' % (bundle_id.encode(), b", ".join(parts))


class GenerateBatcher:
    """Coalesces concurrent generate calls per bundle into batched forwards (:class:`MicroBatcher`: one
    worker thread, never the event loop); each reply is encoded on that thread too, as JSON or as the
    binary format of :mod:`edge_sdk._tensors` (then a row of the [K, P] output is the whole payload)."""

    def __init__(self, cache: HypernetCache, max_batch: int = 64) -> None:
        self.cache = cache
        self._bundles: dict[str, dict[str, Any]] = {}
        self.batcher: MicroBatcher[tuple[np.ndarray, bool], bytes] = MicroBatcher(self._run, max_batch, "generate")

    async def generate(self, bundle: dict[str, Any], embedding: np.ndarray, binary: bool = False) -> bytes:
        """The encoded response for one embedding [E]: ``binary`` -> application/vnd.fl-edge.weights."""
        self._bundles.setdefault(bundle["id"], bundle)
        return await self.batcher.submit(bundle["id"], (embedding, binary))

    def _run(self, bundle_id: Hashable, items: list[tuple[np.ndarray, bool]]) -> list[bytes]:
        bundle = self._bundles[str(bundle_id)]
        hn = self.cache.get(bundle)
        out = hn(np.stack([e for e, _ in items]).astype(np.float32))
        head = encode_weights_header(dict(zip(hn.names, hn.shapes)), {"bundle_id": bundle["id"]})
        little = out.astype("<f4", copy=False)
        return [head + little[i].tobytes() if binary else encode_json(bundle["id"], hn.split(out[i]))
                for i, (_, binary) in enumerate(items)]

    def close(self) -> None:
        self.batcher.close()
