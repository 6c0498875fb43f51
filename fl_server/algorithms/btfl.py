"""BTFL training recipe (Sec. 4 and App. "Training settings" of "BTFL: A Bayesian-based Test-Time Generalization
Method for Internal and External Data Distributions in Federated Learning", Zhou and Liu, KDD '25, arXiv:2503.06633).

Two heads on one feature extractor phi (post-ReLU features z, dimension D):
* the global model (phi + global head) is trained with FedAvg: CE on the client's data, weighted average;
* every client keeps a bias-free local head Linear(D, C), trained on *frozen* features after the round's local
  training ("5-epoch local training followed by a 1-epoch personalization phase"; only the global model is
  uploaded). Here a round is ``local_iterations`` steps: the first ``body_iterations`` train phi + global head,
  the rest train the local head on detached features (masks, so the step stays pure and vmappable).

After training (:meth:`BTFL.client_artifacts`) each client computes on its training set, with the final global
features: its local DLE (fsq level frequencies, Eqs. 5-6), H_l_bar / H_g_bar (mean entropies of the two heads,
Eq. 15) and the mean feature (FedTHE's local prototype). The server's global DLE for client k is the average of
the *other* clients' DLEs (leave-one-out, as the authors); the global prototype is the mean of all prototypes.
Test time runs on the device in numpy (:class:`edge_sdk._btfl.BTFLStream`); see ``lab.btgfl``.

In the simulation the local heads live in the server state (stacked [K, C, D]) for convenience; in a real
deployment they never leave the client.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from edge_sdk.shared import average_dles, fit_dle
from fl_server.algorithms.base import Algorithm, Hyper, StepFn, register
from fl_server.algorithms.losses import entropy_from_logits
from fl_server.functional import State, broadcast, grad, tree_map, weighted_mean


@dataclass
class BTFLConfig(Hyper):
    lr: float = 0.01  # paper (CNN on CIFAR-10): SGD lr 0.01, weight decay 5e-4
    weight_decay: float = 5e-4
    head_lr: float | None = None  # local-head lr (None: lr)
    # steps per round on phi + global head; the remaining local iterations train the local head. The btgfl runner
    # sets it to 5/6 of the round (5 local epochs + 1 personalization epoch). None (for protocols that do not
    # set it): every 6th step of a round is a local-head step (the same 5:1 ratio, interleaved).
    body_iterations: int | None = None
    dle_levels: int = 2  # fsq levels (paper: round(tanh z) in {0, 1})


@dataclass
class ClientArtifacts:
    """What client k's device needs besides phi and the global head (all numpy, no pickle)."""

    local_head: np.ndarray  # [C, D] (BTFL's own heads are bias-free)
    local_dle: np.ndarray  # [D, L] level frequencies on the client's training features
    global_dle: np.ndarray  # [D, L] average of the other clients' local DLEs
    h_local_bar: float  # mean entropy of the local head on the training set (nats)
    h_global_bar: float  # mean entropy of the global head on the training set
    mu_local: np.ndarray  # [D] mean training feature (FedTHE)
    mu_global: np.ndarray  # [D] mean of all clients' mu_local (FedTHE)
    local_bias: np.ndarray | None = None  # [C], when the local head comes with a bias (MAP's HPM classifier)

    def local_logits(self, z: np.ndarray) -> np.ndarray:
        """The local head on features z [N, D] -> [N, C]."""
        out = z @ self.local_head.T
        return out if self.local_bias is None else out + self.local_bias

    def arrays(self) -> dict[str, np.ndarray]:
        """Flat float arrays for an ``.npz`` weight file."""
        out = {"local_head": self.local_head, "local_dle": self.local_dle, "global_dle": self.global_dle,
               "h_bar": np.array([self.h_local_bar, self.h_global_bar]), "mu_local": self.mu_local,
               "mu_global": self.mu_global}
        return out if self.local_bias is None else {**out, "local_bias": self.local_bias}


@register
class BTFL(Algorithm):
    name = "BTFL"
    default_job = True  # trained by a coordinator with an empty store
    device_step = "btfl"  # the device's two-head stream (edge_sdk), on the frozen ``features`` graph
    device_labels = True  # a device fits its local head on its own labeled samples
    finalize_weights = ("btfl",)  # the training clients' global DLE and mean feature (:meth:`finalize`)
    servable = True
    per_client_keys = ("local_heads",)
    client_private = {"local_head": "local_heads"}
    Config = BTFLConfig

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.num_train_clients: int | None = None
        self._head_seed = kwargs.get("seed", 0)
        self._phase_steps = {phase: functools.partial(self.local_step, phase=phase) for phase in ("body", "head")}

    def attach(self, x: torch.Tensor, y: torch.Tensor, train: list[np.ndarray]) -> None:
        self.num_train_clients = len(train)

    # ---------------------------------------------------------------- model pieces
    def features(self, params: State, x: torch.Tensor) -> torch.Tensor:
        """phi(x) -> z [N, D] (post-ReLU) with functional params of the whole classifier."""
        sub = {k[len("features."):]: v for k, v in params.items() if k.startswith("features.")}
        return functional_call(self.model.features, sub, (x,))

    @staticmethod
    def global_head(params: State, z: torch.Tensor) -> torch.Tensor:
        return z @ params["head.weight"].T + params["head.bias"]

    # ---------------------------------------------------------------- training
    def init_state(self, dtype: torch.dtype, device: torch.device) -> State:
        if self.num_train_clients is None:
            raise ValueError("BTFL needs the number of training clients: call attach() first (the simulation does)")
        state = super().init_state(dtype, device)
        c, d = state["params"]["head.weight"].shape
        gen = torch.Generator().manual_seed(int(self._head_seed) + 7919)
        bound = 1.0 / d ** 0.5  # nn.Linear's default init range
        heads = (torch.rand(self.num_train_clients, c, d, generator=gen) * 2 - 1) * bound
        return {**state, "local_heads": heads.to(dtype=dtype, device=device)}

    def client_start(self, server_state: State, ids: np.ndarray) -> State:
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=server_state["local_heads"].device)
        k = len(ids)
        return {"params": broadcast(server_state["params"], k), "local_head": server_state["local_heads"][ids_t].clone(),
                "step": torch.zeros(k, device=ids_t.device)}

    def _is_body(self, step: torch.Tensor | int) -> torch.Tensor | bool:
        """Local iteration ``step`` trains the body (else the local head on frozen features)."""
        return step % 6 != 5 if self.hp.body_iterations is None else step < self.hp.body_iterations

    def local_step_at(self, t: int) -> StepFn:
        return self._phase_steps["body" if self._is_body(t) else "head"]

    def local_step(self, client_state: State, server_state: State, x: torch.Tensor, y: torch.Tensor,
                   phase: str | None = None) -> State:
        """One local iteration; the phase comes from the state's counter. ``phase`` ("body" / "head", what
        ``local_step_at`` passes when every client is at the same iteration) skips the other phase's
        zero-weighted work (the backward through the features in a head step); the result is the same."""
        body = self._is_body(client_state["step"]).to(x.dtype)  # type: ignore[union-attr]  # 1: body, 0: head

        def loss(params: State, head: torch.Tensor) -> torch.Tensor:
            z = self.features(params, x)
            ce_g = body * F.cross_entropy(self.global_head(params, z), y) if phase != "head" else 0.0
            ce_l = (1 - body) * F.cross_entropy(z.detach() @ head.T, y) if phase != "body" else 0.0  # frozen z
            return ce_g + ce_l

        g_params, g_head = grad(loss, argnums=(0, 1))(client_state["params"], client_state["local_head"])
        lr, wd = self.hp.lr, self.hp.weight_decay
        head_lr = self.hp.head_lr if self.hp.head_lr is not None else lr
        params, head = client_state["params"], client_state["local_head"]
        if phase != "head":
            params = tree_map(lambda p, g: p - body * lr * (g + wd * p), params, g_params)
        if phase != "body":
            head = head - (1 - body) * head_lr * (g_head + wd * head)
        return {"params": params, "local_head": head, "step": client_state["step"] + 1}

    @classmethod
    def min_local_iterations(cls, hyper: dict[str, Any]) -> int:
        """The body steps and one head step: 6 with the default alternation (five body steps, then a head step),
        else ``body_iterations + 1``."""
        body = hyper.get("body_iterations")
        if body is not None and (not isinstance(body, int) or isinstance(body, bool) or body < 0):
            raise ValueError(f"hyper: BTFL's body_iterations is a number of steps (an integer >= 0), got {body!r}")
        return 6 if body is None else body + 1

    def aggregate(self, server_state: State, ids: np.ndarray, client_states: State, weights: torch.Tensor) -> State:
        need = self.min_local_iterations(asdict(self.hp))
        if bool((client_states["step"] < need).any()):
            raise ValueError(f"BTFL: a round must run at least {need} local iterations (body_iterations="
                             f"{self.hp.body_iterations}), or the local heads are never trained")
        heads = server_state["local_heads"].clone()
        heads[torch.as_tensor(ids, dtype=torch.long, device=heads.device)] = client_states["local_head"]
        return {**server_state, "params": weighted_mean(client_states["params"], weights), "local_heads": heads}

    # ---------------------------------------------------------------- artifacts
    @classmethod
    def bundle_artifacts(cls, hyper: dict[str, Any]) -> tuple[str, ...]:
        """The frozen ``features`` graph (features and global logits), ``forward``, ``params`` and ``btfl``."""
        return ("features", "forward", "params", "btfl")

    def finalize(self, server_state: State, x: torch.Tensor, train: list[np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
        """``btfl``: the global DLE [D, L] -- the average of every training client's local DLE on its training set
        with the final features (BTFL Sec. 4.1: every client weighs the same) -- the number of clients behind it,
        and the mean of their mean features (FedTHE's global prototype)."""
        arts = self.client_artifacts(server_state, x, train)
        return self.finalize_from_uploads([{"local_dle": a.local_dle, "mu_local": a.mu_local} for a in arts])

    @staticmethod
    def finalize_from_uploads(uploads: list[dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
        """:meth:`finalize`'s weight sets from every training client's upload (:meth:`local_upload`: local DLE and
        mean feature), so an in-process run and the Flower server (which gets the uploads) write the same."""
        return {"btfl": {"global_dle": average_dles([u["local_dle"] for u in uploads]),
                         "dle_clients": np.array([len(uploads)], dtype=np.int64),
                         "mu_global": np.mean([u["mu_local"] for u in uploads], axis=0).astype(np.float64)}}

    @torch.no_grad()
    def client_features(self, params: State, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """phi(x) [N, D] of one client's samples, ``chunk`` at a time."""
        return torch.cat([self.features(params, x[s:s + chunk]) for s in range(0, len(x), chunk)])

    @torch.no_grad()
    def local_upload(self, params: State, x: torch.Tensor) -> dict[str, np.ndarray]:
        """A client's local DLE [D, L] (Eqs. 5-6) and mean feature [D] on its training samples ``x`` with the
        global features: what a Flower client uploads for :meth:`finalize_from_uploads`."""
        z = self.client_features(params, x).double().cpu().numpy()
        return {"local_dle": fit_dle(z, self.hp.dle_levels), "mu_local": z.mean(0)}

    @torch.no_grad()
    def client_artifacts(self, server_state: State, x: torch.Tensor, train: list[np.ndarray],
                         chunk: int = 4096, local_heads: State | None = None) -> list[ClientArtifacts]:
        """Per training client: DLEs, mean head entropies and prototypes from its training set (``train[k]``
        indexes ``x``), with the final global features. Global DLE of client k = mean of the other clients'.
        ``local_heads`` {"weight": [K, C, D], "bias": [K, C]} replaces BTFL's own bias-free heads (e.g. MAP's
        HPM classifiers, :func:`fl_server.algorithms.compose.map_btfl_artifacts`)."""
        params = server_state["params"]
        heads = server_state["local_heads"] if local_heads is None else local_heads["weight"]
        biases = None if local_heads is None else local_heads["bias"]
        local = []
        for k, idx in enumerate(train):  # one pass per client over its own data (K small)
            z = self.client_features(params, x[torch.from_numpy(idx).to(x.device)], chunk)
            h_l = entropy_from_logits(z @ heads[k].T + (0 if biases is None else biases[k])).mean()
            h_g = entropy_from_logits(self.global_head(params, z)).mean()
            z_np = z.double().cpu().numpy()
            local.append((fit_dle(z_np, self.hp.dle_levels), float(h_l), float(h_g), z_np.mean(0)))
        dles = np.stack([d for d, *_ in local])
        mus = np.stack([m for *_, m in local])
        k_all = len(local)
        out = []
        for k, (dle, h_l, h_g, mu) in enumerate(local):
            others = (dles.sum(0) - dle) / (k_all - 1) if k_all > 1 else dle  # leave-one-out average
            bias = None if biases is None else biases[k].double().cpu().numpy()
            out.append(ClientArtifacts(heads[k].double().cpu().numpy(), dle, others, h_l, h_g, mu, mus.mean(0), bias))
        return out
