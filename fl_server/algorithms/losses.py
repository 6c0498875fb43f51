"""Loss helpers shared by algorithms (torch; the numpy twins for the device live in ``edge_sdk``)."""
from __future__ import annotations

import math

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


def reliable_mean(values: torch.Tensor, logits: torch.Tensor, margin: float | None) -> torch.Tensor:
    """``values.mean()`` ([N] per-sample losses), or with ``margin`` EATA's reliable-sample weighting ("Efficient
    Test-Time Model Adaptation without Forgetting", Niu et al., ICML 2022, arXiv:2204.02610, Eq. 3):
    S_i = 1[E_i < E0] exp(E0 - E_i) with E_i the prediction entropy of ``logits`` (no gradient through S) and
    E0 = margin * ln C, then sum_i S_i values_i / max(1, #kept) (the authors' code filters, then means)."""
    if margin is None:
        return values.mean()
    entropy = entropy_from_logits(logits).detach()
    e0 = margin * math.log(logits.shape[-1])
    kept = (entropy < e0).to(values.dtype)
    return (kept * torch.exp(e0 - entropy) * values).sum() / kept.sum().clamp(min=1.0)
