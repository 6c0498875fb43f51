"""What crosses the wire between the Flower ServerApp and ClientApp: model states as ``ArrayRecord`` (the
engine's flat ``"key/name"`` arrays, dtype kept, no pickle) and a message's scalars as ``ConfigRecord``.

Example:
    >>> import torch
    >>> state = {"params": {"w": torch.ones(2, dtype=torch.float64)}}
    >>> record_to_state(state_to_record(state))["params"]["w"].dtype
    torch.float64
"""
from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fl_server.functional import State, from_numpy_flat, to_numpy_flat


def state_to_record(state: State) -> ArrayRecord:
    """A (nested) state of tensors as one ``ArrayRecord`` keyed by the flat names of ``to_numpy_flat``."""
    return ArrayRecord({k: Array(np.array(v, order="C")) for k, v in to_numpy_flat(state).items()})


def record_to_state(record: ArrayRecord, device: torch.device | None = None) -> State:
    """Inverse of :func:`state_to_record`."""
    return from_numpy_flat({k: record[k].numpy() for k in record}, device)
