"""FedAvg (McMahan et al. 2017): local SGD on cross-entropy, server averages weighted by sample count.
All behaviour is the :class:`~fl_server.algorithms.base.Algorithm` default."""
from __future__ import annotations

from dataclasses import dataclass

from fl_server.algorithms.base import Algorithm, Hyper


@dataclass
class FedAvgConfig(Hyper):
    lr: float = 0.1  # UPFL Table 4: MNIST 0.1, Fashion-MNIST 0.3


class FedAvg(Algorithm):
    name = "FedAvg"
    Config = FedAvgConfig
