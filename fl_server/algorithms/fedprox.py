"""FedProx (Li et al. 2020): local loss CE + mu/2 ||psi - psi_server||^2."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_server.algorithms.base import Algorithm, Hyper, register
from fl_server.functional import State


@dataclass
class FedProxConfig(Hyper):
    lr: float = 0.3  # UPFL Table 4 (MNIST and Fashion-MNIST)
    mu: float = 0.001


@register
class FedProx(Algorithm):
    name = "FedProx"
    graph_safe = True
    Config = FedProxConfig

    def loss(self, params: State, server_state: State, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        prox = sum(((p - q) ** 2).sum() for p, q in zip(params.values(), server_state["params"].values()))
        return super().loss(params, server_state, x, y) + 0.5 * self.hp.mu * prox
