"""edge_sdk: torch-free device SDK (numpy + onnxruntime) for federated test-time adaptation.

One way in for every method: the bundle's device step decides how the device personalises and predicts::

    device = edge_sdk.open_bundle("bundle/", public_key=KEY)
    device.personalize(x_unlabeled)          # BTFL / FedTHE: personalize(x, y)
    logits = device.predict(x_new)

A new device step kind gets its runner with :func:`register_runner` (subclass :class:`Runner`, or
:class:`ModelRunner` to reuse the forward graph, its weights and batch normalisation). Everything else is private
(``edge_sdk._*``); the public modules are this one, :mod:`edge_sdk.signing` (keys and signed releases),
:mod:`edge_sdk.safeguard` (keep the received model when adaptation moved too far) and :mod:`edge_sdk.shared` (the
formats and math the coordinator shares with the device).

Names load on first use (PEP 562), so ``import edge_sdk`` stays cheap on a device: httpx is imported by the first
use of :class:`EdgeClient`, onnxruntime by the first session.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = {"safeguard", "shared", "signing"}
_NAMES = {
    "Adaptation": "edge_sdk._registry",
    "Device": "edge_sdk._device",
    "open_bundle": "edge_sdk._device",
    "Bundle": "edge_sdk._bundle",
    "load_bundle": "edge_sdk._bundle",
    "UnverifiedSignatureWarning": "edge_sdk._bundle",
    "BundleError": "edge_sdk._errors",
    "BundleExpiredError": "edge_sdk._errors",
    "BundleRollbackError": "edge_sdk._errors",
    "BundleSignatureError": "edge_sdk._errors",
    "EdgeClient": "edge_sdk._client",
    "EdgeClientError": "edge_sdk._client",
    "TrustOnFirstUseWarning": "edge_sdk._client",
    "StaleReleaseWarning": "edge_sdk._client",
    "Preprocess": "edge_sdk._preprocess",
    "InputScaleWarning": "edge_sdk._preprocess",
    "Runner": "edge_sdk._registry",
    "register_runner": "edge_sdk._registry",
    "ModelRunner": "edge_sdk._runners",
    "StepRunner": "edge_sdk._steps",
    "EntropyEarlyStopping": "edge_sdk._early_stopping",
    "entropy": "edge_sdk._numerics",
    "log_softmax": "edge_sdk._numerics",
    "softmax": "edge_sdk._numerics",
}
__all__ = sorted([*_NAMES, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"edge_sdk.{name}")
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'edge_sdk' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
