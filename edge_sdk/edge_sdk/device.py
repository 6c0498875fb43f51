"""One device interface for every method: the bundle's method decides how the device personalises and predicts.

    import edge_sdk

    with edge_sdk.EdgeClient(url, public_key=KEY) as client:
        device = edge_sdk.open_bundle(client.download(method="TENT"), client=client)
        device.personalize(x_warmup)          # unlabeled; BTFL / FedTHE also take labels: (x, y)
        logits = device.predict(x_new)        # [N, C]
        for row in device.stream(x_stream):   # one sample at a time, in order
            ...

    device = edge_sdk.open_bundle("runs/bundle", public_key=KEY)   # a bundle directory works the same way

What each method does behind the same calls (``device.method``):

==========================  ==========================================================  =====================
method                      ``personalize(x, y=None)``                                   needs
==========================  ==========================================================  =====================
FedAvg (and any bundle      nothing: the received model predicts                         --
without a device step),
``none``
TENT                        entropy steps on x (``tent_step`` graph)                     --
FedTTA, FedTTA-Prox         one step of UPFL Eq. 5 on x (``fedtta_step``)                --
FedTTA++                    steps with entropy early stopping (Sec. 4.3)                 --
FedICON                     encoder tuned with Eq. 7 on x, two augmented views per       --
                            sample (``fedicon_step``, :mod:`edge_sdk.fedicon`)
ODPFL-HN                    embedding of x on the device, weights from the coordinator   ``client``
BTFL                        local head + local DLE on labeled (x, y); DLE uploaded       y (``client``: the
                            when a client is given; BTFL's interpolation while           coordinator's global
                            predicting (Sec. 4)                                           DLE)
FedTHE (a BTFL bundle,      local head on labeled (x, y); per-batch head ensemble        y
``method="FedTHE"``)        while predicting (``edge_sdk.fedthe``)
==========================  ==========================================================  =====================

BTFL and FedTHE are stream methods: ``predict`` treats its batch as the next samples of the stream (their state
moves on); the others are stateless after ``personalize`` (except a batch-normalised bundle under the
``"ema"`` rule, whose adaptation steps update the statistics that later predictions use). Raw inputs: when the bundle's manifest carries a
``preprocess`` block (resize, scaling, mean/std written by the exporter), every ``x`` given to the device is a
raw image batch (uint8 or float, the layout the recipe named) and the device applies that preprocessing first
(:attr:`Device.preprocess`); without one (or an identity one) ``x`` is already the model's float32 NCHW input. The older entry points (:class:`edge_sdk.personalize.Personalizer`,
:class:`edge_sdk.btfl_device.BTFLDevice`, :func:`edge_sdk.fedthe.fedthe_predict`) stay available.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_sdk.btfl_device import BTFLDevice
from edge_sdk.bundle import Bundle, BundleError, load_bundle
from edge_sdk.fedthe import feature_history, fedthe_predict
from edge_sdk.numerics import log_softmax
from edge_sdk.personalize import Personalizer
from edge_sdk.preprocess import Preprocess
from edge_sdk.signing import PublicKey

if TYPE_CHECKING:
    from edge_sdk.client import EdgeClient

__all__ = ["Adaptation", "Device", "open_bundle"]


@dataclass
class Adaptation:
    """What :meth:`Device.personalize` did: the method, steps taken, samples used, method-specific details."""

    method: str
    steps: int
    samples: int
    details: dict[str, Any] = field(default_factory=dict)


class Device:
    """A verified bundle ready on the device; build it with :func:`open_bundle`."""

    def __init__(self, bundle: Bundle, method: str | None = None, client: EdgeClient | None = None,
                 threads: int | None = 1, int8: bool = False) -> None:
        self.bundle, self.client, self.preprocess = bundle, client, _preprocess(bundle)
        stream = bundle.device_step == "btfl"  # BTFL's two heads on one frozen feature graph
        if method == "FedTHE" and not stream:
            raise BundleError(f"FedTHE runs on a BTFL bundle (two heads on one feature), not on a {bundle.method} "
                              "bundle")
        if method not in (None, "none", "FedTHE", bundle.method):
            raise BundleError(f"a {bundle.method} bundle cannot run {method}; open it with method=None "
                              f"({bundle.method}) or method='none' (the received model)")
        self.method = bundle.method if method is None else method
        self._btfl = BTFLDevice(bundle, threads) if stream else None
        self._personalizer = None if stream else Personalizer(bundle, threads, int8,
                                                              "none" if self.method == "none" else None)
        self.weights: dict[str, np.ndarray] | None = None  # personalised weights (Personalizer methods)
        self._fedthe: dict[str, np.ndarray] | None = None  # FedTHE: mu_local, mu_global, the feature history

    @property
    def needs_labels(self) -> bool:
        """Whether :meth:`personalize` needs labels (BTFL and FedTHE train a local head)."""
        return self._btfl is not None and self.method != "none"

    @property
    def global_weight(self) -> float | None:
        """BTFL: the weight e of the global head for the last sample predicted (None for other methods)."""
        stream = self._btfl.stream if self._btfl is not None and self.method != "FedTHE" else None
        if stream is None:
            return None
        if stream.last_weight is not None:  # a one-sample call
            return float(stream.last_weight)
        return None if stream.last_weights is None else float(stream.last_weights[-1])

    def prepare(self, x: np.ndarray) -> np.ndarray:
        """The model's input for ``x``: the manifest's preprocessing applied to raw images, else ``x`` itself."""
        return x if self.preprocess is None else self.preprocess.apply(x)

    def personalize(self, x: np.ndarray, y: np.ndarray | None = None, *, epsilon: float = math.inf,
                    delta: float = 0.01, rng: np.random.Generator | None = None) -> Adaptation:
        """Adapt the received model to this device's data ``x`` (labels ``y`` only for BTFL / FedTHE); each call
        starts again from the received model (BTFL / FedTHE: a new local head and a new stream).
        ODPFL-HN: ``epsilon``, ``delta``, ``rng`` privatise the embedding sent to the coordinator."""
        x = self.prepare(x)
        if self._btfl is not None:
            if self.method == "none":
                return Adaptation("none", 0, len(x))
            if y is None:
                raise ValueError(f"{self.method} personalises on labeled data: call personalize(x, y) (it trains "
                                 "the device's local head on the frozen global features)")
            return self._fit_heads(x, np.asarray(y))
        assert self._personalizer is not None
        if self._personalizer.kind == "encoder" and self.client is None:
            raise BundleError("ODPFL-HN needs the coordinator's hypernetwork: open_bundle(bundle, client=EdgeClient)")
        generate = self.client.generate if self.client is not None else None
        result = self._personalizer.personalize(x, generate, epsilon, delta, rng)
        self.weights = result.weights
        details: dict[str, Any] = {"entropy_history": result.entropy_history}
        if result.losses:
            details["contrastive_loss"] = result.losses
        return Adaptation(self.method, result.steps, len(x), details)

    def _fit_heads(self, x: np.ndarray, y: np.ndarray) -> Adaptation:
        assert self._btfl is not None
        fit = self._btfl.fit(x, y)
        details: dict[str, Any] = {"local_head_train_accuracy": fit.train_accuracy}
        if self.method == "FedTHE":
            served = self.bundle.weights("btfl")
            if "mu_global" not in served:
                raise BundleError("this BTFL bundle has no mu_global (the training clients' mean feature FedTHE "
                                  "needs); export it again with this version")
            z, _ = self._btfl.features(x)
            self._fedthe = {"mu_local": z.mean(0), "mu_global": np.asarray(served["mu_global"], dtype=np.float64)}
            return Adaptation("FedTHE", 1, len(x), details)
        global_dle = None
        if self.client is not None:  # the coordinator re-aggregates the DLEs (everyone else's is ours to use)
            reply = self.client.upload_dle(fit.local_dle, fit.samples)
            global_dle = reply["others_dle"] if reply.get("others_dle") is not None else reply["global_dle"]
            details["dle_clients"], details["dle_base"] = reply.get("clients"), reply.get("base")
        self._btfl.start(global_dle)
        return Adaptation(self.method, 1, len(x), details)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits [N, C] (BTFL: log-probabilities of the interpolation) for the batch ``x``. Before
        :meth:`personalize` (or with ``method="none"``): the received model's."""
        x = self.prepare(x)
        if self._btfl is None:
            assert self._personalizer is not None
            return self._personalizer.predict(x, self.weights)
        if self.method == "none" or self._btfl.fit_result is None:
            return self._btfl.global_logits(x)
        if self.method != "FedTHE":
            return self._btfl.logits(x)
        return self._fedthe_logits(x)

    def _fedthe_logits(self, x: np.ndarray) -> np.ndarray:
        """FedTHE on the batch as the next samples of the stream: the feature history carries over calls."""
        assert self._btfl is not None and self._btfl.fit_result is not None and self._fedthe is not None
        z, g = self._btfl.features(x)
        local = z @ self._btfl.fit_result.local_head.T
        s = self._fedthe
        logits, _ = fedthe_predict(g, local, z, s["mu_local"], s["mu_global"], batch_size=len(x),
                                   initial_history=s.get("history"))
        s["history"] = feature_history(z, initial=s.get("history"))[-1]
        return log_softmax(logits)

    def stream(self, samples: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """Predict a stream one sample at a time, in order: yields each sample's logits [C]. ``samples``: an
        array [N, ...] (its rows) or any iterable of single samples."""
        for sample in samples:
            yield self.predict(np.asarray(sample)[None])[0]

    def __repr__(self) -> str:
        return f"Device(method={self.method!r}, bundle={self.bundle.root})"


def open_bundle(bundle: Bundle | str | os.PathLike, *, public_key: PublicKey | None = None,
                method: str | None = None, client: EdgeClient | None = None, threads: int | None = 1,
                int8: bool = False) -> Device:
    """A :class:`Device` for a verified bundle, or for a bundle directory (verified here: signature against
    ``public_key``, every sha256). ``method``: None (the bundle's own), ``"none"`` (the received model as it
    is) or, on a BTFL bundle, ``"FedTHE"``. ``client``: the coordinator, for ODPFL-HN's weights and BTFL's
    DLE exchange. ``int8``: the received model's predictions use ``forward_int8`` when the bundle has one.

    >>> device = open_bundle("runs/bundle", public_key="9f1c...")   # doctest: +SKIP
    >>> device.personalize(x_unlabeled).steps                       # doctest: +SKIP
    1
    """
    if not isinstance(bundle, Bundle):
        bundle = load_bundle(bundle, public_key=public_key)
    return Device(bundle, method, client, threads, int8)


def _preprocess(bundle: Bundle) -> Preprocess | None:
    """The manifest's preprocessing, or None when it has none or it changes nothing (inputs pass as they are)."""
    pre = bundle.preprocess  # validated by load_bundle
    return None if pre == Preprocess.identity() else pre
