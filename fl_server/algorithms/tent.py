"""TENT (Wang et al. 2021) as used by UPFL for new clients: FedAvg training, then entropy minimisation on
the new client's unlabeled data before predicting.

Which parameters (``adapt``): ``"all"`` (default) -- as in UPFL's re-implementation for models without
BatchNorm -- adapts every parameter with plain SGD at the FedAvg learning rate; ``"norm_affine"`` is the
original TENT's choice for a batch-normalised model (``btfl_cnn_bn``): only the normalisation layers' affine
scale and shift move, the rest of the gradient is dropped, and the forward normalises with the test batch's
statistics. The original steps those with Adam (CIFAR) or SGD with momentum (ImageNet); here plain SGD at
``tent_lr``, which the benchmarks choose on validation (one pass of a few batches per client, where momentum
changes little). ``steps`` full-batch steps on the client's whole unlabeled set (default 1), or mini-batches
of ``batch_size`` for one pass when set.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fl_server.algorithms.base import Hyper
from fl_server.algorithms.fedavg import FedAvg, FedAvgConfig
from fl_server.algorithms.losses import entropy_from_logits
from fl_server.functional import State, sgd
from fl_server.models import Classifier
from fl_server.models.norm import StatBatchNorm2d

ADAPT = ("all", "norm_affine")


@dataclass
class TentConfig(FedAvgConfig):
    tent_lr: float | None = None  # None: the FedAvg learning rate (UPFL Table 4)
    steps: int = 1
    batch_size: int | None = None  # None: full batch
    adapt: str = "all"  # "all" | "norm_affine" (the original TENT's, for batch-normalised models)


class Tent(FedAvg):
    name = "TENT"
    Config = TentConfig
    adapts_at_test_time = True

    def __init__(self, model: Classifier, config: Hyper | None = None, seed: int = 0, **overrides: Any) -> None:
        super().__init__(model, config, seed, **overrides)
        if self.hp.adapt not in ADAPT:
            raise ValueError(f"TENT adapt must be one of {', '.join(ADAPT)}, got {self.hp.adapt!r}")
        affine = {f"{name}.{p}" for name, m in self.model.named_modules() if isinstance(m, StatBatchNorm2d)
                  for p in ("weight", "bias")}
        if self.hp.adapt == "norm_affine" and not affine:
            raise ValueError("TENT adapt='norm_affine' needs a batch-normalised model (e.g. btfl_cnn_bn)")
        self._frozen = set() if self.hp.adapt == "all" else set(dict(self.model.named_parameters())) - affine

    def entropy_step(self, params: State, x: torch.Tensor) -> State:
        lr = self.hp.tent_lr if self.hp.tent_lr is not None else self.hp.lr
        grads = torch.func.grad(lambda p: entropy_from_logits(self.forward(p, x)).mean())(params)
        grads = {n: torch.zeros_like(g) if n in self._frozen else g for n, g in grads.items()}
        return sgd(params, grads, lr)

    def personalize(self, server_state: State, x: torch.Tensor) -> State:
        params = server_state["params"]
        bs = self.hp.batch_size or len(x)
        for _ in range(self.hp.steps):
            for start in range(0, len(x), bs):
                params = self.entropy_step(params, x[start:start + bs])
        return params
