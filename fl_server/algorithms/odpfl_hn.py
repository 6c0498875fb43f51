"""ODPFL-HN: on-demand personalised FL with a client encoder and a hypernetwork (Algorithm 1, Eq. 1, Sec. 7 of
"Late to the Party? On-Demand Unlabeled Personalized Federated Learning" (Amosy, Eyal and Chechik, WACV 2024,
arXiv:2111.08356)).

Modules (both owned by the server, shipped to clients as needed):
  g_gamma  client encoder, a deep set over the client's samples  [N, *input_shape] -> e [E]
           phi(x) = Linear(D, 200)(trunk(x)) with trunk = ``features`` of the target architecture;
           pooling: mean of units 0..99, max of units 100..199; psi = Linear(200, E).
           DP mode (Sec. 7, Lemma 2): phi(x) on the unit sphere (B = 1), mean pooling only, then psi.
  f_theta  hypernetwork  e [E] (or [K, E]) -> w, the target model's params (leading K when batched):
           E -> 100 -> 100 -> 100 (ReLU) -> one linear head per target parameter tensor.
Objective (Eq. 1): L(theta, gamma) = sum_i sum_j l(h(x_j^i; f_theta(g_gamma(D_i))), y_j^i).
Round (Algorithm 1, pFedHN chain rule):
  client:  e_i = g_gamma(D_i)                                   (ClientEncoding; all of D_i in one pass)
  server:  w_i = f_theta(e_i)
  client:  w_i^new = SGD on CE(h(.; w), .) from w_i;  Delta w_i = w_i^new - w_i      (ClientUpdate)
  server:  (Delta theta, Delta e_i) = (dw_i/dtheta, dw_i/de_i)^T (-Delta w_i)        (chain rule)
           theta <- SGD(momentum 0.9, wd 1e-3, clip 50)(theta, Delta theta)
  client:  Delta gamma = (de_i/dgamma)^T Delta e_i                                   (ClientBackprop)
  server:  gamma <- gamma - encoder_lr * Delta gamma
With K clients per round the chain-rule gradients are averaged, weighted by the clients' training-set sizes.
Two-phase training (App. B.2, ``two_phase=True``), for when the end-to-end encoder does not separate clients:
  phase 1 (rounds < phase1_rounds): pFedHN with a learned embedding e_i per training client (Eq. 9; N(0, 1)
           init like nn.Embedding), trained by the same chain rule; in parallel each selected client fits the
           encoder to its current e_i by ``encoder_local_steps`` full-set GD steps on ||g_gamma(D_i) - e_i||^2
           (Eq. 10) and the server averages the encoders (weighted by data size);
  phase 2: the encoder is frozen and theta is fine-tuned on w_i = f_theta(g_gamma(D_i)) (Eq. 11).
Validation always uses the encoder's embedding of the client's data, the path a new client takes.
New client (inference): it computes e_new = g_gamma(D_new) locally and sends only e_new; the server returns
w_new = f_theta(e_new). With a finite dp_epsilon (Sec. 7) the Gaussian noise goes on the pooled vector, whose
sensitivity is 2/|D|, before psi (:func:`edge_sdk._dp.privatize_pooled`; the same guarantee as Lemma 2's noise
on e, which scales with psi's spectral norm, and less noise in every direction).

State: ``params`` (f_theta(0), only so that generic helpers have a target model), ``hn`` (theta),
``hn_mom`` (theta's momentum buffers), ``enc`` (gamma); two-phase adds ``emb`` [N, E] and ``emb_mom`` (the
learned training-client embeddings and their momentum); two-phase and ``embedding_noise`` add ``round``
(rounds done: a resumed run knows its phase and draws the same noise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from edge_sdk.shared import privatize_pooled
from fl_server.algorithms.base import Algorithm, Hyper, LocalTrainer, register
from fl_server.functional import (State, clip_by_global_norm, get_params, grad, make_forward, sgd, sgd_step,
                                  tree_map)
from fl_server.models import Classifier, build_model


# clients encoded in one concatenated pass hold at most this many samples together, per device type (bounds the
# activations a pass keeps for the encoder's backward; a client larger than this is encoded alone). On the CPU one
# pass per client is fastest (docs/benchmarks/odpfl-round.json: concatenating 8,192 samples is ~2x slower, the big
# activations cost more than the per-pass overhead saved), so 0 there; on a GPU, where a client's ~600-sample pass
# is launch-bound, they are concatenated: on an H200, 1.7x faster than one pass per client (embedding and
# backprop of 50 clients, 0.09 s against 0.15 s; same file, `python benchmarks/odpfl_round.py --device cuda`).
ENCODE_CHUNK_SAMPLES = {"cpu": 0, "cuda": 8192}


# ODPFL-HN's hypernetwork has about hn_width x (the target model's weights) parameters: the ConvNet of UPFL Table 1
# (1.66M weights, width 100: 166M) fits
MAX_HYPERNETWORK_PARAMS = 200_000_000


@dataclass
class ODPFLHNConfig(Hyper):
    """Defaults: UPFL Table 4, MNIST. ``lr`` (base field) is unused: the local step uses ``local_lr``."""

    local_lr: float = 0.3  # client SGD on the generated model
    encoder_lr: float = 0.5  # gamma
    hn_lr: float = 0.5  # theta
    hn_momentum: float = 0.9  # pFedHN
    hn_weight_decay: float = 1e-3  # pFedHN
    hn_clip: float = 50.0  # pFedHN: global grad-norm clip of theta's gradient
    embed_dim: int = 32  # E (UPFL re-implementation)
    set_width: int = 200  # width of phi's output; half mean- half max-pooled
    hn_width: int = 100
    hn_layers: int = 3
    encoder_model: str = "mlp"  # trunk of the encoder = ``features`` of this zoo model (the protocol's model)
    dp: bool = False  # Sec. 7 encoder: unit-sphere phi, mean pooling only
    dp_epsilon: float = math.inf  # new clients' privacy budget (inf: no noise)
    dp_delta: float = 0.01
    two_phase: bool = False  # App. B.2 (see the module docstring)
    phase1_rounds: int = 0  # two-phase: rounds of phase 1; fine-tuning with the frozen encoder afterwards
    embedding_lr: float | None = None  # two-phase: lr of the learned embeddings (None: hn_lr, as pFedHN)
    embedding_init_std: float = 1.0  # two-phase: nn.Embedding's N(0, 1)
    embedding_init: str = "normal"  # two-phase: "normal" (N(0, std^2)) or "encoder" (g_gamma(D_i) at init)
    standardize_init: bool = False  # data-dependent init of psi: training clients' embeddings ~ zero mean, unit std
    encoder_local_steps: int = 5  # two-phase: a client's GD steps on Eq. 10 per round
    # momentum of the client's local SGD on the generated model, zero at the start of its round (the ODPFL-HN
    # paper's appendix: pFedHN's mu_local = 0.9, "ODPFL-HN: the same parameters"); 0: plain SGD (UPFL Table 4)
    local_momentum: float = field(default=0.0, metadata={"fingerprint": "omit_default"})
    # std of Gaussian noise added to the training clients' embeddings before the hypernetwork generates their
    # models (training only; new clients and validation use the clean embedding). A regulariser against the
    # hypernetwork memorising the training clients' embeddings; in the units of the embedding (with
    # ``standardize_init`` the clients' spread is ~1 per dimension). 0: none (the paper)
    embedding_noise: float = field(default=0.0, metadata={"fingerprint": "omit_default"})
    # init of the hypernetwork's output heads. "default": nn.Linear's (pFedHN), which serves every client weights of
    # one scale in every layer (the heads' fan-in is 100), not each layer's own fan-in scale as the target's init.
    # "target": each head's bias is the target model's own init (the model FedAvg starts from) and its weight is
    # nn.Linear's times ``hn_head_scale``, so f_theta(e) starts at that model plus a small client-dependent part,
    # and the gradient reaching the hidden layers through the heads is ``hn_head_scale`` times smaller
    hn_head_init: str = field(default="default", metadata={"fingerprint": "omit_default"})
    hn_head_scale: float = field(default=1.0, metadata={"fingerprint": "omit_default"})


class SetEncoder(nn.Module):
    """Deep-set client encoder g_gamma: a set [N, *input_shape] -> embedding [embed_dim] (order invariant)."""

    def __init__(self, trunk: nn.Module, feature_dim: int, embed_dim: int, width: int = 200,
                 dp: bool = False) -> None:
        super().__init__()
        if width % 2:
            raise ValueError(f"set width must be even (half mean-, half max-pooled), got {width}")
        self.trunk = trunk
        self.phi = nn.Linear(feature_dim, width)
        self.psi = nn.Linear(width, embed_dim)
        self.dp = dp

    def per_sample(self, x: torch.Tensor) -> torch.Tensor:
        """phi(x): [N, *input_shape] -> [N, width]; on the unit sphere in DP mode (same map as
        :func:`edge_sdk._dp.unit_sphere`)."""
        h = self.phi(self.trunk(x))
        if self.dp:
            h = h / torch.clamp(torch.linalg.vector_norm(h, dim=-1, keepdim=True), min=1e-12)
        return h

    def pool(self, h: torch.Tensor) -> torch.Tensor:
        """[N, width] -> [width]: mean (DP) or mean of the first half | max of the second half."""
        if self.dp:
            return h.mean(0)
        half = h.shape[-1] // 2
        return torch.cat([h[:, :half].mean(0), h[:, half:].amax(0)])

    def pool_segments(self, h: torch.Tensor, segment: torch.Tensor, sets: int) -> torch.Tensor:
        """:meth:`pool` of several sets in one call: rows of ``h`` [N, width] belong to set ``segment`` [N]
        (0..sets-1, every set non-empty) -> [sets, width]. Means by a one-hot [sets, N] matmul (deterministic on
        a GPU, unlike atomic index_add), maxima by scatter_reduce (exact in any order); no loop over sets."""
        members = F.one_hot(segment, sets).T.to(h.dtype)  # [sets, N]
        counts = members.sum(1, keepdim=True)
        if self.dp:
            return members @ h / counts
        half = h.shape[-1] // 2
        mean = members @ h[:, :half] / counts
        rest = h[:, half:]
        top = h.new_zeros(sets, rest.shape[1]).scatter_reduce(0, segment.unsqueeze(1).expand_as(rest), rest, "amax",
                                                              include_self=False)
        return torch.cat([mean, top], 1)

    def forward(self, x: torch.Tensor, pooled_only: bool = False, segment: torch.Tensor | None = None,
                sets: int = 0) -> torch.Tensor:
        """e = psi(pool(phi(x))); ``pooled_only``: the pooled vector before psi (where DP noise goes).
        With ``segment`` [N] (set index of each row) x holds ``sets`` sets and the result is [sets, E]."""
        h = self.per_sample(x)
        pooled = self.pool(h) if segment is None else self.pool_segments(h, segment, sets)
        return pooled if pooled_only else self.psi(pooled)


class HyperNetwork(nn.Module):
    """f_theta: e [E] or [K, E] -> {name: tensor of the target param's shape (leading K when batched)}."""

    def __init__(self, embed_dim: int, target_shapes: dict[str, torch.Size], width: int = 100,
                 layers: int = 3) -> None:
        super().__init__()
        body: list[nn.Module] = []
        in_dim = embed_dim
        for _ in range(layers):
            body += [nn.Linear(in_dim, width), nn.ReLU()]
            in_dim = width
        self.body = nn.Sequential(*body)
        self.names = list(target_shapes)
        self.shapes = [tuple(target_shapes[n]) for n in self.names]
        self.heads = nn.ModuleList(nn.Linear(width, math.prod(s)) for s in self.shapes)

    @torch.no_grad()
    def start_at(self, target: dict[str, torch.Tensor], head_scale: float) -> None:
        """Heads' biases := the target params (flattened), heads' weights *= head_scale: f_theta(e) is then the
        target model plus a client-dependent part of ``head_scale`` times the default init's size."""
        if not head_scale >= 0:
            raise ValueError(f"hn_head_scale must be >= 0, got {head_scale}")
        for name, head in zip(self.names, self.heads):
            head.bias.copy_(target[name].detach().reshape(-1))
            head.weight.mul_(head_scale)

    def forward(self, e: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(e)
        lead = tuple(e.shape[:-1])
        return {n: head(h).reshape(*lead, *s) for n, s, head in zip(self.names, self.shapes, self.heads)}


@register
class ODPFLHN(Algorithm):
    # the label-free safeguard rule chosen on validation shifts only (lab/safeguard_choice.py;
    # docs/results/safeguard-choice.json), applied by the device after personalising
    safeguard = {"rule": "rollback"}
    name = "ODPFL-HN"
    default_job = True  # trained by a coordinator with an empty store
    Config = ODPFLHNConfig
    needs_client_data = ("two-phase training and standardize_init build the server's state from every client's "
                         "data at init (no message carries it); train the one-phase method (the default)")
    device_step = "encoder"  # the device encodes its set; theta (hn) stays on the server
    device_weights = ("params", "enc")
    servable = True
    publish_refusal = ("its hypernetwork stays on the coordinator that trained it; train ODPFL-HN as a coordinator "
                       "job (POST /v1/jobs) instead")

    @classmethod
    def check_model(cls, model: Classifier, hyper: dict[str, Any]) -> bool:
        """The hypernetwork has one output head per weight tensor of the target model, ``hn_width`` wide: about
        hn_width x (the model's weights) parameters, over :data:`MAX_HYPERNETWORK_PARAMS` refused. The encoder and
        hypernetwork themselves are built when the run starts (they can be large)."""
        width = cls.Config(**hyper).hn_width
        weights = sum(p.numel() for p in model.parameters())
        size = weights * (width + 1)
        if size > MAX_HYPERNETWORK_PARAMS:
            raise ValueError(f"its hypernetwork generates all {weights:,} weights, about {size:,} parameters at "
                             f"hn_width {width} (limit {MAX_HYPERNETWORK_PARAMS:,}); use a smaller model (e.g. "
                             f"'lenet') or another method")
        return True

    def __init__(self, model: Classifier, config: Hyper | None = None, seed: int = 0,
                 encoder_factory: Callable[[], Classifier] | None = None, **overrides: Any) -> None:
        """``encoder_factory``: fresh copies of a model outside the zoo, whose ``features`` become the encoder's
        trunk (``encoder_model`` then only labels it, e.g. ``"recipe"``)."""
        super().__init__(model, config, seed, **overrides)
        hp = self.hp
        if hp.dp_epsilon is None:  # a bundle manifest (strict JSON) writes the unbounded budget as null
            hp.dp_epsilon = math.inf
        if not (hp.dp_epsilon > 0) or not (0 < hp.dp_delta < 1):
            raise ValueError(f"need dp_epsilon > 0 and 0 < dp_delta < 1, got {hp.dp_epsilon}, {hp.dp_delta}")
        if math.isfinite(hp.dp_epsilon) and not hp.dp:
            raise ValueError("a finite dp_epsilon needs the DP encoder (dp=True): the noise is calibrated to "
                             "the sensitivity of the unit-sphere, mean-pooled encoder (Sec. 7)")
        if model.input_shape is None:
            raise ValueError("ODPFL-HN needs the model's input_shape (build it with build_model)")
        if hp.two_phase and (hp.phase1_rounds < 1 or hp.encoder_local_steps < 1):
            raise ValueError(f"two-phase training needs phase1_rounds >= 1 and encoder_local_steps >= 1, got "
                             f"{hp.phase1_rounds}, {hp.encoder_local_steps}")
        with torch.random.fork_rng(devices=[]):  # seeded init, global RNG untouched
            torch.manual_seed(seed + 104_729)
            enc_model = (encoder_factory() if encoder_factory is not None
                         else build_model(hp.encoder_model, model.input_shape, model.num_classes))
            self.encoder = SetEncoder(enc_model.features, enc_model.feature_dim, hp.embed_dim, hp.set_width, hp.dp)
            shapes = {n: p.shape for n, p in model.named_parameters()}
            self.hypernet = HyperNetwork(hp.embed_dim, shapes, hp.hn_width, hp.hn_layers)
        if hp.hn_head_init == "target":
            self.hypernet.start_at(dict(model.named_parameters()), hp.hn_head_scale)
        elif hp.hn_head_init != "default":
            raise ValueError(f"hn_head_init must be 'default' or 'target', got {hp.hn_head_init!r}")
        self.enc_fn = make_forward(self.encoder)  # (gamma, x [N, ...]) -> e [E]
        self.hn_fn = make_forward(self.hypernet)  # (theta, e [.., E]) -> w
        self.dp_rng = np.random.default_rng([seed, 7])
        if self.hp.embedding_noise < 0:
            raise ValueError(f"embedding_noise must be >= 0, got {self.hp.embedding_noise}")
        self.seed = seed
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None
        self._train: list[np.ndarray] | None = None
        # (encoder state, round, client ids, embeddings incl. noise) last computed by round_embeddings:
        # aggregate reuses client_start's instead of a second encoder pass (bit-identical, a pure cache)
        self._round_embeddings: tuple[State, float, np.ndarray, torch.Tensor] | None = None

    def client_data_need(self) -> str:
        """One-phase training needs no client data on the server: each round's messages carry the clients'
        embeddings and encoder gradients (the Flower app, ``fl_server.flower``)."""
        return self.needs_client_data if self.hp.two_phase or self.hp.standardize_init else ""

    # ------------------------------------------------------------------ state
    def attach(self, x: torch.Tensor, y: torch.Tensor, train: list[np.ndarray]) -> None:
        self._x, self._y, self._train = x, y, train

    def init_state(self, dtype: torch.dtype, device: torch.device) -> State:
        theta = get_params(self.hypernet, dtype, device)
        enc = get_params(self.encoder, dtype, device)
        emb: torch.Tensor | None = None  # the training clients' embeddings, when init needs them
        if self.hp.standardize_init:
            enc, emb = self.standardized_encoder(enc)
        state = {"params": self.generate(theta, torch.zeros(self.hp.embed_dim, dtype=dtype, device=device)),
                 "hn": theta, "hn_mom": tree_map(torch.zeros_like, theta), "enc": enc}
        if self.hp.two_phase:
            if self._train is None:
                raise RuntimeError("two-phase ODPFL-HN sizes its embedding table from the clients: call attach first")
            if self.hp.embedding_init == "encoder":
                emb = self.embed_clients(enc, np.arange(len(self._train))) if emb is None else emb
            elif self.hp.embedding_init == "normal":
                gen = torch.Generator().manual_seed(self.seed + 15_485_863)
                emb = self.hp.embedding_init_std * torch.randn(len(self._train), self.hp.embed_dim, generator=gen)
            else:
                raise ValueError(f"embedding_init must be 'normal' or 'encoder', got {self.hp.embedding_init!r}")
            state |= {"emb": emb.to(device, dtype), "emb_mom": torch.zeros_like(emb, device=device, dtype=dtype)}
        if self.hp.two_phase or self.hp.embedding_noise:  # a round counter only where a round's math needs it
            state["round"] = torch.zeros((), dtype=dtype, device=device)
        return state

    def standardized_encoder(self, enc: State) -> tuple[State, torch.Tensor]:
        """Data-dependent init of psi (the encoder's last, linear layer): rescale and shift it so that the
        training clients' embeddings have zero mean and unit std per dimension. At random init the embeddings
        of different clients differ by a few % of their norm, which the hypernetwork cannot tell apart.
        Returns the new gamma and the training clients' (standardized) embeddings."""
        if self._train is None:
            raise RuntimeError("standardize_init needs the clients' data: call attach first")
        emb = self.embed_clients(enc, np.arange(len(self._train)))
        mu, sd = emb.mean(0), emb.std(0).clamp_min(1e-8)
        std_enc = {**enc, "psi.weight": enc["psi.weight"] / sd[:, None], "psi.bias": (enc["psi.bias"] - mu) / sd}
        return std_enc, (emb - mu) / sd

    def _data(self) -> tuple[torch.Tensor, list[np.ndarray]]:
        if self._x is None or self._train is None:
            raise RuntimeError("ODPFL-HN needs the clients' data: call attach(x, y, train) first")
        return self._x, self._train

    def _client_x(self, i: int) -> torch.Tensor:
        x, train = self._data()
        return x[torch.from_numpy(np.asarray(train[i])).to(x.device)]

    def _client_chunks(self, ids: np.ndarray) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
        """The clients ``ids`` grouped into consecutive runs of at most ENCODE_CHUNK_SAMPLES[device type] samples
        (a bigger client alone): (slice of ids, their data concatenated [N, ...], segment [N] = position in the run)."""
        x, train = self._data()
        budget = ENCODE_CHUNK_SAMPLES.get(x.device.type, 0)
        sizes = np.array([len(train[int(i)]) for i in ids])
        chunks, start = [], 0
        while start < len(ids):
            stop = start + 1
            while stop < len(ids) and sizes[start:stop + 1].sum() <= budget:
                stop += 1
            rows = np.concatenate([np.asarray(train[int(i)]) for i in ids[start:stop]])
            segment = np.repeat(np.arange(stop - start), sizes[start:stop])
            chunks.append((slice(start, stop), x[torch.from_numpy(rows).to(x.device)],
                           torch.from_numpy(segment).to(x.device)))
            start = stop
        return chunks

    def encode_sets(self, enc: State, x: torch.Tensor, segment: torch.Tensor, sets: int) -> torch.Tensor:
        """g_gamma of ``sets`` clients' data at once: x [N, ...] with ``segment`` [N] -> [sets, E] (pure; one set
        takes the plain per-client pass, :meth:`encode`'s)."""
        if sets == 1:
            return self.enc_fn(enc, x).unsqueeze(0)
        return functional_call(self.encoder, enc, (x,), {"segment": segment, "sets": sets})

    # ------------------------------------------------------------- client side
    def encode(self, enc: State, x: torch.Tensor) -> torch.Tensor:
        """ClientEncoding: e = g_gamma(D), D = ``x`` [N, *input_shape] in one pass -> [E] (no grad).
        This vector is all a new client sends to the server."""
        with torch.no_grad():
            return self.enc_fn(enc, x)

    def pooled(self, enc: State, x: torch.Tensor) -> torch.Tensor:
        """The pooled vector before psi, [N, *input_shape] -> [width] (DP encoder: the mean of unit-sphere
        per-sample outputs, norm <= 1); e = psi(pooled)."""
        return functional_call(self.encoder, enc, (x,), {"pooled_only": True})

    def privatize(self, enc: State, x: torch.Tensor, rng: np.random.Generator | None = None) -> torch.Tensor:
        """The private embedding of a new client's set ``x`` (Sec. 7): Gaussian noise for sensitivity 2/|D|
        (B = 1, unit-sphere phi, mean pooling; |D| = len(x), the client's own) on the pooled vector, then psi
        (:func:`edge_sdk._dp.privatize_pooled`; post-processing, so the same (eps, delta) as noise on e with
        Lemma 2's 2 L B / |D|, and never noisier)."""
        if not self.hp.dp:
            raise ValueError("privatize needs the DP encoder (dp=True)")
        with torch.no_grad():
            pooled = self.pooled(enc, x)
        noisy = privatize_pooled(pooled.cpu().double().numpy(), enc["psi.weight"].detach().cpu().numpy(),
                                         enc["psi.bias"].detach().cpu().numpy(), self.hp.dp_epsilon, self.hp.dp_delta,
                                         len(x), rng if rng is not None else self.dp_rng)
        return torch.as_tensor(noisy, dtype=x.dtype, device=x.device)

    def local_step(self, client_state: State, server_state: State, x: torch.Tensor, y: torch.Tensor) -> State:
        """ClientUpdate, one SGD step (with ``local_momentum``) of CE on h(.; w) at ``local_lr`` (pure,
        vmappable)."""
        grads = grad(lambda p: F.cross_entropy(self.forward(p, x), y))(client_state["params"])
        if self.hp.clip_norm is not None:
            (grads,) = clip_by_global_norm((grads,), self.hp.clip_norm)
        return sgd_step(client_state, grads, self.hp.local_lr, self.hp.local_momentum, self.hp.weight_decay)

    @staticmethod
    def client_delta(client_states: State) -> State:
        """Delta w = w_new - w (stacked or single client)."""
        return tree_map(lambda new, old: new - old, client_states["params"], client_states["w0"])

    def encoder_backprop(self, enc: State, x: torch.Tensor, grad_e: torch.Tensor) -> State:
        """ClientBackprop: Delta gamma = (d g_gamma(x) / d gamma)^T grad_e; ``grad_e`` [E] -> grads like gamma."""
        with torch.enable_grad():
            _, vjp = torch.func.vjp(lambda g: self.enc_fn(g, x), enc)
            (grad,) = vjp(grad_e.to(next(iter(enc.values())).dtype))
        return grad

    def clients_encoder_backprop(self, enc: State, ids: np.ndarray, grad_e: torch.Tensor) -> State:
        """sum_k ClientBackprop of client ids[k] with ``grad_e`` [K, E], the clients' data in the passes
        :meth:`_client_chunks` groups (one per client on the CPU, concatenated on a GPU); the same sum."""
        dtype = next(iter(enc.values())).dtype
        total: State | None = None
        with torch.enable_grad():
            for part, x, segment in self._client_chunks(ids):
                sets = part.stop - part.start
                _, vjp = torch.func.vjp(lambda g: self.encode_sets(g, x, segment, sets), enc)
                (grad,) = vjp(grad_e[part].to(dtype))
                total = grad if total is None else tree_map(torch.add, total, grad)
        assert total is not None
        return total

    # ------------------------------------------------------------- server side
    def generate(self, hn: State, embedding: torch.Tensor) -> State:
        """w = f_theta(e): e [E] -> target params; e [K, E] -> stacked target params [K, ...]."""
        with torch.no_grad():
            return self.hn_fn(hn, embedding)

    def hypernet_backprop(self, hn: State, embeddings: torch.Tensor, delta_w: State,
                          coef: torch.Tensor | None = None) -> tuple[State, torch.Tensor]:
        """pFedHN chain rule: with w = f_theta(e) and the cotangent -Delta w (scaled per client by ``coef``),
        returns (grad_theta = sum_k coef_k (dw_k/dtheta)^T (-Delta w_k), grad_e [.., E] = (dw/de)^T (-Delta w)).
        ``embeddings`` [E] with an unstacked ``delta_w``, or [K, E] with stacked ones."""
        with torch.enable_grad():
            theta = {k: v.detach().requires_grad_(True) for k, v in hn.items()}
            e = embeddings.detach().requires_grad_(True)
            w = self.hn_fn(theta, e)
            names = list(w)
            cot = []
            for n in names:
                d = -delta_w[n].to(w[n].dtype)
                if coef is not None:
                    d = d * coef.to(d.dtype).reshape(-1, *([1] * (d.ndim - 1)))
                cot.append(d)
            grads = torch.autograd.grad([w[n] for n in names], [*theta.values(), e], grad_outputs=cot)
        return dict(zip(theta, grads[:-1])), grads[-1]

    def server_update(self, server_state: State, grad_theta: State, grad_gamma: State) -> State:
        """theta: SGD with momentum, weight decay and global-norm clip (pFedHN); gamma: SGD at encoder_lr."""
        hp = self.hp
        (g,) = clip_by_global_norm((grad_theta,), hp.hn_clip)
        g = tree_map(lambda gi, p: gi + hp.hn_weight_decay * p, g, server_state["hn"])
        mom = tree_map(lambda b, gi: hp.hn_momentum * b + gi, server_state["hn_mom"], g)
        theta = sgd(server_state["hn"], mom, hp.hn_lr)
        gamma = sgd(server_state["enc"], grad_gamma, hp.encoder_lr)
        e0 = torch.zeros(hp.embed_dim, dtype=next(iter(theta.values())).dtype,
                         device=next(iter(theta.values())).device)
        return {**server_state, "params": self.generate(theta, e0), "hn": theta, "hn_mom": mom, "enc": gamma}

    # ------------------------------------------------------ engine interface
    def embed_clients(self, enc: State, ids: np.ndarray) -> torch.Tensor:
        """[K, E]: each training client's embedding of all its training data (passes as _client_chunks groups
        the clients)."""
        with torch.no_grad():
            return torch.cat([self.encode_sets(enc, x, segment, part.stop - part.start)
                              for part, x, segment in self._client_chunks(ids)])

    def round_embeddings(self, server_state: State, ids: np.ndarray) -> torch.Tensor:
        """The embeddings this round's models are generated from: :meth:`embed_clients` plus the round's
        ``embedding_noise``. Reuses what this round's client_start computed for the same encoder state and
        clients (one encoder pass over every selected client's data per round saved)."""
        enc, round_ = server_state["enc"], float(server_state.get("round", 0))
        cached = self._round_embeddings
        if cached is not None and cached[0] is enc and cached[1] == round_ and np.array_equal(cached[2], ids):
            return cached[3]
        emb = self.with_noise(server_state, ids, self.embed_clients(enc, ids))
        self._round_embeddings = (enc, round_, ids.copy(), emb)
        return emb

    def with_noise(self, server_state: State, ids: np.ndarray, emb: torch.Tensor) -> torch.Tensor:
        """The clients' embeddings ``emb`` [K, E] plus the round's ``embedding_noise`` (training only)."""
        if self.hp.embedding_noise:
            emb = emb + self.hp.embedding_noise * self.noise_draw(server_state, ids).to(emb)
        return emb

    def noise_draw(self, server_state: State, ids: np.ndarray) -> torch.Tensor:
        """[K, E] standard normal, a function of (seed, round, client id) only, so that client_start and
        aggregate (and a resumed run) see the same noise."""
        round_ = int(server_state["round"])
        rows = []
        for i in ids:  # K rows of E numbers: negligible next to the encoder passes
            gen = torch.Generator().manual_seed((self.seed * 1_000_033 + round_) * 100_003 + int(i))
            rows.append(torch.randn(self.hp.embed_dim, generator=gen, dtype=torch.float64))
        return torch.stack(rows)

    def aggregate(self, server_state: State, ids: np.ndarray, client_states: State, weights: torch.Tensor) -> State:
        """Algorithm 1, lines 6-10, for the K selected clients at once (gradients weighted by ``weights``)."""
        if self.hp.two_phase:
            return self._aggregate_two_phase(server_state, ids, client_states, weights)
        coef = weights / weights.sum()
        delta = self.client_delta(client_states)
        enc = server_state["enc"]
        emb = self.round_embeddings(server_state, ids)
        grad_theta, grad_e = self.hypernet_backprop(server_state["hn"], emb, delta, coef)
        grad_gamma = self.clients_encoder_backprop(enc, ids, grad_e)  # summed; coef is already in grad_e
        return self.end_round(server_state, grad_theta, grad_gamma)

    def end_round(self, server_state: State, grad_theta: State, grad_gamma: State) -> State:
        """The round's server update from theta's and gamma's gradients (the round counter moves on where kept)."""
        if "round" in server_state:
            server_state = {**server_state, "round": server_state["round"] + 1}
        return self.server_update(server_state, grad_theta, grad_gamma)

    def client_start(self, server_state: State, ids: np.ndarray) -> State:
        if self.in_phase1(server_state):  # two-phase, Eq. 9: the learned embeddings generate the models
            w = self.generate(server_state["hn"], server_state["emb"][torch.as_tensor(ids)])
        else:
            self._round_embeddings = None
            w = self.generate(server_state["hn"], self.round_embeddings(server_state, ids))
        return self.start_states(w)

    def start_states(self, w: State) -> State:
        """The selected clients' start states from their generated models ``w`` (stacked): w and a copy w0 (the
        client's Delta w is against it), a zero momentum buffer with ``local_momentum``."""
        state = {"params": w, "w0": tree_map(torch.clone, w)}
        if self.hp.local_momentum:
            state["mom"] = tree_map(torch.zeros_like, w)
        return state

    # ------------------------------------------------------ two-phase (App. B.2)
    def in_phase1(self, server_state: State) -> bool:
        return self.hp.two_phase and float(server_state["round"]) < self.hp.phase1_rounds

    def fit_encoder(self, enc: State, x: torch.Tensor, target: torch.Tensor) -> State:
        """A client's side of Eq. 10: ``encoder_local_steps`` full-set GD steps on ||g_gamma(x) - e_i||^2 at
        ``encoder_lr``; returns the new gamma."""
        loss_grad = grad(lambda g: ((self.enc_fn(g, x) - target) ** 2).sum())
        with torch.enable_grad():
            for _ in range(self.hp.encoder_local_steps):
                enc = sgd(enc, loss_grad(enc), self.hp.encoder_lr)
        return enc

    def _aggregate_two_phase(self, server_state: State, ids: np.ndarray, client_states: State,
                             weights: torch.Tensor) -> State:
        hp = self.hp
        coef = weights / weights.sum()
        delta = self.client_delta(client_states)
        rows = torch.as_tensor(ids, device=weights.device)
        nxt = {**server_state, "round": server_state["round"] + 1}
        if not self.in_phase1(server_state):  # Eq. 11: theta only, on the frozen encoder's embeddings
            grad_theta, _ = self.hypernet_backprop(server_state["hn"], self.round_embeddings(server_state, ids),
                                                   delta, coef)
            return self.server_update(nxt, grad_theta, tree_map(torch.zeros_like, server_state["enc"]))
        emb = server_state["emb"]
        grad_theta, grad_e = self.hypernet_backprop(server_state["hn"], emb[rows], delta, coef)
        # each row gets its own client's gradient (pFedHN steps one client at a time), then pFedHN's SGD:
        # momentum, weight decay, clip; rows not selected keep moving with their momentum, as torch's SGD does
        grad_table = torch.zeros_like(emb).index_put((rows,), grad_e / coef.reshape(-1, 1))
        (grad_table,) = clip_by_global_norm((grad_table,), hp.hn_clip)
        grad_table = grad_table + hp.hn_weight_decay * emb
        mom = hp.hn_momentum * server_state["emb_mom"] + grad_table
        emb_lr = hp.hn_lr if hp.embedding_lr is None else hp.embedding_lr
        nxt |= {"emb": emb - emb_lr * mom, "emb_mom": mom}
        # Eq. 10 on each selected client against its current embedding; FedAvg of the encoders
        enc = server_state["enc"]
        fitted = [self.fit_encoder(enc, self._client_x(int(i)), emb[int(i)]) for i in ids]
        out = self.server_update(nxt, grad_theta, tree_map(torch.zeros_like, enc))
        return out | {"enc": {k: sum(c * f[k] for c, f in zip(coef, fitted)) for k in enc}}

    def val_params(self, server_state: State, ids: np.ndarray, trainer: LocalTrainer) -> State:
        """Stacked generated params [K, ...] for the training clients (embedding of their training data)."""
        return self.generate(server_state["hn"], self.embed_clients(server_state["enc"], ids))

    def personalize(self, server_state: State, x: torch.Tensor) -> State:
        """New client: e = g_gamma(x) (+ DP noise if dp_epsilon is finite) -> w = f_theta(e)."""
        if math.isfinite(self.hp.dp_epsilon):
            return self.generate(server_state["hn"], self.privatize(server_state["enc"], x))
        return self.generate(server_state["hn"], self.encode(server_state["enc"], x))
