"""edge_sdk: torch-free device SDK (numpy + onnxruntime) for federated test-time adaptation."""
from edge_sdk import btfl, dp, fedthe, tensors
from edge_sdk.client import EdgeClient, EdgeClientError
from edge_sdk.early_stopping import EntropyEarlyStopping
from edge_sdk.numerics import entropy, log_softmax, softmax

__version__ = "0.1.0"
__all__ = ["EdgeClient", "EdgeClientError", "EntropyEarlyStopping", "btfl", "dp", "entropy", "fedthe", "log_softmax",
           "softmax", "tensors", "__version__"]
