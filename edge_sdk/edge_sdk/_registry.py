"""The runner registry: one runner class per device step kind, chosen from the bundle's manifest.

A bundle's manifest names its ``device_step`` (``Algorithm.device_step`` of the method that trained it); the
device runs ``RUNNERS[(device_step or "none", None)]``. A variant ``(kind, name)`` is another way to run the same
kind of bundle, chosen with ``open_bundle(..., method=name)``; ``method="none"`` runs the received model
(the kind's own ``"none"`` variant where it registers one, else the ``"none"`` runner). Nothing here knows a
method by name: :func:`register_runner` is how the SDK's own runners (:mod:`edge_sdk._runners`) and a user's
are found.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np

from edge_sdk._errors import BundleError

if TYPE_CHECKING:
    from edge_sdk._bundle import Bundle
    from edge_sdk._client import EdgeClient
    from edge_sdk.safeguard import SafeguardDecision

__all__ = ["Adaptation", "RECEIVED", "RUNNERS", "Runner", "register_runner", "resolve"]

RECEIVED = "none"  # the kind of a bundle without a device step, and the method name of the received model


@dataclass
class Adaptation:
    """What :meth:`Device.personalize` did: the method, the gradient steps behind the weights it now uses
    (FedTTA++'s early stopping: the chosen iterate's step; ``details["entropy_history"]``, where a runner keeps
    one, has the received model's entropy and one entry per step run), samples used, method-specific details,
    and the safeguard's decision (``safeguard.action``: "personalised", "partial" or "received"; None where no
    rule ran)."""

    method: str
    steps: int
    samples: int
    details: dict[str, Any] = field(default_factory=dict)
    safeguard: SafeguardDecision | None = None


class Runner:
    """What :class:`edge_sdk.Device` calls for one device step kind (register a subclass, or any class with the
    same calls, with :func:`register_runner`). ``Device`` applies the manifest's preprocessing first: every ``x``
    a runner gets is the model's float32 input.

    Optional attributes ``Device`` reads: ``needs_labels`` (``personalize`` needs ``y``), ``weights`` (the
    personalised weights, if the runner has a weight set), ``global_weight`` (a stream runner's last weight of
    its global head)."""

    needs_labels: bool = False
    weights: dict[str, np.ndarray] | None = None
    global_weight: float | None = None

    def __init__(self, bundle: Bundle, *, threads: int | None = 1, int8: bool = False,
                 client: EdgeClient | None = None) -> None:
        self.bundle, self.threads, self.int8, self.client = bundle, threads, int8, client

    def personalize(self, x: np.ndarray, y: np.ndarray | None = None, **options: Any) -> Adaptation:
        """Adapt to the device's data ``x`` (labels ``y`` if ``needs_labels``); each call starts again from the
        received model."""
        raise NotImplementedError(f"{type(self).__name__} does not implement personalize(x, y=None, **options)")

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits [N, C] for the batch ``x`` (a stream runner treats it as the next samples of its stream)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement predict(x)")


RunnerClass = Callable[..., Any]
RUNNERS: dict[tuple[str, str | None], RunnerClass] = {}
_R = TypeVar("_R", bound=RunnerClass)


def register_runner(kind: str, *, variant: str | None = None, replace: bool = False) -> Callable[[_R], _R]:
    """Class decorator: the runner of bundles whose manifest names ``device_step == kind`` (``variant``: the
    runner ``open_bundle(..., method=variant)`` picks for such a bundle instead). A kind (and variant) already
    registered raises ValueError unless ``replace=True``."""
    if not (isinstance(kind, str) and 0 < len(kind) <= 64):
        raise ValueError(f"a runner's kind must be a device step name (1-64 characters), got {kind!r}")
    if variant is not None and not (isinstance(variant, str) and variant):
        raise ValueError(f"a runner's variant must be a method name or None, got {variant!r}")

    def decorate(cls: _R) -> _R:
        key = (kind, variant)
        if key in RUNNERS and not replace and RUNNERS[key] is not cls:
            taken = RUNNERS[key]
            raise ValueError(f"the device step {kind!r}{f' (variant {variant!r})' if variant else ''} already has "
                             f"the runner {taken.__module__}.{taken.__qualname__}; pass replace=True to replace it")
        RUNNERS[key] = cls
        return cls

    return decorate


def resolve(bundle: Bundle, method: str | None) -> tuple[RunnerClass, str]:
    """(runner class, method name the device reports) for ``bundle`` opened with ``method``: None or the
    bundle's own method (its kind's runner), ``"none"`` (the received model) or a variant of its kind."""
    kind = bundle.device_step or RECEIVED
    if method is None or method == bundle.method:
        key: tuple[str, str | None] = (kind, None)
    elif (kind, method) in RUNNERS:
        key = (kind, method)
    elif method == RECEIVED:
        key = (RECEIVED, None)
    else:
        variants = sorted(v for k, v in RUNNERS if k == kind and v is not None and v != RECEIVED)
        choices = ", ".join([f"None ({bundle.method})", repr(RECEIVED), *map(repr, variants)])
        elsewhere = sorted(k for k, v in RUNNERS if v == method)
        where = f"; {method} runs on bundles whose device step is {' or '.join(map(repr, elsewhere))}" \
            if elsewhere else ""
        raise BundleError(f"a {bundle.method} bundle (device step {kind!r}) cannot run {method}{where}: open it "
                          f"with method= one of {choices}")
    runner = RUNNERS.get(key)
    if runner is None:
        raise BundleError(f"this SDK has no runner for the device step {kind!r} of this {bundle.method} bundle: "
                          "update edge_sdk, or register one with @edge_sdk.register_runner("
                          f"{kind!r})")
    return runner, bundle.method if method is None else method
