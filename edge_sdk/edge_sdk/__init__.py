"""edge_sdk: torch-free device SDK (numpy + onnxruntime) for federated test-time adaptation.

Submodules and names load on first use (PEP 562), so ``import edge_sdk`` stays cheap on a device: httpx is
imported by the first use of :class:`EdgeClient`, onnxruntime by the first session.

Example::

    import edge_sdk
    client = edge_sdk.EdgeClient("https://coordinator:8000", public_key="<hex key>")
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = {"btfl", "dp", "fedthe", "tensors"}
_NAMES = {
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
