"""TENT (Wang et al. 2021) as used by UPFL for new clients: FedAvg training, then entropy minimisation on
the new client's unlabeled data before predicting.

Which parameters: the zoo's models have no BatchNorm, so -- as in UPFL's re-implementation -- TENT adapts
*all* parameters with plain SGD at the FedAvg learning rate (the original TENT adapts only BN affine
parameters with Adam 1e-3). ``steps`` full-batch steps on the client's whole unlabeled set (default 1), or
mini-batches of ``batch_size`` for one pass when set.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_server.algorithms.fedavg import FedAvg, FedAvgConfig
from fl_server.algorithms.losses import entropy_from_logits
from fl_server.functional import State, sgd


@dataclass
class TentConfig(FedAvgConfig):
    tent_lr: float | None = None  # None: the FedAvg learning rate (UPFL Table 4)
    steps: int = 1
    batch_size: int | None = None  # None: full batch


class Tent(FedAvg):
    name = "TENT"
    Config = TentConfig
    adapts_at_test_time = True

    def entropy_step(self, params: State, x: torch.Tensor) -> State:
        lr = self.hp.tent_lr if self.hp.tent_lr is not None else self.hp.lr
        grads = torch.func.grad(lambda p: entropy_from_logits(self.forward(p, x)).mean())(params)
        return sgd(params, grads, lr)

    def personalize(self, server_state: State, x: torch.Tensor) -> State:
        params = server_state["params"]
        bs = self.hp.batch_size or len(x)
        for _ in range(self.hp.steps):
            for start in range(0, len(x), bs):
                params = self.entropy_step(params, x[start:start + bs])
        return params
