"""Batch normalisation for the functional engine: :class:`StatBatchNorm2d` (affine parameters only, no buffers).

The engine's states are parameter pytrees (``fl_server.functional``: no buffers, so no running statistics updated
inside vmapped or differentiated steps). So the normalisation statistics live outside the state:
- ``mode="batch"`` (training, and test-time adaptation): the batch's own mean and variance, as BatchNorm in
  train mode;
- ``mode="population"``: the statistics fixed by :func:`calibrate` -- the mean and (biased) variance of the layer's
  input over every training sample, computed with the final global model (what FedAvg's averaged running
  statistics estimate), as BatchNorm in eval mode;
- ``mode="collect"``: batch statistics, and the input's sums are accumulated for :func:`calibrate`;
- ``mode="rule"``: the device's rule for an adaptation step (the bundle's ``batch_norm`` entry,
  :data:`BATCH_NORM_RULE`, ``edge_sdk._batchnorm``): the batch's statistics from ``min_batch`` samples on, else the
  population's -- so the engine's test-time adaptation of a new client is the device's;
- ``mode="mix"``: (1 - m) population + m batch statistics with m = ``momentum`` (a 0-d tensor): m = 1 is
  ``"batch"``, m = 0 ``"population"``, in between an exponential update of the population statistics (the
  statistics used are kept in ``used`` so an exported step can return them). Exported graphs run in this mode
  with the statistics and m as graph inputs (:func:`statistics_inputs`), so the device chooses per batch
  (the bundle's ``batch_norm`` rule: a stream of batch 1 never normalises with one sample's statistics).
The statistics are recomputed from the weights and the training data, so they need no place in checkpoints.
Where they come from (:func:`calibrate`): ``"federated"`` (default) -- every training client's sums of x and x^2,
added up (FedAvg of the clients' statistics weighted by sample count), the same statistics for every client,
which a new client needs since it has none of its own; ``"local"`` -- each client's own (FedBN), for the clients
that trained. A user's ``nn.BatchNorm2d`` becomes a :class:`StatBatchNorm2d` with :func:`convert_batchnorm`
(its running statistics become the population statistics).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

MODES = ("batch", "population", "collect", "mix", "rule")
# how a device normalises (the bundle's ``batch_norm`` entry, read by ``edge_sdk._batchnorm.BatchNormRule``): its
# predictions with the population statistics, an adaptation step on ``min_batch`` or more samples with the
# batch's, a smaller one with the population's ("running"). Training evaluates new clients by the same rule.
BATCH_NORM_RULE = {"statistics": "federated", "min_batch": 16, "small_batch": "running", "ema_momentum": 0.1}


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
        self.momentum: torch.Tensor | None = None  # mix mode: weight of the batch's statistics
        self.used: tuple[torch.Tensor, torch.Tensor] | None = None  # mix mode: the (mean, var) last used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "rule":  # an adaptation step on the device (BATCH_NORM_RULE, "running" small batches)
            small = x.shape[0] < BATCH_NORM_RULE["min_batch"]
            return self._population(x) if small else F.batch_norm(x, None, None, self.weight, self.bias,
                                                                   training=True, eps=self.eps)
        if self.mode == "population":
            return self._population(x)
        if self.mode == "mix":
            return self._mix(x)
        if self.mode == "collect":
            flat = x.detach().transpose(0, 1).reshape(x.shape[1], -1).double()
            sums = [flat.sum(1), (flat * flat).sum(1), torch.tensor(float(flat.shape[1]), dtype=torch.float64)]
            self._sums = sums if not self._sums else [a + b for a, b in zip(self._sums, sums)]
        return F.batch_norm(x, None, None, self.weight, self.bias, training=True, eps=self.eps)

    def _population(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None or self.var is None:
            raise RuntimeError("population statistics are not set: run fl_server.models.norm.calibrate first")
        return F.batch_norm(x, self.mean.to(x.dtype), self.var.to(x.dtype), self.weight, self.bias, training=False,
                            eps=self.eps)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None or self.var is None or self.momentum is None:
            raise RuntimeError("mix mode needs population statistics and a momentum (statistics_inputs)")
        y, mean, var, _ = _MixNorm.apply(x, self.weight, self.bias, self.mean, self.var, self.momentum, self.eps)
        self.used = (mean, var)
        return y

    @classmethod
    def from_batchnorm(cls, bn: nn.BatchNorm2d) -> "StatBatchNorm2d":
        """The same normalisation as ``bn`` (affine parameters copied; its running statistics, if it tracks
        them, become the population statistics)."""
        if not bn.affine:
            raise ValueError("BatchNorm2d(affine=False) is not supported: TENT adapts the affine parameters")
        out = cls(bn.num_features, bn.eps)
        with torch.no_grad():
            out.weight.copy_(bn.weight)
            out.bias.copy_(bn.bias)
        if bn.running_mean is not None and bn.running_var is not None:
            out.mean, out.var = bn.running_mean.detach().clone(), bn.running_var.detach().clone()
        return out


class _MixNorm(torch.autograd.Function):
    """``"mix"`` normalisation with its backward written out, for lean exported gradient graphs (every node runs at
    each device step). Forward: batch mean mu_b and biased variance v_b, the statistics used mu = (1 - m) mu_p +
    m mu_b, v = (1 - m) v_p + m v_b, r = 1 / sqrt(v + eps), s = gamma r, y = x s + (beta - mu s) (one fused scale and
    shift per channel; d * d, not a square, and 1 / sqrt, not rsqrt: their derivatives would be ONNX Pow nodes).
    Backward, per channel over (N, H, W) with n elements, g = dL/dy, d = x - mu_b (recomputed, not held):
      dbeta = sum g,  dgamma = r sum g (x - mu) = r (sum g d + (mu_b - mu) sum g),
      dL/dmu = -s sum g,  dL/dv = -gamma r^3 / 2 * sum g (x - mu),
      dx = g s + (m / n) dL/dmu + (2 m / n) dL/dv * d
    (the term of v_b through mu_b vanishes: sum d = 0), which autograd spreads over about three times as many
    activation-sized nodes (broadcasts of every reduction's gradient, one sum per path). The statistics outputs
    (mu, v, and mu_b for the backward) are not differentiable. Population statistics and m get no gradient."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, pop_mean: torch.Tensor,  # type: ignore[override]
                pop_var: torch.Tensor, m: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
        batch_mean = x.mean(dim=(0, 2, 3))
        d = x - batch_mean[None, :, None, None]
        batch_var = (d * d).mean(dim=(0, 2, 3))  # biased, as BatchNorm
        mean = (1 - m) * pop_mean + m * batch_mean
        var = (1 - m) * pop_var + m * batch_var
        scale = weight * torch.reciprocal(torch.sqrt(var + eps))
        y = x * scale[None, :, None, None] + (bias - mean * scale)[None, :, None, None]
        return y, mean, var, batch_mean

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def,override]
        x, weight, _, _, _, m, eps = inputs
        _, mean, var, batch_mean = output
        ctx.mark_non_differentiable(mean, var, batch_mean)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, m, mean, var, batch_mean)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, g: torch.Tensor | None, *_: torch.Tensor | None):  # type: ignore[no-untyped-def,override]
        x, weight, m, mean, var, batch_mean = ctx.saved_tensors
        if g is None:
            return None, None, None, None, None, None, None
        dims, c = (0, 2, 3), (None, slice(None), None, None)
        d = x - batch_mean[c]
        r = torch.reciprocal(torch.sqrt(var + ctx.eps))
        scale = weight * r
        sum_g = g.sum(dim=dims)
        sum_gd = (g * d).sum(dim=dims) + (batch_mean - mean) * sum_g  # sum g (x - mu)
        dx = None
        if ctx.needs_input_grad[0]:
            n = x.shape[0] * x.shape[2] * x.shape[3]
            d_mean = -scale * sum_g
            d_var = -0.5 * weight * r * r * r * sum_gd
            dx = g * scale[c] + d * (2 * m / n * d_var)[c] + (m / n * d_mean)[c]
        d_weight = r * sum_gd if ctx.needs_input_grad[1] else None
        d_bias = sum_g if ctx.needs_input_grad[2] else None
        return dx, d_weight, d_bias, None, None, None, None


def convert_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm2d`` inside ``module`` (in place) by a :class:`StatBatchNorm2d`, so the
    functional engine (buffer-free states) and the exporter accept it. Returns ``module`` (or the replacement
    when ``module`` itself is a BatchNorm2d).

    >>> net = convert_batchnorm(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    >>> type(net[1]).__name__
    'StatBatchNorm2d'
    """
    if isinstance(module, nn.BatchNorm2d):
        return StatBatchNorm2d.from_batchnorm(module)
    for name, child in module.named_children():
        setattr(module, name, convert_batchnorm(child))
    return module


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


def norm_names(model: nn.Module) -> list[str]:
    """Module names of the model's :class:`StatBatchNorm2d` layers, in order."""
    return [name for name, m in model.named_modules() if isinstance(m, StatBatchNorm2d)]


def statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    """The population statistics as a flat dict ``{"<layer>.mean": [C], "<layer>.var": [C]}`` (what a bundle
    ships as its ``stats`` weights); raises if :func:`calibrate` has not run."""
    out: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, StatBatchNorm2d):
            if m.mean is None or m.var is None:
                raise RuntimeError("population statistics are not set: run fl_server.models.norm.calibrate first")
            out[f"{name}.mean"], out[f"{name}.var"] = m.mean, m.var
    return out


def set_statistics(model: nn.Module, stats: dict[str, "torch.Tensor | np.ndarray"]) -> None:
    """Set every StatBatchNorm2d's population statistics from ``stats`` (:func:`statistics`' names, e.g. a run's
    ``device.npz``); KeyError naming a missing layer."""
    for name, m in model.named_modules():
        if isinstance(m, StatBatchNorm2d):
            missing = [k for k in (f"{name}.mean", f"{name}.var") if k not in stats]
            if missing:
                raise KeyError(f"the population statistics lack {', '.join(missing)}")
            m.mean, m.var = (torch.as_tensor(stats[f"{name}.{k}"], dtype=m.weight.dtype) for k in ("mean", "var"))


@contextlib.contextmanager
def statistics_inputs(model: nn.Module, stats: dict[str, torch.Tensor], momentum: torch.Tensor) -> Iterator[None]:
    """Run a block with every :class:`StatBatchNorm2d` in ``"mix"`` mode, reading its statistics from ``stats``
    (:func:`statistics`' names) and the batch's weight from ``momentum`` -- tensors that may be graph inputs
    being traced. Restores the layers' modes and statistics afterwards."""
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, StatBatchNorm2d)]
    before = [(m.mode, m.mean, m.var, m.momentum) for _, m in named]
    for name, m in named:
        m.mode, m.mean, m.var, m.momentum = "mix", stats[f"{name}.mean"], stats[f"{name}.var"], momentum
    try:
        yield
    finally:
        for (_, m), (mode, mean, var, mom) in zip(named, before):
            m.mode, m.mean, m.var, m.momentum, m.used = mode, mean, var, mom, None


def used_statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    """After a forward in ``"mix"`` mode: the statistics each layer normalised with, named as :func:`statistics`."""
    out: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, StatBatchNorm2d):
            if m.used is None:
                raise RuntimeError(f"{name} has not run in mix mode")
            out[f"{name}.mean"], out[f"{name}.var"] = m.used
    return out


STATISTICS = ("federated", "local")


@torch.no_grad()
def _sums(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
          batches: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per layer [sum x, sum x^2, count] (float64, per channel) of its input over ``batches``."""
    norms = stat_norms(model)
    for m in norms:
        m._sums = []
    with norm_mode(model, "collect"):
        for x in batches:
            forward(x)
    sums = [m._sums for m in norms]
    for m in norms:
        m._sums = []
    if any(not s for s in sums):
        raise ValueError("calibrate got no data")
    return sums


def _set_from_sums(model: nn.Module, sums: list[list[torch.Tensor]]) -> None:
    for m, (total, squares, count) in zip(stat_norms(model), sums):
        mean = total / count
        m.mean = mean.to(m.weight.dtype)
        m.var = (squares / count - mean * mean).clamp_min(0.0).to(m.weight.dtype)


# samples per forward when a client's sums are collected (:func:`client_sums`): each chunk is normalised with its
# own batch statistics on the way, so the chunking is part of what the population statistics are
CALIBRATION_CHUNK = 256
Sums = list[list[torch.Tensor]]  # per layer [sum x, sum x^2, count] (float64, per channel)


def client_sums(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                chunk: int = CALIBRATION_CHUNK) -> Sums:
    """One training client's sufficient statistics of every layer's input over its samples ``x``, ``chunk`` at a
    time: what the engine's finalize collects per training client (``Simulation.device_semantics``) and a Flower
    client uploads; :func:`federated_statistics` adds them up."""
    return _sums(model, forward, (x[i:i + chunk] for i in range(0, len(x), chunk)))


def federated_statistics(model: nn.Module, per_client: Sequence[Sums]) -> None:
    """Set every StatBatchNorm2d's population statistics from the clients' sums added up: the mean and biased
    variance over the union of their samples (FedAvg of the clients' statistics weighted by sample count)."""
    if not per_client:
        raise ValueError("federated_statistics got no clients")
    _set_from_sums(model, [[sum(c[layer][k] for c in per_client) for k in range(3)]
                           for layer in range(len(per_client[0]))])


def statistics_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """:func:`statistics` as float32 numpy arrays: the ``stats`` weight set of a run's ``device.npz``."""
    return {n: v.float().cpu().numpy() for n, v in statistics(model).items()}


def calibrate(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
              batches: Iterable[torch.Tensor]) -> None:
    """Set every StatBatchNorm2d's population statistics to the mean and biased variance of its input over
    ``batches`` (each normalised with its own batch statistics on the way, as in training); ``forward(x)`` runs
    the model with the weights the statistics belong to."""
    _set_from_sums(model, _sums(model, forward, batches))


def client_statistics(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
                      clients: Sequence[Iterable[torch.Tensor]],
                      how: str = "federated") -> list[dict[str, torch.Tensor]]:
    """Population statistics per client (:func:`statistics`' names), each client's batches in ``clients``.
    ``"federated"`` (default): every client sends its sums of x and x^2 and its count, the server adds them up
    (FedAvg of the clients' statistics weighted by sample count; equal to :func:`calibrate` over their union)
    and every client gets the same statistics -- the only ones a new client can receive. ``"local"``: each
    client's own (FedBN, Li et al. 2021), for clients that hold training data. Leaves the model's statistics at
    the federated ones."""
    if how not in STATISTICS:
        raise ValueError(f"unknown statistics {how!r}; one of {', '.join(STATISTICS)}")
    per_client = [_sums(model, forward, batches) for batches in clients]
    if not per_client:
        raise ValueError("client_statistics got no clients")
    out = []
    if how == "local":
        for sums in per_client:
            _set_from_sums(model, sums)
            out.append(statistics(model))
    federated_statistics(model, per_client)
    return out if how == "local" else [statistics(model)] * len(per_client)
