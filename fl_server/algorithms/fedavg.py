"""FedAvg (McMahan et al. 2017): local SGD on cross-entropy, server averages weighted by sample count.
The :class:`~fl_server.algorithms.base.Algorithm` default; ``local_momentum`` adds local SGD momentum (the buffer
is created here, the step is the base class's :func:`~fl_server.functional.sgd_step`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fl_server.algorithms.base import Algorithm, Hyper, register
from fl_server.functional import State, tree_map


@dataclass
class FedAvgConfig(Hyper):
    lr: float = 0.1  # UPFL Table 4: MNIST 0.1, Fashion-MNIST 0.3
    # momentum of the clients' local SGD, its buffer zero at the start of every round (the ODPFL-HN paper's
    # FedAvg baseline: 0.5, its App. hyperparameters); 0: plain SGD, the UPFL protocol
    local_momentum: float = field(default=0.0, metadata={"fingerprint": "omit_default"})


@register
class FedAvg(Algorithm):
    name = "FedAvg"
    servable = True  # the received model, plain inference on the device
    graph_safe = True
    Config = FedAvgConfig

    def client_start(self, server_state: State, ids: np.ndarray) -> State:
        state = super().client_start(server_state, ids)
        if self.hp.local_momentum:
            state["mom"] = tree_map(torch.zeros_like, state["params"])
        return state
