"""Contrastive losses of FedICON (Tan et al., NeurIPS 2023, "Is Heterogeneity Notorious? Taming Heterogeneity to Handle
Test-Time Shift in Federated Learning"): supervised (Eq. 4) and unsupervised (Eq. 7).

Both act on a batch of L2-normalised representations ``z`` [M, d] (M = 2N: two augmented views of N
samples). For an anchor x, A(x) = every other representation in the batch and
P(x) = {p in A(x) : y_p = y_x} (Eq. 5):

  l(x) = -1/|P(x)| sum_{p in P(x)} log( exp(z_x . z_p / tau) / sum_{a in A(x)} exp(z_x . z_a / tau) )

Eq. 4 sums l(x) over the anchors; we average (the loss scale then does not grow with the batch, as in
Khosla et al.'s SupCon code). Eq. 7 is the same loss with the sample identity as the label, so the only
positive of a view is the other view of the same sample (SimCLR's NT-Xent).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def supcon_loss(z: torch.Tensor, labels: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """Mean over anchors of Eq. 4. ``z`` [M, d] (normalised), ``labels`` [M] (int). Every anchor must
    have at least one positive (true with two views per sample)."""
    m = z.shape[0]
    eye = torch.eye(m, dtype=torch.bool, device=z.device)
    sim = (z @ z.T) / tau
    log_prob = sim - torch.logsumexp(sim.masked_fill(eye, float("-inf")), dim=1, keepdim=True)
    pos = (labels[:, None] == labels[None, :]) & ~eye
    pos_f = pos.to(z.dtype)
    per_anchor = -(log_prob * pos_f).sum(1) / pos_f.sum(1)
    return per_anchor.mean()


def unsup_contrastive_loss(z: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """Mean over the 2N views of Eq. 7; ``z`` [2N, d] holds view 1 of samples 0..N-1, then view 2."""
    n = z.shape[0] // 2
    ids = torch.arange(n, device=z.device).repeat(2)
    return supcon_loss(z, ids, tau)


def memory_contrastive_loss(z: torch.Tensor, z_view: torch.Tensor, z_mem: torch.Tensor,
                            tau: float = 0.1) -> torch.Tensor:
    """Online Eq. 7 (Sec. 4.2): anchors ``z`` [N, d], positives ``z_view`` [N, d] (their augmented views);
    A(x) = {x's view} + the memory ``z_mem`` [M, d]. Mean over the N anchors."""
    pos = (z * z_view).sum(-1, keepdim=True) / tau  # [N, 1]
    neg = (z @ z_mem.T) / tau  # [N, M]
    return -(pos.squeeze(-1) - torch.logsumexp(torch.cat([pos, neg], 1), dim=1)).mean()


def normalize(z: torch.Tensor) -> torch.Tensor:
    return F.normalize(z, dim=-1)
