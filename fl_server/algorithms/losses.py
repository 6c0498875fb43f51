"""Loss helpers shared by algorithms (torch; the numpy twins for the device live in ``edge_sdk``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-sample prediction entropy H(softmax(logits)) = -sum p log p (natural log); [N, C] -> [N]."""
    log_p = F.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)
