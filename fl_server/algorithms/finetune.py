"""FedAvg+FT: the FedAvg model fine-tuned by each training client on its own labeled training data.
A new client has no labels, so it receives the global model (same as FedAvg)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fl_server.algorithms.base import LocalTrainer, register
from fl_server.algorithms.fedavg import FedAvg, FedAvgConfig
from fl_server.functional import State


@dataclass
class FedAvgFTConfig(FedAvgConfig):
    ft_iterations: int = 20  # local SGD iterations of fine-tuning (one round's worth by default)


@register
class FedAvgFT(FedAvg):
    name = "FedAvg+FT"
    servable = False  # its fine-tuning needs labels a new device does not have
    Config = FedAvgFTConfig

    def val_params(self, server_state: State, ids: np.ndarray, trainer: LocalTrainer) -> State:
        states = self.client_start(server_state, ids)
        return trainer(self.local_step, states, server_state, ids, self.hp.ft_iterations)["params"]
