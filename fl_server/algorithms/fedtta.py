"""FedTTA, FedTTA-Prox and FedTTA++ (Algorithm 1 of "UPFL: Unsupervised Personalized Federated Learning towards
New Clients", Ye et al., SDM 2024, arXiv:2307.15994).

State: ``params`` = base model psi, ``phi`` = adaptation model g (C -> 32 -> 32 -> 32 -> 1).
Local meta-training step on a batch (X, Y):
  psi~ = psi - eta_inner * grad_psi ||g(f(X; psi); phi)||_2                 (Eq. 5, differentiable)
  L    = CE(f(X; psi~), Y) + mu * KL(softmax(f(X; psi)) || softmax(f(X; psi_server)))   (Eqs. 7, 13)
  psi <- psi - eta_outer * dL/dpsi   (second order: through psi~),   phi <- phi - eta_adapt * dL/dphi
Server: both psi and phi averaged, weighted by the clients' training-set sizes.
New client with unlabeled D: FedTTA takes one step of Eq. 5 on the full D; FedTTA++ takes up to E steps
with entropy early stopping (:class:`edge_sdk.EntropyEarlyStopping`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from edge_sdk import EntropyEarlyStopping
from fl_server.algorithms.base import Algorithm, Hyper, register
from fl_server.algorithms.losses import entropy_from_logits, kl_from_logits
from fl_server.functional import (State, broadcast, clip_by_global_norm, get_params, grad, make_forward, sgd,
                                  weighted_mean)
from fl_server.models import AdaptationMLP, Classifier


@dataclass
class FedTTAConfig(Hyper):
    lr: float = 0.3  # eta_outer (UPFL Table 4, MNIST FedTTA)
    inner_lr: float = 0.5  # eta_inner
    adapt_lr: float = 0.01  # eta_adapt
    mu: float = 0.0  # proxy-term weight (FedTTA-Prox / FedTTA++)
    adapt_width: int = 32
    patience: int = 0  # 0: one adaptation step (FedTTA); >= 1: entropy early stopping (FedTTA++)
    max_steps: int = 50  # E, the authors' code
    # FedTTA++: first iterate that may be returned (0: the un-adapted model too, the paper's reading; 1: from the
    # one-step model, docs/research/fedttapp-diagnosis.md). Left out of run fingerprints at its default.
    first_candidate: int = field(default=0, metadata={"fingerprint": "omit_default"})
    # Reference batch B of the personalization loss: l_per = sqrt(B * mean_i g_i^2), which is the paper's
    # ||g(Z)||_2 on a training batch of B samples, but does not grow as sqrt(N) on a new client's full set of
    # N samples (the paper's full-batch step would be sqrt(N/B) times larger than anything seen in training).
    # None: the paper's raw ||g(Z)||_2 on every batch size.
    loss_batch: int | None = 64


@register
class FedTTA(Algorithm):
    # the label-free safeguard rule chosen on validation shifts only (lab/safeguard_choice.py;
    # docs/results/safeguard-choice.json), applied by the device after personalising
    safeguard = {"rule": "rollback"}
    name = "FedTTA"
    graph_safe = True
    device_step = "fedtta_step"
    servable = True
    device_weights = ("params", "phi")
    Config = FedTTAConfig
    adapts_at_test_time = True

    def __init__(self, model: Classifier, config: Hyper | None = None, seed: int = 0, **overrides) -> None:  # type: ignore[no-untyped-def]
        super().__init__(model, config, seed, **overrides)
        with torch.random.fork_rng(devices=[]):  # seeded init, global RNG untouched
            torch.manual_seed(seed + 7919)
            self.adapter = AdaptationMLP(model.num_classes, self.hp.adapt_width)
        self.g = make_forward(self.adapter)

    def init_state(self, dtype: torch.dtype, device: torch.device) -> State:
        return {"params": get_params(self.model, dtype, device), "phi": get_params(self.adapter, dtype, device)}

    def client_start(self, server_state: State, ids: np.ndarray) -> State:
        return {key: broadcast(server_state[key], len(ids)) for key in ("params", "phi")}

    @classmethod
    def family_member(cls, hyper: dict[str, Any]) -> str:
        """The method of the family that ``hyper`` makes: FedTTA, FedTTA-Prox and FedTTA++ differ only in ``mu``
        and ``patience`` (FedTTA: mu=0, patience=0; FedTTA-Prox: mu>0, patience=0; FedTTA++: patience>=1).

        >>> FedTTA.family_member({"patience": 5})
        'FedTTA++'
        """
        hp = cls.Config(**{k: v for k, v in hyper.items() if k in cls.Config.__dataclass_fields__})
        return "FedTTA++" if hp.patience >= 1 else "FedTTA-Prox" if hp.mu > 0 else "FedTTA"

    @classmethod
    def identity_warning(cls, hyper: dict[str, Any]) -> str | None:
        """One line when ``hyper`` makes another method of the family (:meth:`family_member`)."""
        hp = cls.Config(**{k: v for k, v in hyper.items() if k in cls.Config.__dataclass_fields__})
        made = cls.family_member(hyper)
        if made == cls.name:
            return None
        return (f"{cls.name} with mu={hp.mu} and patience={hp.patience} runs {made} (FedTTA: mu=0, patience=0; "
                f"FedTTA-Prox: mu>0, patience=0; FedTTA++: patience>=1); name method {made!r} or change them")

    # --------------------------------------------------------------- the math
    def personalization_loss(self, psi: State, phi: State, x: torch.Tensor) -> torch.Tensor:
        """l_per = || g(f(X; psi); phi) ||_2 over the batch (UPFL Eq. 4), at the reference batch size."""
        return self.personalization_loss_and_logits(psi, phi, x)[0]

    def personalization_loss_and_logits(self, psi: State, phi: State,
                                        x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(l_per, f(X; psi)): the logits come with the loss, so callers that need them too pay one forward."""
        logits = self.forward(psi, x)
        scores = self.g(phi, logits)
        if self.hp.loss_batch is None:
            return torch.linalg.vector_norm(scores), logits
        # sqrt(B * mean g^2) == ||g||_2 when N == B; mean() keeps N symbolic for the ONNX export
        return torch.sqrt(self.hp.loss_batch * scores.square().mean()), logits

    def adapt_step(self, psi: State, phi: State, x: torch.Tensor) -> State:
        """psi~ = psi - eta_inner grad_psi l_per (Eq. 5); differentiable w.r.t. psi and phi."""
        return self.adapt_step_and_logits(psi, phi, x)[0]

    def adapt_step_and_logits(self, psi: State, phi: State, x: torch.Tensor) -> tuple[State, torch.Tensor]:
        """(psi~ of Eq. 5, f(X; psi)): the step's own forward pass, still differentiable w.r.t. psi."""
        grads, logits = grad(self.personalization_loss_and_logits, has_aux=True)(psi, phi, x)
        return sgd(psi, grads, self.hp.inner_lr), logits

    def meta_loss(self, psi: State, phi: State, psi_server: State, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        adapted, logits = self.adapt_step_and_logits(psi, phi, x)
        loss = F.cross_entropy(self.forward(adapted, x), y)
        if self.hp.mu:  # Eq. 13, on the inner step's f(X; psi) (no second forward of psi)
            kl = kl_from_logits(logits, self.forward(psi_server, x).detach())
            loss = loss + self.hp.mu * kl.mean()
        return loss

    def local_step(self, client_state: State, server_state: State, x: torch.Tensor, y: torch.Tensor) -> State:
        g_psi, g_phi = grad(self.meta_loss, argnums=(0, 1))(
            client_state["params"], client_state["phi"], server_state["params"], x, y)
        return self.apply_gradients(client_state, g_psi, g_phi)

    def apply_gradients(self, state: State, g_psi: State, g_phi: State) -> State:
        """Eqs. 8-9: psi <- psi - eta_outer g_psi, phi <- phi - eta_adapt g_phi (after the optional clip)."""
        if self.hp.clip_norm is not None:
            g_psi, g_phi = clip_by_global_norm((g_psi, g_phi), self.hp.clip_norm)
        return {"params": sgd(state["params"], g_psi, self.hp.lr, self.hp.weight_decay),
                "phi": sgd(state["phi"], g_phi, self.hp.adapt_lr)}

    def aggregate(self, server_state: State, ids: np.ndarray, client_states: State, weights: torch.Tensor) -> State:
        return {**server_state, **{k: weighted_mean(client_states[k], weights) for k in ("params", "phi")}}

    # ------------------------------------------------------------ new client
    def personalize(self, server_state: State, x: torch.Tensor) -> State:
        psi, phi = server_state["params"], server_state["phi"]
        if self.hp.patience < 1:
            return self.adapt_step(psi, phi, x)
        return self.personalize_early_stopping(psi, phi, x)[0]

    def personalize_early_stopping(self, psi: State, phi: State, x: torch.Tensor) -> tuple[State, EntropyEarlyStopping]:
        """FedTTA++: iterate Eq. 5, keep the iterate of lowest mean prediction entropy on ``x``. An iterate whose
        entropy overflows ends the adaptation with the best finite one (the device's rule, edge_sdk._steps)."""
        stopper = EntropyEarlyStopping(self.hp.patience, self.hp.max_steps, self.hp.first_candidate)
        best, current = psi, psi
        while True:
            # one forward of the iterate serves both its entropy and, if the stopper goes on, its Eq. 5 step
            (loss, logits), pullback = torch.func.vjp(lambda p: self.personalization_loss_and_logits(p, phi, x),
                                                      current)
            h = float(entropy_from_logits(logits.detach()).mean())
            if not math.isfinite(h) and stopper.history:
                if stopper.best_step < 0:  # no candidate iterate yet: keep the received model
                    stopper.best_step, stopper.best_entropy = 0, stopper.history[0]
                return best, stopper
            stop = stopper.update(h)
            if stopper.best_step == len(stopper.history) - 1:
                best = current
            if stop:
                return best, stopper
            (grads,) = pullback((torch.ones_like(loss), torch.zeros_like(logits)))
            current = {k: v.detach() for k, v in sgd(current, grads, self.hp.inner_lr).items()}


@dataclass
class FedTTAProxConfig(FedTTAConfig):
    mu: float = 0.01  # the proxy term (UPFL Table 4)
    clip_norm: float | None = 10.0


@dataclass
class FedTTAPlusPlusConfig(FedTTAProxConfig):
    patience: int = 1  # entropy early stopping (UPFL Sec. 4.3)


@register
class FedTTAProx(FedTTA):
    # the label-free safeguard rule chosen on validation shifts only (lab/safeguard_choice.py;
    # docs/results/safeguard-choice.json), applied by the device after personalising
    safeguard = {"rule": "rollback"}
    name = "FedTTA-Prox"
    Config = FedTTAProxConfig


@register
class FedTTAPlusPlus(FedTTA):
    # the label-free safeguard rule chosen on validation shifts only (lab/safeguard_choice.py;
    # docs/results/safeguard-choice.json), applied by the device after personalising
    safeguard = {"rule": "rollback"}
    name = "FedTTA++"
    default_job = True  # trained by a coordinator with an empty store
    Config = FedTTAPlusPlusConfig
