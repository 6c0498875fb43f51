"""Loss helpers shared by algorithms (torch; the numpy twins for the device live in ``edge_sdk``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-sample prediction entropy H(softmax(logits)) = -sum p log p (natural log); [N, C] -> [N]."""
    log_p = F.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def kl_from_logits(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Per-sample KL(softmax(logits_p) || softmax(logits_q)) = sum p (log p - log q); [N, C] -> [N].
    The argument order of UPFL Eqs. 13-14 (the model being trained first)."""
    log_p, log_q = F.log_softmax(logits_p, dim=-1), F.log_softmax(logits_q, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)
