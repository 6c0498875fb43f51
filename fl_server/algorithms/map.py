"""MAP = restricted softmax (FedRS) + inherited private model (FedPHP) (Algorithm 1 of "MAP: Model Aggregation and
Personalization in Federated Learning with Incomplete Classes", Li et al., arXiv:2404.09232), with FedRS and FedPHP
as its ablations.

Client procedure on a selected client k, ``local_iterations`` SGD-momentum steps split in two stages:
- stage 1 (the first ``stage1_fraction``): restricted softmax (Eq. 8), p_c ∝ exp(a_c w_c^T h) with
  a_c = 1 for the client's observed classes and ``alpha`` for missing ones; the model at the end of
  stage 1 is uploaded (psi_hat_a, line 7);
- stage 2: softmax with L = (1 - lambda) CE + lambda * tau^2 KL(softmax(g_p/tau) || softmax(g/tau))
  (Eqs. 11, 13), g_p = logits of the client's HPM (no KD before the client has an HPM);
- HPM (Eq. 10): psi_p <- (1 - mu_k) psi_hat + mu_k psi_p, mu_k = min(1, mu * z_k / (Q T)), z_k = times
  the client was selected (the first selection sets psi_p = psi_hat).
Server: average of the uploaded models, weighted by the sizes the engine passes (Algorithm 1 line 6
uses 1/|S_t|; the two coincide for equal-size clients).
Implemented as one pure, vmappable step: the stage is a per-client step counter and both stages'
losses are blended by a 0/1 weight (the KD teacher's forward is the only extra work in stage 1).

Personalisation accuracy (Definition 2): each client's personalised model after one client procedure from
the current global model, on its local test set (``val_params``): psi_hat without an HPM, the HPM updated
by that procedure with one (Algorithm 1 returns psi_p,T+1 as the client's model). Aggregation accuracy
(Definition 1): the global model on the global test set (computed by the experiment runner).

Ablations in the same family: FedRS = RS for all local steps (alpha = 0.9, no stage 2, no HPM); FedPHP =
FedAvg + HPM (one stage with the KD loss, psi_hat uploaded); FedAvg / FedProx under the same optimiser =
alpha 1, one stage, no HPM (+ the proximal term ``prox_mu``).
The authors' code (lxcnju/MAP, algorithms/fedap.py), which produced the paper's tables, runs another client
procedure: all E epochs with RS (uploaded), then max(int(0.1 E steps), 5) KD steps at 0.2 lr with a fresh
optimiser and a soft-target cross-entropy, mu_k capped at 0.9 (``authors_code_procedure``).
BTFL composition: with ``head_only_stage2`` the second stage trains only the classifier on the frozen
global features, so the HPM heads (:meth:`MAP.local_heads`) are linear heads on the global feature
extractor -- what BTFL uses as its local head.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fl_server.algorithms.base import Algorithm, Hyper, LocalTrainer, StepFn, register
from fl_server.functional import State, broadcast, get_params, grad, index, tree_map, weighted_mean
from fl_server.models import Classifier


@dataclass
class MAPConfig(Hyper):
    lr: float = 0.03  # MAP Sec. 5: SGD momentum 0.9, lr 0.03, batch 64, wd 1e-5
    weight_decay: float = 1e-5
    momentum: float = 0.9
    alpha: float = 0.9  # RS factor of missing classes (1 = softmax)
    stage1_fraction: float = 0.5  # E/2 of E epochs; 1.0 = one stage (FedRS / FedAvg)
    local_iterations: int = 20  # steps of one client procedure (set equal to the run's local_iterations)
    hpm: bool = True
    kd_lambda: float = 0.01
    kd_tau: float = 4.0
    mu_macro: float = 0.9
    expected_selections: float = 30.0  # Q * T (0.2 * 150)
    prox_mu: float = 0.0
    head_only_stage2: bool = False  # BTFL composition: personalise only the classifier
    # The authors' released code (lxcnju/MAP, algorithms/fedap.py) runs a different client procedure from
    # Algorithm 1; these fields reproduce it (all off by default = Algorithm 1; see AUTHORS_CODE below).
    # stage2_steps: None = split by stage1_fraction; n = the last n of local_iterations are stage 2
    stage2_steps: int | None = field(default=None, metadata={"fingerprint": "omit_default"})
    stage2_lr_scale: float = field(default=1.0, metadata={"fingerprint": "omit_default"})
    stage2_fresh_momentum: bool = field(default=False, metadata={"fingerprint": "omit_default"})
    # "kl": Eq. 11, tau^2 KL(softmax(g_p/tau) || softmax(g/tau)); "soft_ce": the code's
    # -sum softmax(g_p/tau) log softmax(g) (student at temperature 1, no tau^2)
    kd_form: str = field(default="kl", metadata={"fingerprint": "omit_default"})
    mu_cap: float = field(default=1.0, metadata={"fingerprint": "omit_default"})
    # mu_k from the selections before this one (the code) instead of including it (Eq. 10 as written)
    mu_previous_count: bool = field(default=False, metadata={"fingerprint": "omit_default"})

    def __post_init__(self) -> None:
        if self.kd_form not in ("kl", "soft_ce"):
            raise ValueError(f"kd_form must be 'kl' or 'soft_ce', not {self.kd_form!r}")
        if self.stage2_steps is not None and not 0 < self.stage2_steps < self.local_iterations:
            raise ValueError(f"stage2_steps={self.stage2_steps} must lie in (0, local_iterations="
                             f"{self.local_iterations})")


def authors_code_procedure(epoch_steps: int) -> dict[str, Any]:
    """MAPConfig overrides for the client procedure of the authors' code (fedap.py), given the steps of E
    epochs: stage 1 = all E epochs with restricted softmax, uploaded; stage 2 = max(int(0.1 * steps), 5) KD
    steps at 0.2 lr from the uploaded model with a fresh optimiser, soft-target cross-entropy; the HPM
    momentum from the previous selections, capped at 0.9. (Not reproduced: the code's lr warm-up
    min(r / 5, 1) and its gradient clip at 100, which apply to every method there.)"""
    stage2 = max(int(0.1 * epoch_steps), 5)
    return {"local_iterations": epoch_steps + stage2, "stage2_steps": stage2, "stage2_lr_scale": 0.2,
            "stage2_fresh_momentum": True, "kd_form": "soft_ce", "mu_cap": 0.9, "mu_previous_count": True}


def restricted_softmax_logits(logits: torch.Tensor, observed: torch.Tensor, alpha: float) -> torch.Tensor:
    """Eq. 8 as logits: a_c * logit_c with a_c = 1 for observed classes (``observed`` [C] 0/1) else alpha."""
    return logits * (observed + alpha * (1 - observed))


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 11: tau^2 * mean_i KL(softmax(g_p,i / tau) || softmax(g_i / tau))."""
    log_t = F.log_softmax(teacher / tau, -1)
    log_s = F.log_softmax(student / tau, -1)
    return tau ** 2 * (log_t.exp() * (log_t - log_s)).sum(-1).mean()


def kd_soft_ce(student: torch.Tensor, teacher: torch.Tensor, tau: float) -> torch.Tensor:
    """The authors' code's KD term: mean_i -sum_c softmax(g_p,i / tau)_c log softmax(g_i)_c."""
    return -(F.softmax(teacher / tau, -1) * F.log_softmax(student, -1)).sum(-1).mean()


@register
class MAP(Algorithm):
    name = "MAP"
    client_facts = ("class_set",)  # the restricted softmax's observed classes, per client
    per_client_keys = ("hpm", "count", "observed")
    Config = MAPConfig

    def __init__(self, model: Classifier, config: Hyper | None = None, seed: int = 0, **overrides: Any) -> None:
        super().__init__(model, config, seed, **overrides)
        self.observed: torch.Tensor | None = None  # [K, C] 0/1, set by receive_client_facts
        self._phase_steps = {phase: functools.partial(self.local_step, phase=phase) for phase in ("stage1", "stage2")}

    def receive_client_facts(self, facts: dict[str, list[list[int]]]) -> None:
        """Each training client's observed classes (the client knows its own label set)."""
        observed = torch.zeros(len(facts["class_set"]), self.model.num_classes, dtype=torch.float64)
        for k, classes in enumerate(facts["class_set"]):
            observed[k, classes] = 1.0
        self.observed = observed

    def init_state(self, dtype: torch.dtype, device: torch.device) -> State:
        if self.observed is None:
            raise RuntimeError("MAP needs the clients' class sets (attach or receive_client_facts) before init_state")
        params = get_params(self.model, dtype, device)
        k = self.observed.shape[0]
        return {"params": params, "hpm": broadcast(params, k), "count": torch.zeros(k, dtype=dtype, device=device),
                "observed": self.observed.to(device, dtype)}

    def client_start(self, server_state: State, ids: np.ndarray) -> State:
        n = len(ids)
        params = broadcast(server_state["params"], n)
        has_hpm = (index(server_state["count"], ids) > 0).to(server_state["count"].dtype)
        return {"params": params, "agg": params, "mom": tree_map(torch.zeros_like, params),
                "hpm": index(server_state["hpm"], ids), "kd": has_hpm * float(self.hp.hpm),
                "observed": index(server_state["observed"], ids),
                "step": torch.zeros(n, dtype=torch.int64, device=server_state["count"].device)}

    # ---------------------------------------------------------------- the step
    def _stage1_iterations(self) -> int:
        if self.hp.stage2_steps is not None:
            return self.hp.local_iterations - self.hp.stage2_steps
        return int(round(self.hp.stage1_fraction * self.hp.local_iterations))

    def client_loss(self, params: State, client_state: State, server_state: State, x: torch.Tensor,
                    y: torch.Tensor, stage1: torch.Tensor, phase: str | None = None) -> torch.Tensor:
        """stage1 * RS loss + (1 - stage1) * (CE + KD from the HPM); ``phase`` ("stage1" / "stage2") leaves
        out the term whose weight is 0 (the teacher's forward in stage 1)."""
        logits = self.forward(params, x)
        loss: torch.Tensor | float = 0.0
        if phase != "stage2":
            restricted = restricted_softmax_logits(logits, client_state["observed"], self.hp.alpha)
            loss = stage1 * F.cross_entropy(restricted, y)
        if phase != "stage1":
            stage2 = F.cross_entropy(logits, y)
            if self.hp.hpm:  # (the teacher's forward is skipped for methods without an HPM)
                teacher = self.forward(client_state["hpm"], x).detach()
                lam = self.hp.kd_lambda * client_state["kd"]
                kd = kd_loss if self.hp.kd_form == "kl" else kd_soft_ce
                stage2 = (1 - lam) * stage2 + lam * kd(logits, teacher, self.hp.kd_tau)
            loss = loss + (1 - stage1) * stage2
        if self.hp.prox_mu:
            prox = sum(((p - q) ** 2).sum() for p, q in zip(params.values(), server_state["params"].values()))
            loss = loss + 0.5 * self.hp.prox_mu * prox
        return loss

    def local_step_at(self, t: int) -> StepFn:
        return self._phase_steps["stage1" if t < self._stage1_iterations() else "stage2"]

    def local_step(self, client_state: State, server_state: State, x: torch.Tensor, y: torch.Tensor,
                   phase: str | None = None) -> State:
        """One local iteration; the stage comes from the state's counter (``phase``: see client_loss)."""
        s1 = self._stage1_iterations()
        stage1 = (client_state["step"] < s1).to(x.dtype)
        params = client_state["params"]
        grads = grad(self.client_loss)(params, client_state, server_state, x, y, stage1, phase)
        wd, m, lr = self.hp.weight_decay, self.hp.momentum, self.hp.lr
        previous = client_state["mom"]
        if self.hp.stage2_fresh_momentum:  # stage 2 starts a new optimiser (the authors' code)
            keep = (client_state["step"] != s1).to(x.dtype)
            previous = {k: v * keep for k, v in previous.items()}
        # SGD with momentum and weight decay, b <- m b + g + wd p; p <- p - lr b, in fused torch.add kernels
        # (the update of K stacked clients' weights is memory-bound, not the forward/backward)
        mom = {k: torch.add(grads[k], params[k], alpha=wd).add_(previous[k], alpha=m) for k in params}
        # head_only_stage2 (BTFL composition): stage 2 moves only the classifier
        frozen_in_stage2 = {k for k in params if self.hp.head_only_stage2 and not k.startswith("head.")}
        if self.hp.stage2_lr_scale != 1.0:  # the stage-2 rate as a per-client tensor (vmapped step counter)
            step_lr = lr * (stage1 + (1 - stage1) * self.hp.stage2_lr_scale)
            new = {k: params[k] - (lr * stage1 if k in frozen_in_stage2 else step_lr) * mom[k] for k in params}
        else:
            new = {k: params[k] - (lr * stage1) * mom[k] if k in frozen_in_stage2
                   else torch.add(params[k], mom[k], alpha=-lr) for k in params}
        # the uploaded model is the end of stage 1; with a single stage (FedAvg / FedRS: only stage 1; FedPHP:
        # only stage 2, psi_hat uploaded) it is the current model itself
        if 0 < self._stage1_iterations() < self.hp.local_iterations:
            agg = {k: torch.lerp(client_state["agg"][k], new[k], stage1) for k in params}
        else:
            agg = new
        return {**client_state, "params": new, "mom": mom, "agg": agg, "step": client_state["step"] + 1}

    # ------------------------------------------------------------- the server
    def aggregate(self, server_state: State, ids: np.ndarray, client_states: State, weights: torch.Tensor) -> State:
        out = {**server_state, "params": weighted_mean(client_states["agg"], weights)}
        if not self.hp.hpm:
            return out
        hpm, count = self._update_hpm(server_state, ids, client_states["params"])
        return {**out, "hpm": hpm, "count": count}

    def _update_hpm(self, server_state: State, ids: np.ndarray,
                    personal: State) -> tuple[State, torch.Tensor]:
        """Eq. 10 for the clients ``ids``: psi_p <- (1 - mu_k) psi_hat + mu_k psi_p with z_k += 1 and
        mu_k = min(1, mu * z_k / (Q T)) (mu_k = 0 at the first selection: no HPM yet). With
        ``mu_previous_count`` z_k counts the earlier selections only and the cap is ``mu_cap`` (the code)."""
        count = server_state["count"].clone()
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=count.device)
        first = count[ids_t] == 0
        z = count[ids_t] if self.hp.mu_previous_count else count[ids_t] + 1
        count[ids_t] += 1
        mu = torch.clamp(self.hp.mu_macro * z / self.hp.expected_selections, 0.0, self.hp.mu_cap)
        mu = torch.where(first, torch.zeros_like(mu), mu)

        def update(hpm: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            w = mu.reshape(-1, *([1] * (new.ndim - 1))).to(new.dtype)
            out = hpm.clone()
            out[ids_t] = (1 - w) * new + w * hpm[ids_t]
            return out

        return tree_map(update, server_state["hpm"], personal), count

    # ---------------------------------------------------------- evaluation
    def val_params(self, server_state: State, ids: np.ndarray, trainer: LocalTrainer) -> State:
        """Each client's personalised model after one client procedure from the current global model
        (Definition 2: "the performance of the personalized model on the local test set"). Without an HPM
        that is psi_hat; with one it is the HPM updated by that procedure (Eq. 10), which Algorithm 1
        returns as the client's model: "psi^k <- psi_p,T+1^k ... the personalization model for each local
        client" (the authors' FedPHP / MAP code scores the HPM as well)."""
        states = self.client_start(server_state, ids)
        personal = trainer(self.local_step, states, server_state, ids, self.hp.local_iterations,
                           self.local_step_at)["params"]
        if not self.hp.hpm:
            return personal
        return index(self._update_hpm(server_state, ids, personal)[0], ids)

    def local_heads(self, server_state: State) -> State:
        """The clients' HPM classifiers ``{"weight": [K, C, D], "bias": [K, C]}`` (BTFL's local heads when
        trained with ``head_only_stage2``)."""
        return {"weight": server_state["hpm"]["head.weight"], "bias": server_state["hpm"]["head.bias"]}


@register
class FedRS(MAP):
    """RS only: restricted softmax for every local step, uploaded and used as the personalised model."""

    name = "FedRS"

    def __init__(self, model: Classifier, config: Hyper | None = None, seed: int = 0, **overrides: Any) -> None:
        super().__init__(model, config, seed, **{"stage1_fraction": 1.0, "hpm": False, **overrides})


@register
class FedPHP(MAP):
    """FedAvg + HPM (Sec. 4.2): every local step on (1 - lambda) CE + lambda L_kd (Eq. 13) and psi_hat is
    uploaded -- the two stages are MAP's addition ("Different from FedAvg, we take two stages", Sec. 4.3).
    (The authors' fedphp.py does the same.)"""

    name = "FedPHP"

    def __init__(self, model: Classifier, config: Hyper | None = None, seed: int = 0, **overrides: Any) -> None:
        super().__init__(model, config, seed,
                         **{"alpha": 1.0, "stage1_fraction": 0.0, **overrides})
