"""FedICON: "Is Heterogeneity Notorious? Taming Heterogeneity to Handle Test-Time Shift in Federated Learning"
(Tan et al., NeurIPS 2023).

Model: the classifier's ``features`` = encoder h (Eq. 3) and ``head`` = linear classifier; a projection
g: D -> D -> ``proj_dim`` (ReLU MLP, as in SupCon/SimCLR) whose L2-normalised output is the contrastive
representation z. The classifier reads the encoder output (the projection is used only by the losses).

Training, one federated run of ``encoder_rounds + head rounds``:
- rounds < ``encoder_rounds`` (local invariance extraction, Sec. 4.1.1): two augmented views of every
  batch sample, supervised contrastive loss Eq. 4 (tau = 0.1) on z, SGD on encoder + projection;
- later rounds: the linear classifier trained with cross-entropy on the frozen encoder (federated);
- server (Eq. 6): parameters averaged weighted by |D_i| (the engine passes the training-set sizes).
Personalisation of a training client (``val_params``): the head fine-tuned ``ft_iterations`` steps on
the client's own labeled training data, encoder frozen.
Test time (Sec. 4.2): the encoder (and projection) tuned with the unsupervised contrastive loss Eq. 7 on
the client's unlabeled test data -- ``batch`` mode (``tta_epochs`` passes of mini-batches), or ``online``
mode (:meth:`FedICON.online`): the test samples arrive ``online_chunk`` at a time, a memory of
``memory_size`` training samples stands in for A(x); after each step on (and prediction of) the arriving
samples, each replaces a random memory entry.
The TTA step :meth:`FedICON.tta_step` is a pure function (weights, batch, uniforms) -> weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fl_server.algorithms.base import Algorithm, Hyper, LocalTrainer, register
from fl_server.algorithms.contrastive import memory_contrastive_loss, normalize, supcon_loss, unsup_contrastive_loss
from fl_server.data.augment import AugmentConfig, augment, hash_uniform, num_uniforms, two_views
from fl_server.functional import State, broadcast, get_params, grad, make_forward, sgd, weighted_mean
from fl_server.models import Classifier


@dataclass
class FedICONConfig(Hyper):
    lr: float = 0.005  # contrastive loss (paper Sec. 5.1)
    head_lr: float = 0.01  # cross-entropy of the linear classifier
    weight_decay: float = 5e-4
    tau: float = 0.1
    proj_dim: int = 64
    # "mlp": z = normalize(g(h(x))) with the SupCon/SimCLR projection g (D -> D -> proj_dim); "none": the paper's
    # literal Eq. 3, z = normalize(h(x)), the encoder output the classifier reads (D-dimensional)
    projection: str = field(default="mlp", metadata={"fingerprint": "omit_default"})
    encoder_rounds: int = 80  # the remaining rounds train the federated classifier (a recipe: 80% of its rounds)
    ft_iterations: int = 20  # personalisation of the classifier on the client's training data
    tta: bool = True
    tta_mode: str = "batch"  # "batch" or "online"
    tta_lr: float = 0.005
    tta_epochs: int = 1
    tta_batch: int = 64
    memory_size: int = 64  # online mode: stands in for A(x) (training samples, then arriving test samples)
    online_chunk: int = 1  # online mode: test samples arriving per step (the paper: one by one)
    aug_degrees: float = 15.0
    aug_shift: float = 0.1
    aug_contrast: float = 0.4
    aug_noise: float = 0.1


ENCODER_FRACTION = 0.8  # a recipe's share of rounds for the encoder phase where its hyperparameters leave it open


def split_params(params: State) -> tuple[State, State]:
    """(encoder params, head params) of a Classifier's flat parameter dict."""
    enc = {k: v for k, v in params.items() if k.startswith("features.")}
    head = {k: v for k, v in params.items() if k.startswith("head.")}
    return enc, head


def _mix_key(key: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    return key * 1_000_003 + step


@register
class FedICON(Algorithm):
    # the label-free safeguard rule chosen on validation shifts only (lab/safeguard_choice.py;
    # docs/results/safeguard-choice.json), applied by the device after personalising
    safeguard = {"rule": "rollback"}
    name = "FedICON"
    Config = FedICONConfig
    device_step = "fedicon_step"  # batch-mode TTA on the device (fl_server/export/fedicon.py, edge_sdk._fedicon)
    device_weights = ("params", "proj")
    servable = True
    adapt_norm = "batch"  # every Eq. 7 step normalises with the statistics of its 2B augmented views

    def __init__(self, model: Classifier, config: Hyper | None = None, seed: int = 0, **overrides: Any) -> None:
        super().__init__(model, config, seed, **overrides)
        if self.hp.tta_mode not in ("batch", "online"):
            raise ValueError(f"tta_mode must be 'batch' or 'online', got {self.hp.tta_mode!r}")
        if self.hp.projection not in ("mlp", "none"):
            raise ValueError(f"projection must be 'mlp' or 'none', got {self.hp.projection!r}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 104729)
            d = model.feature_dim
            self.projection = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, self.hp.proj_dim)) \
                if self.hp.projection == "mlp" else nn.Identity()  # "none": no parameters, an empty "proj" state
        self.proj_forward = make_forward(self.projection)
        self.features_forward = make_forward(model.features)
        self.head_forward = make_forward(model.head)
        self.aug = AugmentConfig(self.hp.aug_degrees, self.hp.aug_shift, self.hp.aug_contrast, self.hp.aug_noise)
        self.seed = seed
        self._phase = "encoder"

    @classmethod
    def device_step_for(cls, hyper: dict[str, Any]) -> str | None:
        """Without test-time adaptation (``tta=False``) the device runs the received model as it is."""
        return cls.device_step if hyper.get("tta", cls.Config.tta) else None

    @classmethod
    def bundle_artifacts(cls, hyper: dict[str, Any]) -> tuple[str, ...]:
        """``forward`` and ``params``; with TTA the Eq. 7 step and, unless ``projection="none"``, ``proj``."""
        if cls.device_step_for(hyper) is None:
            return ("forward", "params")
        none = hyper.get("projection", cls.Config.projection) == "none"
        return ("forward", "fedicon_step", "params", *(() if none else ("proj",)))

    @classmethod
    def fit_hyper(cls, hyper: dict[str, Any], rounds: int) -> dict[str, Any]:
        """Where ``hyper`` leaves ``encoder_rounds`` open: the encoder for 80% of the run's rounds, the classifier
        for the rest (at least one round), so a run of any length trains both (the class default, 80, is for
        the paper's 100 rounds).

        >>> FedICON.fit_hyper({}, 10), FedICON.fit_hyper({}, 1), FedICON.fit_hyper({"encoder_rounds": 3}, 10)
        ({'encoder_rounds': 8}, {'encoder_rounds': 0}, {'encoder_rounds': 3})
        """
        if "encoder_rounds" in hyper:
            return hyper
        return {**hyper, "encoder_rounds": min(int(round(ENCODER_FRACTION * rounds)), rounds - 1)}

    # ------------------------------------------------------------ pieces
    def represent(self, enc: State, proj: State, x: torch.Tensor) -> torch.Tensor:
        """z = normalize(g(h(x))) [N, proj_dim]."""
        feats = self.features_forward({k[len("features."):]: v for k, v in enc.items()}, x)
        return normalize(self.proj_forward(proj, feats))

    def init_state(self, dtype: torch.dtype, device: torch.device) -> State:
        self.projection.to(device)
        return {"params": get_params(self.model, dtype, device), "proj": get_params(self.projection, dtype, device),
                "round": torch.zeros((), dtype=torch.int64, device=device)}

    @staticmethod
    def projection_state(state: State) -> State:
        """The projection's weights of a server state; {} for ``projection="none"`` (an empty sub-state has no
        key in a checkpoint's flat file, so a restored state lacks it)."""
        return state.get("proj", {})

    def begin_round(self, server_state: State) -> None:
        """The round's phase (encoder, then classifier), also on a Flower client, which never runs client_start."""
        self._phase = "encoder" if int(server_state["round"]) < self.hp.encoder_rounds else "head"

    def client_start(self, server_state: State, ids: np.ndarray) -> State:
        round_ = int(server_state["round"])
        self.begin_round(server_state)
        device = server_state["round"].device
        keys = torch.as_tensor((self.seed * 1_000_033 + round_) * 100_003 + np.asarray(ids, dtype=np.int64),
                               dtype=torch.int64, device=device)
        return {"params": broadcast(server_state["params"], len(ids)),
                "proj": broadcast(self.projection_state(server_state), len(ids)), "key": keys,
                "step": torch.zeros(len(ids), dtype=torch.int64, device=device)}

    # ------------------------------------------------------------ local steps
    def supcon_objective(self, enc: State, proj: State, x: torch.Tensor, y: torch.Tensor,
                         key: torch.Tensor) -> torch.Tensor:
        """Eq. 4 on two augmented views of the batch."""
        z = self.represent(enc, proj, two_views(x, key, self.aug))
        return supcon_loss(z, torch.cat([y, y]), self.hp.tau)

    def encoder_step(self, client_state: State, server_state: State, x: torch.Tensor, y: torch.Tensor) -> State:
        enc, head = split_params(client_state["params"])
        key = _mix_key(client_state["key"], client_state["step"])
        g_enc, g_proj = grad(self.supcon_objective, argnums=(0, 1))(enc, client_state["proj"], x, y, key)
        enc = sgd(enc, g_enc, self.hp.lr, self.hp.weight_decay)
        proj = sgd(client_state["proj"], g_proj, self.hp.lr, self.hp.weight_decay)
        return {**client_state, "params": {**enc, **head}, "proj": proj, "step": client_state["step"] + 1}

    def head_step(self, client_state: State, server_state: State, x: torch.Tensor, y: torch.Tensor) -> State:
        """Cross-entropy on the frozen encoder's features."""
        enc, head = split_params(client_state["params"])
        feats = self.features_forward({k[len("features."):]: v for k, v in enc.items()}, x).detach()

        def ce(h: State) -> torch.Tensor:
            return F.cross_entropy(self.head_forward({k[len("head."):]: v for k, v in h.items()}, feats), y)

        head = sgd(head, grad(ce)(head), self.hp.head_lr, self.hp.weight_decay)
        return {**client_state, "params": {**enc, **head}, "step": client_state["step"] + 1}

    def local_step(self, client_state: State, server_state: State, x: torch.Tensor, y: torch.Tensor) -> State:
        step = self.encoder_step if self._phase == "encoder" else self.head_step
        return step(client_state, server_state, x, y)

    def aggregate(self, server_state: State, ids: np.ndarray, client_states: State, weights: torch.Tensor) -> State:
        """Eq. 6: size-weighted average (the part a phase does not train is identical on every client)."""
        return {"params": weighted_mean(client_states["params"], weights),
                "proj": weighted_mean(client_states["proj"], weights), "round": server_state["round"] + 1}

    # ------------------------------------------------------------ evaluation
    def val_params(self, server_state: State, ids: np.ndarray, trainer: LocalTrainer) -> State:
        """Personalised classifiers: the head fine-tuned on each client's training data (stacked)."""
        states = self.client_start(server_state, ids)
        return trainer(self.head_step, states, server_state, ids, self.hp.ft_iterations)["params"]

    def tta_objective(self, enc: State, proj: State, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Eq. 7 on the batch ``x`` [N, ...]; ``u`` [2N, num_uniforms] draws the two views."""
        z = self.represent(enc, proj, augment(torch.cat([x, x]), u, self.aug))
        return unsup_contrastive_loss(z, self.hp.tau)

    def tta_step(self, params: State, proj: State, x: torch.Tensor, u: torch.Tensor) -> tuple[State, State]:
        """One SGD step of Eq. 7: pure (classifier params, projection, batch, uniforms) -> (params, projection)."""
        enc, head = split_params(params)
        g_enc, g_proj = grad(self.tta_objective, argnums=(0, 1))(enc, proj, x, u)
        return {**sgd(enc, g_enc, self.hp.tta_lr), **head}, sgd(proj, g_proj, self.hp.tta_lr)

    def _uniforms(self, x: torch.Tensor, n: int, tag: int | torch.Tensor) -> torch.Tensor:
        """[n, K] uniforms for views of x's images, a pure function of (seed, tag); a device tensor ``tag`` (the
        online stream's precomputed keys) needs no host-to-device copy."""
        key = torch.as_tensor(tag, dtype=torch.int64, device=x.device) + self.seed * 7_919
        return hash_uniform(key, n, num_uniforms(x.shape[1:])).to(x.dtype)

    def personalize(self, server_state: State, x: torch.Tensor) -> State:
        """Batch-mode TTA of ``server_state['params']`` on unlabeled ``x``; identity when ``tta`` is off."""
        params, proj = server_state["params"], self.projection_state(server_state)
        if not self.hp.tta:
            return params
        if self.hp.tta_mode == "online":
            return self.online(params, proj, x, x[:0])[0]
        bs = self.hp.tta_batch
        for epoch in range(self.hp.tta_epochs):  # mini-batch passes; the loop is over batches, not samples
            order = torch.from_numpy(np.random.default_rng([self.seed, epoch]).permutation(len(x))).to(x.device)
            for i, start in enumerate(range(0, len(x), bs)):
                xb = x[order[start:start + bs]]
                if len(xb) < 2:
                    continue
                u = self._uniforms(xb, 2 * len(xb), epoch * 1_000_003 + i)
                params, proj = self.tta_step(params, proj, xb, u)
                params, proj = {k: v.detach() for k, v in params.items()}, {k: v.detach() for k, v in proj.items()}
        return params

    def online_step(self, params: State, proj: State, x: torch.Tensor, memory: torch.Tensor,
                    u: torch.Tensor) -> tuple[State, State]:
        """Online Eq. 7 for the arriving samples ``x`` [b, ...]: positive = one augmented view (``u`` [b, K]),
        A(x) = that view + the memory samples [M, ...]."""
        enc, head = split_params(params)

        def objective(e: State, p: State) -> torch.Tensor:
            z = self.represent(e, p, torch.cat([x, augment(x, u, self.aug), memory]))
            b = len(x)
            return memory_contrastive_loss(z[:b], z[b:2 * b], z[2 * b:], self.hp.tau)

        g_enc, g_proj = grad(objective, argnums=(0, 1))(enc, proj)
        return {**sgd(enc, g_enc, self.hp.tta_lr), **head}, sgd(proj, g_proj, self.hp.tta_lr)

    def online(self, params: State, proj: State, stream: torch.Tensor, memory: torch.Tensor,
               chunk: int | None = None) -> tuple[State, torch.Tensor]:
        """Online mode over ``stream`` [N, ...] arriving ``chunk`` (default ``hp.online_chunk``) samples at a
        time: adapt on the arriving samples, predict them with the adapted model, then they enter the memory
        (:meth:`remember`). ``memory`` starts as training samples (empty: filled by the first test samples).
        Returns (final params, logits [N, C] in stream order)."""
        chunk = chunk or self.hp.online_chunk
        rng = np.random.default_rng([self.seed, 17])
        memory = memory[: self.hp.memory_size].clone()
        starts = range(0, len(stream), chunk)
        # every chunk's random draws made up front and sent to the device once (the same draws in the same order
        # as at each chunk): the loop then never waits on a host-to-device copy, which on a GPU would stall the
        # queue once per streamed sample
        plan, filled = [], len(memory)
        for start in starts:
            filled, slots = self._slots(filled, min(chunk, len(stream) - start), rng)
            plan.append(slots)
        all_slots = torch.from_numpy(np.concatenate([np.empty(0, np.int64), *plan])).to(stream.device)
        bounds = np.cumsum([0, *(len(s) for s in plan)]).tolist()
        keys = torch.arange(len(starts), dtype=torch.int64, device=stream.device)
        out = []
        for i, start in enumerate(starts):  # samples arrive one chunk at a time
            xb = stream[start:start + chunk]
            if len(memory):
                params, proj = self.online_step(params, proj, xb, memory, self._uniforms(xb, len(xb), keys[i]))
                params, proj = {k: v.detach() for k, v in params.items()}, {k: v.detach() for k, v in proj.items()}
            with torch.no_grad():
                out.append(self.forward(params, xb))
            memory = self._place(memory, xb, all_slots[bounds[i]:bounds[i + 1]])
        return params, torch.cat(out)

    def remember(self, memory: torch.Tensor, xb: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """The memory after the samples ``xb`` arrive: they fill it up to ``memory_size``, then each of the
        rest replaces a random entry (distinct entries; of a chunk longer than the memory, its last samples)."""
        slots = self._slots(len(memory), len(xb), rng)[1]
        return self._place(memory, xb, torch.from_numpy(slots).to(memory.device))

    def _slots(self, filled: int, arriving: int, rng: np.random.Generator) -> tuple[int, np.ndarray]:
        """(the memory's size once ``arriving`` samples have filled it up to ``memory_size``, the entries that
        the remaining ones overwrite, drawn from ``rng``)."""
        size = filled + min(max(self.hp.memory_size - filled, 0), arriving)
        rest = min(arriving - (size - filled), size)
        return size, (rng.choice(size, size=rest, replace=False) if rest else np.empty(0, np.int64))

    def _place(self, memory: torch.Tensor, xb: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``xb``'s first samples fill the memory up to ``memory_size``; its last ``len(slots)`` overwrite those."""
        memory = torch.cat([memory, xb[:max(self.hp.memory_size - len(memory), 0)]])
        if len(slots):
            memory[slots] = xb[len(xb) - len(slots):]
        return memory


@register
class FedICONNoTTA(FedICON):
    """The ablation without test-time adaptation (same training)."""

    name = "FedICON w/o TTA"
    device_step = None  # the received model as it is

    def __init__(self, model: Classifier, config: Hyper | None = None, seed: int = 0, **overrides: Any) -> None:
        super().__init__(model, config, seed, **{"tta": False, **overrides})
