"""edge_sdk: torch-free device SDK (numpy + onnxruntime) for federated test-time adaptation.

    device = edge_sdk.open_bundle("bundle/", public_key=KEY)   # any method: edge_sdk.device
    device.personalize(x_unlabeled)
    logits = device.predict(x_new)
"""
from edge_sdk import btfl, dp, fedthe, tensors
from edge_sdk.client import EdgeClient, EdgeClientError
from edge_sdk.early_stopping import EntropyEarlyStopping
from edge_sdk.numerics import entropy, log_softmax, softmax

__version__ = "0.1.0"
_DEVICE = ("Adaptation", "Device", "open_bundle")  # imported on first use: they load onnxruntime


def __getattr__(name: str) -> object:
    if name in _DEVICE:
        from edge_sdk import device

        return getattr(device, name)
    raise AttributeError(f"module 'edge_sdk' has no attribute {name!r}")


__all__ = ["Adaptation", "Device", "EdgeClient", "EdgeClientError", "EntropyEarlyStopping", "btfl", "dp", "entropy",
           "fedthe", "log_softmax", "open_bundle", "softmax", "tensors", "__version__"]
