"""edge_sdk: torch-free device SDK (numpy + onnxruntime) for federated test-time adaptation.

One entry point for every method: the bundle's method decides how the device personalises and predicts::

    device = edge_sdk.open_bundle("bundle/", public_key=KEY)   # any method: edge_sdk.device
    device.personalize(x_unlabeled)
    logits = device.predict(x_new)

Submodules and names load on first use (PEP 562), so ``import edge_sdk`` stays cheap on a device: httpx is
imported by the first use of :class:`EdgeClient`, onnxruntime by the first session.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = {"btfl", "dp", "fedthe", "tensors"}
_NAMES = {
    "Adaptation": "edge_sdk.device",
    "Bundle": "edge_sdk.bundle",
    "BundleError": "edge_sdk.errors",
    "load_bundle": "edge_sdk.bundle",
    "ModelRunner": "edge_sdk._runners",
    "Runner": "edge_sdk._registry",
    "StepRunner": "edge_sdk.steps",
    "register_runner": "edge_sdk._registry",
    "Device": "edge_sdk.device",
    "open_bundle": "edge_sdk.device",
    "EdgeClient": "edge_sdk.client",
    "EdgeClientError": "edge_sdk.client",
    "EntropyEarlyStopping": "edge_sdk.early_stopping",
    "entropy": "edge_sdk.numerics",
    "log_softmax": "edge_sdk.numerics",
    "softmax": "edge_sdk.numerics",
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
