"""TENT (Wang et al. 2021) as used by UPFL for new clients: FedAvg training, then entropy minimisation on
the new client's unlabeled data before predicting.

Which parameters (``adapt``): ``"all"`` (default) -- as in UPFL's re-implementation for models without
BatchNorm -- adapts every parameter with plain SGD at the FedAvg learning rate; ``"norm_affine"`` is the
original TENT's choice for a normalised model (``btfl_cnn_bn``, ``resnet8_bn``, ``mobilenet_s``, ``resnet8_gn``):
only the normalisation layers' affine scale and shift move (the gradient is taken for them alone) -- BatchNorm
(:class:`StatBatchNorm2d`; a user's ``nn.BatchNorm2d`` after ``fl_server.models.norm.convert_batchnorm``),
``nn.GroupNorm`` and ``nn.LayerNorm`` (with ``elementwise_affine``). Which statistics the normalisation uses is the
caller's choice (``fl_server.models.norm.norm_mode``; the fedicon-shift benchmark uses the test batch's, as the
original TENT). The original steps those parameters with Adam (CIFAR) or SGD with momentum (ImageNet); here plain SGD at
``tent_lr``, which the benchmarks choose on validation (one pass of a few batches per client, where momentum
changes little). ``steps`` full-batch steps on the client's whole unlabeled set (default 1), or mini-batches
of ``batch_size`` for one pass when set.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fl_server.algorithms.base import Hyper, register
from fl_server.algorithms.fedavg import FedAvg, FedAvgConfig
from fl_server.algorithms.losses import entropy_from_logits
from fl_server.functional import State, grad, sgd
from fl_server.models import Classifier
from fl_server.models.norm import StatBatchNorm2d

ADAPT = ("all", "norm_affine")
NORM_LAYERS = (StatBatchNorm2d, nn.GroupNorm, nn.LayerNorm)  # whose affine parameters "norm_affine" adapts


def norm_affine_names(model: nn.Module) -> list[str]:
    """Parameter names of the normalisation layers' affine scale and shift (TENT's adapted parameters).

    >>> norm_affine_names(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    ['1.weight', '1.bias']
    """
    return [f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, NORM_LAYERS)
            for p, value in (("weight", getattr(m, "weight", None)), ("bias", getattr(m, "bias", None)))
            if isinstance(value, nn.Parameter)]


@dataclass
class TentConfig(FedAvgConfig):
    tent_lr: float | None = None  # None: the FedAvg learning rate (UPFL Table 4)
    steps: int = 1
    batch_size: int | None = None  # None: full batch
    adapt: str = "all"  # "all" | "norm_affine" (the original TENT's, for batch-normalised models)


@register
class Tent(FedAvg):
    # the label-free safeguard rule chosen on validation shifts only (lab/safeguard_choice.py;
    # docs/results/safeguard-choice.json), applied by the device after personalising
    safeguard = {"rule": "disagreement", "threshold": 0.2}
    name = "TENT"
    default_job = True  # trained by a coordinator with an empty store
    device_step = "tent_step"
    servable = True
    Config = TentConfig
    adapts_at_test_time = True

    def __init__(self, model: Classifier, config: Hyper | None = None, seed: int = 0, **overrides: Any) -> None:
        super().__init__(model, config, seed, **overrides)
        if self.hp.adapt not in ADAPT:
            raise ValueError(f"TENT adapt must be one of {', '.join(ADAPT)}, got {self.hp.adapt!r}")
        self._affine = norm_affine_names(self.model)
        if self.hp.adapt == "norm_affine" and not self._affine:
            raise ValueError("TENT adapt='norm_affine' needs a model with affine normalisation layers "
                             "(BatchNorm, GroupNorm or LayerNorm; e.g. btfl_cnn_bn)")

    def entropy_step(self, params: State, x: torch.Tensor) -> State:
        """One SGD step on the mean prediction entropy of ``x``, over the parameters ``hp.adapt`` names."""
        lr = self.hp.tent_lr if self.hp.tent_lr is not None else self.hp.lr
        moving = params if self.hp.adapt == "all" else {n: params[n] for n in self._affine}
        grads = grad(lambda m: entropy_from_logits(self.forward({**params, **m}, x)).mean())(moving)
        return {**params, **sgd(moving, grads, lr)}

    def personalize(self, server_state: State, x: torch.Tensor) -> State:
        params = server_state["params"]
        bs = self.hp.batch_size or len(x)
        for _ in range(self.hp.steps):
            for start in range(0, len(x), bs):
                params = self.entropy_step(params, x[start:start + bs])
        return params
