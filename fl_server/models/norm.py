"""Batch normalisation for the functional engine: :class:`StatBatchNorm2d` (affine parameters only, no buffers).

The engine's states are parameter pytrees (``fl_server.functional``: no buffers, so no running statistics updated
inside vmapped or differentiated steps). So the normalisation statistics live outside the state:
- ``mode="batch"`` (training, and test-time adaptation): the batch's own mean and variance, as BatchNorm in
  train mode;
- ``mode="population"``: the statistics fixed by :func:`calibrate` -- the mean and (biased) variance of the layer's
  input over every training sample, computed with the final global model (what FedAvg's averaged running
  statistics estimate), as BatchNorm in eval mode;
- ``mode="collect"``: batch statistics, and the input's sums are accumulated for :func:`calibrate`.
The statistics are recomputed from the weights and the training data, so they need no place in checkpoints.
An exported graph (``export``) normalises with the batch's statistics: population statistics are not part of a
bundle, and no served method uses a batch-normalised model.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("batch", "population", "collect")


class StatBatchNorm2d(nn.Module):
    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps
        self.mode = "batch"
        self.mean: torch.Tensor | None = None  # population statistics (attributes, not buffers)
        self.var: torch.Tensor | None = None
        self._sums: list[torch.Tensor] = []  # collect mode: [sum x, sum x^2, count] per channel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "population":
            if self.mean is None or self.var is None:
                raise RuntimeError("population statistics are not set: run fl_server.models.norm.calibrate first")
            return F.batch_norm(x, self.mean, self.var, self.weight, self.bias, training=False, eps=self.eps)
        if self.mode == "collect":
            flat = x.detach().transpose(0, 1).reshape(x.shape[1], -1).double()
            sums = [flat.sum(1), (flat * flat).sum(1), torch.tensor(float(flat.shape[1]), dtype=torch.float64)]
            self._sums = sums if not self._sums else [a + b for a, b in zip(self._sums, sums)]
        return F.batch_norm(x, None, None, self.weight, self.bias, training=True, eps=self.eps)


def stat_norms(model: nn.Module) -> list[StatBatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, StatBatchNorm2d)]


def set_mode(model: nn.Module, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown normalisation mode {mode!r}; one of {', '.join(MODES)}")
    for m in stat_norms(model):
        m.mode = mode


@contextlib.contextmanager
def norm_mode(model: nn.Module, mode: str) -> Iterator[None]:
    """Run a block with every :class:`StatBatchNorm2d` of ``model`` in ``mode``; restores the previous modes."""
    norms = stat_norms(model)
    before = [m.mode for m in norms]
    set_mode(model, mode)
    try:
        yield
    finally:
        for m, mode_before in zip(norms, before):
            m.mode = mode_before


@torch.no_grad()
def calibrate(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
              batches: Iterable[torch.Tensor]) -> None:
    """Set every StatBatchNorm2d's population statistics to the mean and biased variance of its input over
    ``batches`` (each normalised with its own batch statistics on the way, as in training); ``forward(x)`` runs
    the model with the weights the statistics belong to."""
    norms = stat_norms(model)
    for m in norms:
        m._sums = []
    with norm_mode(model, "collect"):
        for x in batches:
            forward(x)
    for m in norms:
        if not m._sums:
            raise ValueError("calibrate got no data")
        total, squares, count = m._sums
        mean = total / count
        m.mean = mean.to(m.weight.dtype)
        m.var = (squares / count - mean * mean).clamp_min(0.0).to(m.weight.dtype)
        m._sums = []
