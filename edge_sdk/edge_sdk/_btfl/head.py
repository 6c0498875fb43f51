"""BTFL's personalisation phase on the device (Sec. 4) for a BTFL bundle (graph ``features``: frozen feature
extractor + global head; weights ``btfl``: the training clients' global DLE): the bias-free local head
(:func:`fit_local_head`, gradient descent on frozen features), the local DLE and the heads' mean entropies; then
the stream (:class:`BTFLStream`) with the coordinator's global DLE (the reply to the DLE upload: everyone else's,
as BTFL's authors do) or the bundle's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edge_sdk._btfl.dle import fit_dle
from edge_sdk._btfl.stream import BTFLStream, BTFLVariant
from edge_sdk._errors import BundleError
from edge_sdk._numerics import entropy, log_softmax, softmax
from edge_sdk._steps import check_batch, graph_feeds

if TYPE_CHECKING:
    from edge_sdk._bundle import Bundle


def fit_local_head(features: np.ndarray, labels: np.ndarray, num_classes: int, epochs: int = 200,
                   lr: float = 0.5, weight_decay: float = 5e-4, seed: int = 0) -> np.ndarray:
    """Bias-free softmax regression ``logits = z @ W.T`` on frozen features z [N, D] -> W [C, D] (float64).
    Full-batch gradient descent on mean cross-entropy + ``weight_decay`` / 2 ||W||^2 (BTFL's local head,
    trained on detached features); W starts like ``nn.Linear``'s init (uniform +-1/sqrt(D))."""
    z = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    if z.ndim != 2 or y.shape != (len(z),) or len(z) == 0:
        raise ValueError(f"need features [N, D] and labels [N] with N >= 1, got {z.shape} and {y.shape}")
    if not np.isfinite(z).all():
        raise ValueError("features must be finite")
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"labels must be in [0, {num_classes})")
    d = z.shape[1]
    w = np.random.default_rng(seed).uniform(-1, 1, size=(num_classes, d)) / np.sqrt(d)
    onehot = np.eye(num_classes)[y]
    for _ in range(epochs):
        grad = (softmax(z @ w.T) - onehot).T @ z / len(z) + weight_decay * w
        w -= lr * grad
    return w


@dataclass
class BTFLFit:
    local_head: np.ndarray  # [C, D]
    local_dle: np.ndarray  # [D, L]
    h_local_bar: float
    h_global_bar: float
    samples: int
    train_accuracy: float  # of the local head on the data it was fitted on


class BTFLParticipant:
    """A BTFL bundle's participant on the device: the frozen features graph (features z >= 0 and the global
    head's logits), the local head and DLE fitted on labeled data, then a :class:`BTFLStream`."""

    def __init__(self, bundle: Bundle, threads: int | None = 1) -> None:
        if bundle.device_step != "btfl":
            raise BundleError(f"a {bundle.method} bundle has no BTFL stream (its device step is {bundle.device_step!r})")
        self.bundle = bundle
        self.session = bundle.session("features", threads)
        # the weights the features graph takes as inputs: none for a frozen graph (bundle format 2)
        self.psi = graph_feeds(self.session, {"x": np.empty(0, np.float32),
                                              **{f"psi.{k}": v for k, v in bundle.weights("params").items()}})
        self.psi.pop("x")
        served = bundle.weights("btfl")
        self.training_dle = np.asarray(served["global_dle"], dtype=np.float64)
        self.levels = int(bundle.hyperparameters.get("dle_levels", self.training_dle.shape[1]))
        self.num_classes = int(bundle.manifest["num_classes"])
        self.fit_result: BTFLFit | None = None
        self.stream: BTFLStream | None = None

    def features(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x [N, ...] float32 -> (features z [N, D] >= 0, global-head logits [N, C])."""
        z, g = self.session.run(["features", "global_logits"], {"x": check_batch(x, self.session), **self.psi})
        return np.maximum(z, 0.0), g

    def fit(self, x: np.ndarray, y: np.ndarray, **head_options: float) -> BTFLFit:
        """The device's personalization phase on its labeled data (x, y): local head, local DLE, H bars."""
        z, g = self.features(x)
        head = fit_local_head(z, y, self.num_classes, **head_options)  # type: ignore[arg-type]
        local_logits = z @ head.T
        self.fit_result = BTFLFit(head, fit_dle(z, self.levels), float(entropy(local_logits).mean()),
                                  float(entropy(g).mean()), len(z),
                                  float((local_logits.argmax(1) == np.asarray(y)).mean()))
        return self.fit_result

    def start(self, global_dle: np.ndarray | None = None, variant: BTFLVariant | None = None) -> BTFLStream:
        """Begin a stream with ``global_dle`` (default: the bundle's training-time DLE) and ``variant`` (default:
        the paper)."""
        if self.fit_result is None:
            raise BundleError("call fit() on the device's labeled data first (BTFL needs a local head)")
        glob = self.training_dle if global_dle is None else np.asarray(global_dle, dtype=np.float64)
        f = self.fit_result
        self.stream = BTFLStream(f.local_dle, glob, max(f.h_local_bar, 1e-6), max(f.h_global_bar, 1e-6),
                                 variant)
        return self.stream

    def _started(self) -> tuple[BTFLStream, BTFLFit]:
        if self.stream is None or self.fit_result is None:
            raise BundleError("call fit() and start() first")
        return self.stream, self.fit_result

    def predict_one(self, x: np.ndarray) -> np.ndarray:
        """One sample x [1, ...] -> class probabilities [C]; ``self.stream.last_weight`` is its e."""
        stream, fit = self._started()
        z, g = self.features(x)
        return stream.predict_one(z[0] @ fit.local_head.T, g[0], z[0])

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Log-probabilities [N, C] of the interpolated prediction, samples in stream order.

        One feature pass for the batch, then the stream's batch update, whose per-sample priors are those of
        N ``predict_one`` calls (``stream.last_weights`` holds each sample's e). A single sample takes
        ``predict_one``'s scalar path (``stream.last_weight``)."""
        if len(x) == 1:
            return np.log(np.maximum(self.predict_one(x), 1e-300))[None]
        stream, fit = self._started()
        z, g = self.features(x)
        return np.log(np.maximum(stream.predict(z @ fit.local_head.T, g, z), 1e-300))

    def global_logits(self, x: np.ndarray) -> np.ndarray:
        """The received global model alone (phi + global head), for comparison."""
        return log_softmax(self.features(x)[1])
