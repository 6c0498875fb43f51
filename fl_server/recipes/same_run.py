"""Whether a recipe still describes a finished run: the same preprocessing, the same new clients and a model that
computes the same function. A recipe edited since training would otherwise resume the old run and report its
accuracy, or export the old weights into a model that computes something else, without a word.

The model is compared by what it computes, not by its code: :func:`model_forward` runs the classifier with fixed
weights (a deterministic pattern of the parameters' shapes, so neither the seed nor the init scheme matters) on a
fixed batch; ``run.json`` keeps the logits (and the bundle's manifest). The same code gives the same logits on any machine up to float
rounding; another activation, layer order or skip connection with the same parameter shapes gives others.

>>> from fl_server.models import build_model
>>> logits = model_forward(build_model("mlp", (1, 8, 8), 4, seed=0))
>>> same_forward(logits, model_forward(build_model("mlp", (1, 8, 8), 4, seed=1)))
True
"""
from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
import torch
from torch.func import functional_call

from fl_server.models import Classifier
from fl_server.models.norm import norm_mode

PROBE_BATCH = 4
# relative to the largest logit: float32 on another machine or device differs by ~1e-6 of it; another function by O(1)
FORWARD_TOLERANCE = 1e-3


def model_forward(clf: Classifier) -> list[list[float]]:
    """The logits of ``clf`` with pattern weights on a fixed batch of its input shape (``run.json``'s
    ``model_forward``). The model's own weights, modes and the global torch RNG are untouched."""
    params = {}
    for name, p in clf.named_parameters():  # each weight's pattern from its name: the modules' order does not matter
        phase = zlib.crc32(name.encode()) % 1000 / 100
        t = torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.7071 + phase).reshape(p.shape)
        # weights scaled by 1/sqrt(fan-in) keep deep nets' logits finite; vectors (biases, norms' affine) small
        t = t / math.sqrt(p.numel() / p.shape[0]) if p.dim() >= 2 else 0.1 * t
        params[name] = t.to(dtype=p.dtype, device=p.device)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    x = torch.rand((PROBE_BATCH, *clf.input_shape), generator=torch.Generator().manual_seed(0)).to(device)  # type: ignore[misc]
    # batch statistics: a finished run's model may hold population ones
    with torch.no_grad(), torch.random.fork_rng(devices=[]), norm_mode(clf, "batch"):
        logits = functional_call(clf, params, (x,))
    return [[float(f"{v:.7g}") for v in row] for row in logits.double().cpu().tolist()]


def same_forward(old: Any, new: list[list[float]]) -> bool:
    """Whether logits ``new`` are ``old``'s up to float rounding (relative to ``old``'s largest magnitude)."""
    a, b = np.asarray(old, dtype=np.float64), np.asarray(new, dtype=np.float64)
    if a.shape != b.shape:
        return False
    scale = float(np.max(np.abs(a))) if a.size else 0.0
    return bool(np.all(np.abs(a - b) <= FORWARD_TOLERANCE * max(scale, 1e-6)))


def changed(old: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys among ``preprocess``, ``new_clients`` and ``model_forward`` on which the run record ``old`` and the
    recipe's description ``now`` disagree. A key missing from either side (a run recorded before it was kept, an
    export that reads no data) is not compared; a dict is compared on ``old``'s fields (fields added since keep
    their defaults)."""
    out = []
    for key in ("preprocess", "new_clients", "model_forward"):
        a, b = old.get(key), now.get(key)
        if a is None or b is None:
            continue
        if key == "model_forward":
            if not same_forward(a, b):
                out.append(key)
        elif isinstance(a, dict) and isinstance(b, dict):
            if any(a[k] != b.get(k) for k in a):
                out.append(key)
        elif a != b:
            out.append(key)
    return out


__all__ = ["changed", "model_forward", "same_forward"]
