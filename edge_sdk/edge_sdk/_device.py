"""One device interface for every method: the bundle's method decides how the device personalises and predicts.

    import edge_sdk

    with edge_sdk.EdgeClient(url, public_key=KEY) as client:
        device = edge_sdk.open_bundle(client.download(method="TENT"), client=client)
        device.personalize(x_warmup)          # unlabeled; BTFL / FedTHE also take labels: (x, y)
        logits = device.predict(x_new)        # [N, C]
        for row in device.stream(x_stream):   # one sample at a time, in order
            ...

    device = edge_sdk.open_bundle("runs/bundle", public_key=KEY)   # a bundle directory works the same way

What happens behind the same calls is the runner of the bundle's device step (``manifest["device_step"]``,
chosen through :func:`edge_sdk.register_runner`'s registry, never by method name; the SDK's own runners are
listed in :mod:`edge_sdk._runners`). ``method=`` picks the received model (``"none"``) or a variant the registry
holds for that kind (a BTFL bundle also runs FedTHE).

Stream runners (BTFL, FedTHE) treat each ``predict`` batch as the next samples of the stream (their state
moves on); the others are stateless after ``personalize`` (except a batch-normalised bundle under the
``"ema"`` rule, whose adaptation steps update the statistics that later predictions use). Raw inputs: when the bundle's manifest carries a
``preprocess`` block (resize, scaling, mean/std written by the exporter), every ``x`` given to the device is a
raw image batch (uint8 or float, the layout the recipe named) and the device applies that preprocessing first
(:attr:`Device.preprocess`); without one (or an identity one) ``x`` is already the model's float32 NCHW input.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

import edge_sdk._runners  # noqa: F401  (registers the SDK's own runners)
from edge_sdk._bundle import Bundle, load_bundle
from edge_sdk._dp import check_budget
from edge_sdk._memory import release_free_heap
from edge_sdk._preprocess import Preprocess
from edge_sdk._registry import RECEIVED, Adaptation, resolve
from edge_sdk.safeguard import SafeguardRule, evidence, shifted
from edge_sdk.signing import PublicKey

if TYPE_CHECKING:
    from edge_sdk._client import EdgeClient

__all__ = ["Adaptation", "Device", "open_bundle"]


class Device:
    """A verified bundle ready on the device; build it with :func:`open_bundle`. Every call goes to the runner
    of the bundle's device step (``self.runner``) after the manifest's preprocessing."""

    def __init__(self, bundle: Bundle, method: str | None = None, client: EdgeClient | None = None,
                 threads: int | None = 1, int8: bool = False, safeguard: SafeguardRule | bool = True) -> None:
        self.bundle, self.client, self.preprocess = bundle, client, _preprocess(bundle)
        runner, self.method = resolve(bundle, method)
        self.runner = runner(bundle, threads=threads, int8=int8, client=client)
        rule = bundle.safeguard if safeguard is True else (safeguard or None)
        if rule is not None and not isinstance(rule, SafeguardRule):
            raise TypeError(f"safeguard is True (the bundle's rule), False (none) or a SafeguardRule, got {rule!r}")
        # the rule applies to runners that personalise a weight set they can roll back (ModelRunner's kind)
        guarded = hasattr(self.runner, "roll_back") and self.method != RECEIVED
        self.safeguard: SafeguardRule | None = rule if guarded else None

    @property
    def needs_labels(self) -> bool:
        """Whether :meth:`personalize` needs labels (BTFL and FedTHE train a local head)."""
        return bool(getattr(self.runner, "needs_labels", False))

    @property
    def global_weight(self) -> float | None:
        """A stream runner's weight of its global head for the last sample predicted (BTFL's e), else None."""
        return getattr(self.runner, "global_weight", None)

    @property
    def weights(self) -> dict[str, np.ndarray] | None:
        """The personalised weights of a runner that has a weight set (None before :meth:`personalize`)."""
        return getattr(self.runner, "weights", None)

    def prepare(self, x: np.ndarray) -> np.ndarray:
        """The model's input for ``x``: the manifest's preprocessing applied to raw images, else ``x`` itself."""
        return x if self.preprocess is None else self.preprocess.apply(x)

    def personalize(self, x: np.ndarray, y: np.ndarray | None = None, **options: Any) -> Adaptation:
        """Adapt the received model to this device's data ``x`` (labels ``y`` where :attr:`needs_labels`); each
        call starts again from the received model (a stream runner: a new local head and a new stream).
        ``options`` go to the runner (the ``"encoder"`` runner: ``epsilon``, ``delta``, ``rng`` privatise the
        embedding sent to the coordinator).

        The safeguard (:attr:`safeguard`, the bundle's declared rule unless ``open_bundle(..., safeguard=...)``
        says otherwise) then compares the received and the personalised model on ``x`` without labels and keeps
        the received one when its rule says adaptation looks harmful; ``Adaptation.safeguard`` holds the decision
        and its evidence (``.message`` is one line for a person). A rule that always keeps the received model
        (``rollback``, not partial) adapts nothing: no steps run and nothing is sent to the coordinator."""
        try:
            x = self.prepare(x)
            self._check_inputs(x, y, options)  # before the safeguard may skip the runner: never ignored
            return self._personalize(x, y, **options)
        finally:
            release_free_heap()  # what the steps freed goes back to the system (edge_sdk._memory)

    def _check_inputs(self, x: Any, y: np.ndarray | None, options: dict[str, Any]) -> None:
        """Labels only for a runner that learns from them, one integer class per sample; a privacy budget
        (``epsilon``, ``delta``) that is one, whether or not this call ends up sending anything. (``x`` itself is
        the runner's to check: its graph's input.)"""
        n = len(x) if isinstance(x, np.ndarray) and x.ndim else None
        if y is not None:
            if not self.needs_labels:
                what = "the received model" if self.method == RECEIVED else self.method
                raise ValueError(f"{what} takes no labels: call personalize(x) (y is for a runner that learns from "
                                 f"them: Device.needs_labels)")
            labels = np.asarray(y)
            if n is not None and (labels.shape != (n,) or labels.dtype.kind not in "iu"):
                raise ValueError(f"y must be [N] integer class labels, one per sample of x (N={n}), got "
                                 f"{labels.dtype} of shape {list(labels.shape)}")
        if "epsilon" in options or "delta" in options:
            check_budget(options.get("epsilon", math.inf), options.get("delta", 0.01))

    def _personalize(self, x: np.ndarray, y: np.ndarray | None, **options: Any) -> Adaptation:
        rule = self.safeguard
        if rule is None or rule.kind == "off":
            return replace(self.runner.personalize(x, y, **options), method=self.method)
        runner = self.runner
        if rule.keeps_received:  # it keeps the received model whatever adaptation does:
            runner.logits(x, runner.base)  # so nothing is adapted (no steps, no embedding sent to the coordinator);
            runner.roll_back()  # the batch is checked all the same (a bad one fails as adapting would fail)
            return Adaptation(self.method, 0, len(x), {"skipped": f"the safeguard rule {rule.name} always keeps "
                                                                  f"the received model"}, rule.decide({}))
        received = runner.logits(x, runner.base)
        received_shifted = runner.logits(xs, runner.base) if rule.needs_shift and (xs := shifted(x)) is not None \
            else None
        result = runner.personalize(x, y, **options)
        adapted = runner.predict(x)
        adapted_shifted = runner.predict(xs) if received_shifted is not None else None
        decision = rule.decide(evidence(received, adapted, received_shifted, adapted_shifted))
        if decision.action == "received":
            runner.roll_back()
        elif decision.action == "partial":
            runner.keep_partially()
        return replace(result, method=self.method, safeguard=decision)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits [N, C] (stream runners: log-probabilities) for the batch ``x``. Before :meth:`personalize`
        (or with ``method="none"``): the received model's."""
        return self.runner.predict(self.prepare(x))

    def stream(self, samples: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """Predict a stream one sample at a time, in order: yields each sample's logits [C]. ``samples``: an
        array [N, ...] (its rows) or any iterable of single samples."""
        for sample in samples:
            yield self.predict(np.asarray(sample)[None])[0]

    def __repr__(self) -> str:
        return f"Device(method={self.method!r}, bundle={self.bundle.root})"


def open_bundle(bundle: Bundle | str | os.PathLike, *, public_key: PublicKey | None = None,
                method: str | None = None, client: EdgeClient | None = None, threads: int | None = 1,
                int8: bool = False, safeguard: SafeguardRule | bool = True) -> Device:
    """A :class:`Device` for a verified bundle, or for a bundle directory (verified here: signature against
    ``public_key``, every sha256). ``method``: None (the bundle's own), ``"none"`` (the received model as it
    is) or a variant registered for the bundle's device step (on a BTFL bundle, ``"FedTHE"``). ``client``: the coordinator, for ODPFL-HN's weights and BTFL's
    DLE exchange. ``int8``: the received model's predictions use ``forward_int8`` when the bundle has one.
    ``safeguard``: True (the rule the bundle's method declared, :attr:`Bundle.safeguard`), False (never roll
    back) or a :class:`edge_sdk.safeguard.SafeguardRule` of your own.

    >>> device = open_bundle("runs/bundle", public_key="9f1c...")   # doctest: +SKIP
    >>> device.personalize(x_unlabeled).steps                       # doctest: +SKIP
    1
    """
    if not isinstance(bundle, Bundle):
        bundle = load_bundle(bundle, public_key=public_key)
    return Device(bundle, method, client, threads, int8, safeguard)


def _preprocess(bundle: Bundle) -> Preprocess | None:
    """The manifest's preprocessing, or None when it has none or it changes nothing (inputs pass as they are)."""
    pre = bundle.preprocess  # validated by load_bundle
    return None if pre == Preprocess.identity() else pre
