"""Functional model state: pytrees (nested dicts) of tensors, stacked along a leading client axis.

A *state* is a nested ``dict[str, Tensor | dict]``; a *stacked* state has one extra leading dimension K
(one slice per client). ``torch.func.vmap`` maps over that dimension.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.utils import _pytree as pytree

State = dict[str, Any]
Params = dict[str, torch.Tensor]


def get_params(module: nn.Module, dtype: torch.dtype | None = None, device: torch.device | None = None) -> Params:
    """Detached copies of a module's parameters. Models in the zoo have no buffers (no BatchNorm)."""
    if any(True for _ in module.buffers()):
        raise ValueError("functional training supports buffer-free models only (no BatchNorm)")
    return {name: p.detach().to(dtype=dtype, device=device).clone() for name, p in module.named_parameters()}


def make_forward(module: nn.Module) -> Callable[[Params, torch.Tensor], torch.Tensor]:
    """``forward(params, x)`` for a buffer-free module, usable under grad/vmap."""

    def forward(params: Params, x: torch.Tensor) -> torch.Tensor:
        return functional_call(module, params, (x,))

    return forward


def grad(fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """``torch.func.grad(fn, argnums, has_aux)``: every method takes its gradients through this one name.

    Not ``torch.autograd.grad``, though that would spare a process the ``torch._dynamo`` import (about 1 s of CPU)
    of its first ``torch.func.grad`` call: torch's CPU GroupNorm backward (its channels-last kernel) crashes the
    process on some batches of one sample under plain autograd, and not under ``torch.func.grad``. A Flower
    SuperNode's ClientApps pay the import once, in the SuperExec they are forked from
    (:mod:`fl_server.flower.superexec`)."""
    return torch.func.grad(fn, argnums, has_aux)


def tree_map(fn: Callable[..., torch.Tensor], tree: Any, *rest: Any) -> Any:
    return pytree.tree_map(fn, tree, *rest)


def stack(states: list[Any]) -> Any:
    """List of K states -> one stacked state (leading dim K)."""
    return pytree.tree_map(lambda *leaves: torch.stack(leaves), *states)


def unstack(stacked: Any) -> list[Any]:
    """Stacked state -> list of K states (views)."""
    leaves, spec = pytree.tree_flatten(stacked)
    return [pytree.tree_unflatten([leaf[k] for leaf in leaves], spec) for k in range(leaves[0].shape[0])]


def broadcast(state: Any, k: int) -> Any:
    """Copy one state K times into a stacked state."""
    return pytree.tree_map(lambda t: t.unsqueeze(0).expand(k, *t.shape).clone(), state)


def index(stacked: Any, ids: torch.Tensor | np.ndarray) -> Any:
    ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    return pytree.tree_map(lambda t: t[ids_t.to(t.device)], stacked)


def weighted_mean(stacked: Any, weights: torch.Tensor) -> Any:
    """Sum_k w_k state_k / sum_k w_k over the leading axis."""
    w = weights / weights.sum()

    def mean(t: torch.Tensor) -> torch.Tensor:
        return torch.tensordot(w.to(t.dtype), t, dims=1)

    return pytree.tree_map(mean, stacked)


def sgd(params: Any, grads: Any, lr: float, weight_decay: float = 0.0) -> Any:
    """Plain SGD step on pytrees: p <- p - lr (g + wd p), written as (1 - lr wd) p - lr g with fused
    ``torch.add(..., alpha=)`` kernels: the update is memory-bound when many clients' weights are stacked."""
    if weight_decay:
        return pytree.tree_map(lambda p, g: torch.add(p * (1 - lr * weight_decay), g, alpha=-lr), params, grads)
    return pytree.tree_map(lambda p, g: torch.add(p, g, alpha=-lr), params, grads)


def sgd_momentum(params: Any, buf: Any, grads: Any, lr: float, momentum: float,
                 weight_decay: float = 0.0) -> tuple[Any, Any]:
    """torch.optim.SGD with momentum (no dampening, no Nesterov) on pytrees: b <- m b + (g + wd p),
    p <- p - lr b. A zero ``buf`` is torch's first step (b = g). Returns (params, buf)."""
    if weight_decay:
        grads = pytree.tree_map(lambda g, p: torch.add(g, p, alpha=weight_decay), grads, params)
    buf = pytree.tree_map(lambda b, g: torch.add(g, b, alpha=momentum), buf, grads)
    return pytree.tree_map(lambda p, b: torch.add(p, b, alpha=-lr), params, buf), buf


def sgd_step(state: State, grads: Any, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> State:
    """One local step on ``state["params"]``: :func:`sgd`, or :func:`sgd_momentum` with its buffer in
    ``state["mom"]`` when ``momentum`` is nonzero. Every other entry of ``state`` passes through unchanged."""
    if not momentum:
        return {**state, "params": sgd(state["params"], grads, lr, weight_decay)}
    params, mom = sgd_momentum(state["params"], state["mom"], grads, lr, momentum, weight_decay)
    return {**state, "params": params, "mom": mom}


def clip_by_global_norm(grads: tuple[Any, ...], max_norm: float) -> tuple[Any, ...]:
    """Scale all gradient pytrees together by min(1, max_norm / ||g||_2) (as torch's clip_grad_norm_, but
    functional and vmappable: one norm per client under vmap)."""
    leaves = [leaf for g in grads for leaf in pytree.tree_leaves(g)]
    norm = torch.sqrt(sum((leaf ** 2).sum() for leaf in leaves))
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return tuple(pytree.tree_map(lambda t: t * scale, g) for g in grads)


def to_numpy_flat(state: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Flatten a state into ``{"a/b/c": array}`` for ``np.savez`` (no pickle)."""
    out: dict[str, np.ndarray] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(to_numpy_flat(value, name + "/"))
        else:
            out[name] = value.detach().cpu().numpy()
    return out


def from_numpy_flat(arrays: dict[str, np.ndarray], device: torch.device | None = None) -> State:
    """Inverse of :func:`to_numpy_flat`."""
    state: State = {}
    for name, arr in arrays.items():
        node = state
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = torch.from_numpy(np.array(arr)).to(device)
    return state
