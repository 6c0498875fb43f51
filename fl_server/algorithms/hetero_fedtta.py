"""HeteroFedTTA (Sec. 3.4, Algorithm 2 of "UPFL: Unsupervised Personalized Federated Learning towards New
Clients", Ye et al., SDM 2024, arXiv:2307.15994): FedTTA for clients with different model sizes, whose knowledge
meets as FedMD-style ensemble logits on a public unlabeled set D_p.

Pure functions of one size group's :class:`~fl_server.algorithms.fedtta.FedTTA` (its forward, inner step
and update are reused unchanged). D_p is cut into fixed chunks X_p of B samples; the personalized model on a
chunk is the inner step of Eq. 5 taken *on that chunk*, psi~ = psi - eta_inner grad ||g(f(X_p; psi); phi)||,
for teacher and student alike, so both see the same adaptation input.
- :func:`public_logits`: what a client communicates, f(D_p | psi) and f(D_p | psi~) (Algorithm 2).
- consensus (server): F_base = mean over clients of f(D_p | psi_i), F_per = mean of f(D_p | psi~_i).
- :func:`kd_loss`: Eq. 14, KL(s(f(x|psi~_s)) || s(F_per)) + lambda KL(s(f(x|psi_s)) || s(F_base)), per sample.
- :func:`digest`: SGD on Eq. 14 over the chunks, psi at eta_outer and phi at eta_adapt (FedTTA's Eqs. 8-9).
Model sizes (App. G, Table 3): small / medium / big ConvNets (16-32 / 32-64 / 64-128 channels, FC512) with
adaptation MLPs of width 32 / 64 / 128.
"""
from __future__ import annotations

import numpy as np
import torch

from fl_server.algorithms.fedtta import FedTTA
from fl_server.algorithms.losses import kl_from_logits
from fl_server.functional import State, grad, stack, unstack

# size group -> (model zoo name, adaptation MLP width)   (UPFL App. G, Table 3)
SIZE_GROUPS: dict[str, tuple[str, int]] = {
    "small": ("convnet_small", 32), "medium": ("convnet", 64), "big": ("convnet_big", 128),
}


def assign_sizes(num_clients: int, rng: np.random.Generator, groups: int = len(SIZE_GROUPS)) -> np.ndarray:
    """Size group of each client: each group with equal probability (App. G), drawn as a random permutation
    of a balanced list so every group is populated (sizes differ by at most one)."""
    return rng.permutation(np.arange(num_clients) % groups)


def public_chunks(x_public: torch.Tensor, batch: int) -> torch.Tensor:
    """[M, C, H, W] -> [M // batch, batch, C, H, W] fixed chunks of D_p (a remainder is dropped)."""
    n = len(x_public) // batch
    if n == 0:
        raise ValueError(f"the public set ({len(x_public)} samples) is smaller than one chunk of {batch}")
    return x_public[: n * batch].reshape(n, batch, *x_public.shape[1:])


def public_logits(alg: FedTTA, psi: State, phi: State, chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's (f(X_p | psi), f(X_p | psi~)) on every chunk: two [n_chunks, B, C] tensors, no graph."""
    base, per = [], []
    for x in chunks:  # n_chunks, small
        adapted, logits = alg.adapt_step_and_logits(psi, phi, x)  # logits = f(X_p | psi), from the step's pass
        base.append(logits.detach())
        with torch.no_grad():
            per.append(alg.forward({k: v.detach() for k, v in adapted.items()}, x))
    return torch.stack(base), torch.stack(per)


def clients_public_logits(alg: FedTTA, states: State, chunks: torch.Tensor,
                          mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`public_logits` for K stacked client states: [K, n_chunks, B, C] twice (vmap or loop)."""
    if mode == "vmap":
        return torch.vmap(lambda p, f: public_logits(alg, p, f, chunks))(states["params"], states["phi"])
    outs = [public_logits(alg, s["params"], s["phi"], chunks) for s in unstack(states)]
    return stack([o[0] for o in outs]), stack([o[1] for o in outs])


def kd_loss(alg: FedTTA, psi: State, phi: State, x: torch.Tensor, teacher_base: torch.Tensor,
            teacher_per: torch.Tensor, lam: float) -> torch.Tensor:
    """Eq. 14 on a chunk x [B, ...] with the consensus logits [B, C] of that chunk, averaged over the chunk
    (Eq. 14 sums over D_p; the mean keeps the step size of a CE step). lam = 0: the vanilla end-to-end KD.
    Differentiable in psi (both terms) and phi (first term, through psi~ of Eq. 5)."""
    adapted, logits = alg.adapt_step_and_logits(psi, phi, x)  # logits = f(x | psi), differentiable in psi
    loss = kl_from_logits(alg.forward(adapted, x), teacher_per).mean()
    if lam:
        loss = loss + lam * kl_from_logits(logits, teacher_base).mean()
    return loss


def digest(alg: FedTTA, state: State, chunks: torch.Tensor, teacher_base: torch.Tensor,
           teacher_per: torch.Tensor, lam: float, steps: int) -> State:
    """Algorithm 2's "digest": ``steps`` SGD steps on Eq. 14, cycling through the chunks in order.
    Deterministic in (state, consensus): every client of a size group starts a round from the same group
    model, so all of them digest to the same state (the runner computes it once per group)."""
    kd_grad = grad(lambda p, f, x, tb, tp: kd_loss(alg, p, f, x, tb, tp, lam), argnums=(0, 1))
    for t in range(steps):
        c = t % len(chunks)
        g_psi, g_phi = kd_grad(state["params"], state["phi"], chunks[c], teacher_base[c], teacher_per[c])
        state = {k: {n: v.detach() for n, v in part.items()} for k, part in alg.apply_gradients(state, g_psi, g_phi).items()}
    return state
