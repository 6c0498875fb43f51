"""Recipes that combine two methods.

MAP -> BTFL (the papers are cited in :mod:`fl_server.algorithms.map` and :mod:`fl_server.algorithms.btfl`): MAP
trained with ``head_only_stage2`` personalises only the classifier on the frozen global features, so each client's
HPM classifier (:meth:`MAP.local_heads`) is a linear head on the global feature extractor -- exactly the role of
BTFL's local head. BTFL's test-time machinery (local and global DLEs on the global features, the heads' mean
training entropies, the Bayesian interpolation of :class:`edge_sdk._btfl.BTFLStream`) then runs unchanged, with
MAP's personalised model as the local head and MAP's aggregated model as the global head.
"""
from __future__ import annotations

import numpy as np
import torch

from fl_server.algorithms.btfl import BTFL, ClientArtifacts
from fl_server.algorithms.map import MAP
from fl_server.functional import State


def map_btfl_artifacts(map_alg: MAP, map_state: State, x: torch.Tensor, train: list[np.ndarray],
                       dle_levels: int = 2) -> list[ClientArtifacts]:
    """Per training client, BTFL's test-time artifacts with MAP's global model as the global head and the
    client's HPM classifier (weight and bias) as the local head."""
    if not map_alg.hp.head_only_stage2:
        raise ValueError("MAP -> BTFL needs MAP trained with head_only_stage2=True: otherwise the HPM models are "
                         "whole networks, not heads on the global features")
    if not map_alg.hp.hpm:
        raise ValueError("MAP -> BTFL needs the HPM (hpm=True): it holds the clients' personalised heads")
    btfl = BTFL(map_alg.model, dle_levels=dle_levels)
    return btfl.client_artifacts({"params": map_state["params"]}, x, train, local_heads=map_alg.local_heads(map_state))
