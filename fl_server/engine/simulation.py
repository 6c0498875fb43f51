"""In-process federated simulation: rounds of client sampling, local training (vmap or reference loop),
aggregation and evaluation, with JSONL metrics, checkpoint/resume and a progress bar.

Reproducibility: the caller seeds the model's initial weights (``build_model(..., seed=)``); every random choice of round r
(client sampling, mini-batches) comes from ``numpy.random.default_rng([seed, r, purpose])``, so a resumed
run repeats exactly what an uninterrupted run would have done.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from edge_sdk.safeguard import SafeguardRule, evidence, mix, shifted
from fl_server.algorithms.base import Algorithm, LocalTrainer, NotApplicable, StepFn, declared_safeguard
from fl_server.atomic import atomic_link, atomic_write_json, atomic_write_text
from fl_server.data.federated import FederatedData
from fl_server.diagnostics import NONFINITE_FIX, describe_nonfinite, nonfinite_weights
from fl_server.torch_device import pick_device
from fl_server.engine.bf16_conv import Bf16Conv
from fl_server.engine.gemm_conv import GemmConv
from fl_server.engine.graphs import GraphedLocalSteps, vmapped_round
from fl_server.functional import State, make_forward, stack, tree_map, unstack
from fl_server.models.norm import (StatBatchNorm2d, client_sums, federated_statistics, norm_mode, stat_norms,
                                   statistics_arrays)
# the run directory's files belong to fl_server.rundir; checkpoint_meta, complete_rows and load_state are
# imported from here by research scripts
from fl_server.rundir import (BEST, BEST_AT_CHECKPOINT, CHECKPOINT, CHECKPOINT_JSON, METRICS,  # noqa: F401
                              checkpoint_meta, complete_rows, load_state, save_state, write_device, write_run)

RNG_SAMPLE, RNG_BATCHES, RNG_EVAL = 0, 1, 2  # rng purposes


# RunConfig.batched_conv -> the context a vmapped round's local steps run in
CONV_PATHS: dict[str, Callable[[], Any]] = {"native": contextlib.nullcontext, "gemm": GemmConv, "bf16": Bf16Conv}


@dataclass
class RunConfig:
    rounds: int = 200
    local_iterations: int = 20  # tau
    batch_size: int = 64  # B
    client_fraction: float = 1.0  # UPFL: all training clients every round
    eval_every: int = 1
    seed: int = 0
    # "vmap" (clients stepped together), "loop" (per-client reference) or "auto": vmap on CUDA, and on the
    # CPU for models without convolutions (vmapped conv backward is a grouped convolution, which is far
    # slower than the loop on CPU; measured in docs/benchmarks/vmap-engine.json)
    mode: str = "auto"
    dtype: str = "float32"
    device: str = "auto"
    chunk_size: int | None = None  # vmap chunking over clients, bounds memory
    eval_chunk: int = 4096  # samples per forward at evaluation
    checkpoint_every: int = 10
    # True: personalise the new clients only once, on the model of the best validation round (the number
    # UPFL reports) instead of at every evaluation; saves the per-round test-time adaptation cost.
    test_at_best_only: bool = False
    out_dir: str | None = None
    progress: bool = True
    # train at most up to this round count in this call, then checkpoint and return as if interrupted (a time-
    # limited lease); the next call with the same config resumes. None: to ``rounds``.
    stop_after: int | None = None
    # where a round's mini-batches come from: "shared", one generator walked client after client (the committed
    # tables), or "per_client", one generator per client (``client_rng``), which a client that trains on its own
    # machine (the Flower app, ``fl_server.flower``) reproduces without knowing the other clients' data sizes
    batch_stream: str = "shared"
    # replay a round's vmapped local steps as one CUDA graph (fl_server/engine/graphs.py) where the run is vmapped
    # on a GPU and the method's step allows it (``Algorithm.graph_safe``); the same kernels on the same inputs,
    # so it is not part of the run's identity. False: launch every kernel from Python (the reference).
    cuda_graphs: bool = True
    # how a vmapped round computes its clients' convolutions: "native" (vmap's grouped convolution) or "gemm"
    # (gathered patches plus one batched matrix product, fl_server/engine/gemm_conv.py); equal up to rounding, so
    # not part of the run's identity either. "bf16" (fl_server/engine/bf16_conv.py) computes them in bfloat16:
    # other arithmetic, so it is part of the identity. The default comes from $FL_BATCHED_CONV (else "native"):
    # how the harness's commands (`fl-server bench`, `train`) are switched to the faster path on a given GPU.
    batched_conv: str = field(default_factory=lambda: os.environ.get("FL_BATCHED_CONV", "native"))
    # evaluate new (and validation) clients as a device does: after personalisation, the method's declared
    # safeguard rule (``Algorithm.safeguard``) may keep the received model. False: the method as its paper
    # defines it (the lab's reproductions). Evaluation only, so not part of the run's identity.
    safeguard: bool = True

    def identity(self) -> dict[str, Any]:
        """The fields that change results (a resumed run must match them). ``batch_stream`` only when it is not
        the default, so the fingerprints of runs made before it existed stay the same."""
        keep = ("rounds", "local_iterations", "batch_size", "client_fraction", "eval_every", "seed", "dtype")
        out = {k: getattr(self, k) for k in keep}
        if self.batch_stream != "shared":
            out["batch_stream"] = self.batch_stream
        if self.batched_conv == "bf16":  # changes the arithmetic, not only its rounding
            out["batched_conv"] = self.batched_conv
        return out


@dataclass
class RunResult:
    best_round: int = -1
    best_val: float = float("-inf")
    test_at_best: float | None = None
    last: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    rounds_done: int = 0
    # the validation round at which the server state was found non-finite (NaN or inf): training stopped there,
    # since no later round can recover it; None while the weights are finite
    diverged_round: int | None = None


def client_batches(client_indices: list[np.ndarray], iterations: int, batch_size: int,
                   rng: np.random.Generator) -> np.ndarray:
    """[K, T, B] dataset indices: each client walks through successive random permutations of its own
    data (epochs), so a client with n < B samples repeats samples inside a batch."""
    out = np.empty((len(client_indices), iterations, batch_size), dtype=np.int64)
    need = iterations * batch_size
    for k, idx in enumerate(client_indices):  # K small numpy draws; the hot path is the torch step
        reps = -(-need // len(idx))
        order = np.concatenate([rng.permutation(len(idx)) for _ in range(reps)])[:need]
        out[k] = idx[order].reshape(iterations, batch_size)
    return out


def select_clients(num_clients: int, fraction: float, seed: int, round_: int) -> np.ndarray:
    """The sorted ids of round ``round_``'s clients: all of them, or ``fraction`` of them drawn without
    replacement from the round's sampling generator."""
    m = max(1, int(round(fraction * num_clients)))
    if m == num_clients:
        return np.arange(num_clients)
    return np.sort(np.random.default_rng([seed, round_, RNG_SAMPLE]).choice(num_clients, size=m, replace=False))


def client_rng(seed: int, round_: int, client: int) -> np.random.Generator:
    """Client ``client``'s own batch generator in round ``round_`` (``RunConfig.batch_stream="per_client"``)."""
    return np.random.default_rng([seed, round_, RNG_BATCHES, client])


def per_client_batches(client_indices: list[np.ndarray], ids: np.ndarray, iterations: int, batch_size: int,
                       seed: int, round_: int) -> np.ndarray:
    """[K, T, B] like :func:`client_batches`, each client ``ids[k]`` drawing from its own :func:`client_rng`."""
    return np.concatenate([client_batches([idx], iterations, batch_size, client_rng(seed, round_, int(k)))
                           for idx, k in zip(client_indices, ids)]) if len(ids) else \
        np.empty((0, iterations, batch_size), dtype=np.int64)


def run_local_steps(step_fn: StepFn, states: State, server_state: State, x: torch.Tensor, y: torch.Tensor,
                    batches: torch.Tensor, mode: str, chunk_size: int | None = None,
                    step_at: Callable[[int], StepFn] | None = None,
                    graphed: GraphedLocalSteps | None = None, batched_conv: str = "native",
                    seed_axis: bool = False) -> State:
    """Apply the local step for every client (leading axis of ``states``) over its batches [K, T, B]:
    ``step_fn``, or ``step_at(t)`` at iteration t when given (``Algorithm.local_step_at``). ``graphed``: in vmap
    mode, replay the round as a CUDA graph (:class:`~fl_server.engine.graphs.GraphedLocalSteps`); ``batched_conv``:
    "gemm" computes the vmapped convolutions as gathered patches plus a batched matrix product
    (:class:`~fl_server.engine.gemm_conv.GemmConv`), "bf16" in bfloat16
    (:class:`~fl_server.engine.bf16_conv.Bf16Conv`); ``seed_axis``: several runs at once, vmap mode only
    (:func:`~fl_server.engine.graphs.vmapped_round`)."""
    at = step_at or (lambda t: step_fn)
    if mode == "vmap":
        if batched_conv not in CONV_PATHS:
            raise ValueError(f"unknown batched_conv {batched_conv!r}; use {', '.join(map(repr, CONV_PATHS))}")
        steps = tuple(at(t) for t in range(batches.shape[-2]))
        with CONV_PATHS[batched_conv]():
            if graphed is not None:
                return graphed(steps, states, server_state, x, y, batches, chunk_size, seed_axis)
            return vmapped_round(steps, states, server_state, x, y, batches, chunk_size, seed_axis)
    if seed_axis:
        raise ValueError("runs stepped together need mode 'vmap'")
    if mode == "loop":
        out = []
        for k, state in enumerate(unstack(states)):
            for t in range(batches.shape[1]):
                idx = batches[k, t]
                state = at(t)(state, server_state, x[idx], y[idx])
            out.append(state)
        return stack(out)
    raise ValueError(f"unknown mode {mode!r}; use 'vmap' or 'loop'")


def resolve_mode(mode: str, device: torch.device, model: torch.nn.Module) -> str:
    if mode not in ("auto", "vmap", "loop"):
        raise ValueError(f"unknown mode {mode!r}; use 'auto', 'vmap' or 'loop'")
    if mode != "auto":
        return mode
    has_conv = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    return "vmap" if device.type == "cuda" or not has_conv else "loop"


def graphable(model: torch.nn.Module) -> bool:
    """Whether a model's forward is a function of its parameters and input alone: StatBatchNorm2d reads a Python
    ``mode`` (batch, population, collect) that a recorded graph would freeze."""
    return not any(isinstance(m, StatBatchNorm2d) for m in model.modules())


def safeguarded_logits(algorithm: Algorithm, rule: SafeguardRule, state: State, params: State, x: torch.Tensor,
                       received: torch.Tensor, adapted: torch.Tensor) -> torch.Tensor:
    """A client's logits on its unlabeled ``x`` after the device's safeguard (edge_sdk.safeguard, as
    ``Device.personalize`` decides): ``received`` (the logits of ``state``'s model) and ``adapted`` (of the
    personalised ``params``) compared; the adapted logits, the received model's, or the mix of both ("partial")."""
    shifted_pair: tuple[np.ndarray, np.ndarray] | tuple[None, None] = (None, None)
    if rule.needs_shift and (xs := shifted(x.cpu().numpy())) is not None:
        xt = torch.from_numpy(xs).to(x.device, x.dtype)
        with torch.no_grad():
            shifted_pair = (algorithm.predict(state["params"], xt).cpu().double().numpy(),
                            algorithm.predict(params, xt).cpu().double().numpy())
    r, a = received.cpu().double().numpy(), adapted.cpu().double().numpy()
    action = rule.action(evidence(r, a, *shifted_pair))
    if action == "received":
        return received
    return adapted if action == "personalised" else torch.from_numpy(mix(r, a)).to(adapted.device)


def fingerprint_hp(hp: Any) -> dict[str, Any]:
    """The hyperparameters that identify a run. A field added later with ``metadata={"fingerprint":
    "omit_default"}`` is left out while it has its default (which reproduces the older behaviour), so runs
    and checkpoints made before it existed still resume."""
    return {f.name: getattr(hp, f.name) for f in dataclasses.fields(hp)
            if not (f.metadata.get("fingerprint") == "omit_default" and getattr(hp, f.name) == f.default)}


class Simulation:
    """One federated run of ``algorithm`` on ``fed`` under ``cfg``."""

    def __init__(self, algorithm: Algorithm, fed: FederatedData, cfg: RunConfig,
                 description: dict[str, Any] | None = None) -> None:
        """``description``: written to ``out_dir/run.json`` once the run directory is known to hold this run
        (a refused resume leaves the directory's own run.json, which ``fl-server export`` reads, untouched)."""
        self.algorithm, self.fed, self.cfg = algorithm, fed, cfg
        self.description = description
        self.device = pick_device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype)
        self.x = torch.from_numpy(fed.dataset.x).to(self.device, self.dtype)
        self.y = torch.from_numpy(fed.dataset.y).to(self.device)
        self.train_sizes = torch.tensor([len(t) for t in fed.train], dtype=self.dtype, device=self.device)
        algorithm.model.to(self.device)
        algorithm.attach(self.x, self.y, fed.train)
        self.server_state = algorithm.init_state(self.dtype, self.device)
        self.mode = resolve_mode(cfg.mode, self.device, algorithm.model)
        self.graphed = GraphedLocalSteps() if (cfg.cuda_graphs and self.mode == "vmap" and self.device.type == "cuda"
                                               and algorithm.graph_safe and graphable(algorithm.model)) else None
        self.out_dir = Path(cfg.out_dir) if cfg.out_dir else None
        self.fingerprint = self._fingerprint()
        self.best_state: State | None = None

    # ------------------------------------------------------------------ pieces
    def _rng(self, round_: int, purpose: int) -> np.random.Generator:
        return np.random.default_rng([self.cfg.seed, round_, purpose])

    def _fingerprint(self, rounds: int | None = None) -> str:
        """Hash of what identifies the run; ``rounds`` replaces the configured total (0: left out)."""
        run = self.cfg.identity()
        if rounds == 0:
            del run["rounds"]
        elif rounds is not None:
            run["rounds"] = rounds
        ident = {"method": self.algorithm.name, "hp": fingerprint_hp(self.algorithm.hp),
                 "data": self.fed.info, "dataset": self.fed.dataset.name, "run": run}
        return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _same_run_other_length(self, meta: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
        """Whether a checkpoint comes from this run configured for another total of rounds: its first
        ``rounds_done`` rounds are this run's, so a run can be cut short or extended from it. Only where it
        stops and the validation of its last round depend on the total: a run cut short at the checkpoint
        validates that round on resume (``run``); a finished shorter run whose last round was validated off the
        ``eval_every`` cadence (``rows``: its metrics) cannot be extended, that validation would be an extra
        candidate for the best round. Checkpoints written before ``prefix_fingerprint`` existed are matched by
        trying the totals they could have had."""
        done = int(meta.get("rounds_done", 0))
        if done > self.cfg.rounds:
            return False
        off_cadence_last = done % self.cfg.eval_every != 0 and any(
            r["round"] == done - 1 and r.get("val") is not None for r in rows)
        if off_cadence_last and self.cfg.rounds > done:
            return False
        if "prefix_fingerprint" in meta:
            return meta["prefix_fingerprint"] == self._fingerprint(rounds=0)
        return any(meta.get("fingerprint") == self._fingerprint(rounds=r) for r in range(max(done, 1), 10_001))

    def select_clients(self, round_: int) -> np.ndarray:
        return select_clients(self.fed.num_train_clients, self.cfg.client_fraction, self.cfg.seed, round_)

    def local_train(self, step_fn: StepFn, states: State, server_state: State, ids: np.ndarray,
                    iterations: int, rng: np.random.Generator,
                    step_at: Callable[[int], StepFn] | None = None) -> State:
        batches = client_batches([self.fed.train[i] for i in ids], iterations, self.cfg.batch_size, rng)
        return run_local_steps(step_fn, states, server_state, self.x, self.y,
                               torch.from_numpy(batches).to(self.device), self.mode, self.cfg.chunk_size, step_at,
                               self.graphed, self.cfg.batched_conv)

    def trainer(self, rng: np.random.Generator) -> LocalTrainer:
        """:meth:`local_train` with the batch draws of ``rng``: what an algorithm that trains at evaluation time
        (``val_params``) is given."""
        return lambda step, states, server, sel, iters, step_at=None: self.local_train(step, states, server, sel,
                                                                                       iters, rng, step_at)

    def round_inputs(self, round_: int) -> tuple[np.ndarray, State, torch.Tensor]:
        """Round ``round_``'s selected client ids, their starting states and their mini-batches [K, T, B] (indices
        into the data set): everything a round's local steps read besides the server state."""
        ids = self.select_clients(round_)
        states = self.algorithm.client_start(self.server_state, ids)
        if self.cfg.batch_stream == "per_client":
            batches = per_client_batches([self.fed.train[i] for i in ids], ids, self.cfg.local_iterations,
                                         self.cfg.batch_size, self.cfg.seed, round_)
        elif self.cfg.batch_stream == "shared":
            batches = client_batches([self.fed.train[i] for i in ids], self.cfg.local_iterations,
                                     self.cfg.batch_size, self._rng(round_, RNG_BATCHES))
        else:
            raise ValueError(f"unknown batch_stream {self.cfg.batch_stream!r}; use 'shared' or 'per_client'")
        return ids, states, torch.from_numpy(batches).to(self.device)

    def run_round(self, round_: int) -> tuple[np.ndarray, State]:
        """One round; returns the selected client ids and their local states before aggregation (for methods
        that also communicate something else, e.g. HeteroFedTTA's logits on the public set)."""
        ids, states, batches = self.round_inputs(round_)
        states = run_local_steps(self.algorithm.local_step, states, self.server_state, self.x, self.y, batches,
                                 self.mode, self.cfg.chunk_size, self.algorithm.local_step_at, self.graphed,
                                 self.cfg.batched_conv)
        self.aggregate(ids, states)
        return ids, states

    def aggregate(self, ids: np.ndarray, states: State) -> None:
        """The server's step: the selected clients' local states ``states`` (stacked) into the server state."""
        self.server_state = self.algorithm.aggregate(self.server_state, ids, states, self.train_sizes[ids])

    # -------------------------------------------------------------- evaluation
    def _logits(self, params: State, idx: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            parts = [self.algorithm.predict(params, self.x[torch.from_numpy(idx[s:s + self.cfg.eval_chunk])])
                     for s in range(0, len(idx), self.cfg.eval_chunk)]
        return torch.cat(parts)

    def accuracy(self, params: State, idx: np.ndarray) -> float:
        """Accuracy of the model ``params`` on the samples ``idx`` (index array into the data set)."""
        pred = self._logits(params, idx).argmax(-1)
        return float((pred == self.y[torch.from_numpy(idx)]).double().mean())

    def _is_stacked(self, params: State) -> bool:
        name, p = next(iter(self.algorithm.model.named_parameters()))
        return params[name].ndim == p.ndim + 1

    @contextlib.contextmanager
    def device_semantics(self, state: State) -> Iterator[None]:
        """Run a block as the device runs the bundle of ``state``. A batch-normalised model gets the federated
        population statistics of ``state``'s weights over the training clients (what the finalize step writes
        and export ships) and predicts with them at every batch size; the method's adaptation steps normalise
        by its rule (``Algorithm.adapt_norm``, applied in :meth:`personalized_accuracies`). No-op otherwise."""
        model = self.algorithm.model
        if not stat_norms(model):
            yield
            return
        forward = make_forward(model)
        federated_statistics(model, [client_sums(model, lambda xb: forward(state["params"], xb),
                                                 self.x[torch.from_numpy(t).to(self.device)]) for t in self.fed.train])
        with norm_mode(model, "population"):
            yield

    @property
    def device_safeguard(self) -> SafeguardRule | None:
        """The safeguard rule new clients are scored with: the method's declared one (what its bundle's devices
        apply), None when the run scores the method without it (``RunConfig.safeguard``) or it declares none."""
        return declared_safeguard(self.algorithm) if self.cfg.safeguard else None

    def personalized_predictions(self, clients: list[np.ndarray], state: State | None = None,
                                 safeguard: bool = True) -> list[torch.Tensor]:
        """Per client (index array into the data set): the predicted classes after ``personalize`` of ``state``
        (default: the current server state) on the client's own unlabeled data, with the device's semantics
        (:meth:`device_semantics`): what a device gets from the bundle of ``state``. ``safeguard=False``: without
        the rule, what ``edge_sdk.open_bundle(..., safeguard=False)`` gets."""
        state = self.server_state if state is None else state
        rule = self.device_safeguard if safeguard else None
        out = []
        with self.device_semantics(state):
            for idx in clients:
                if rule is not None and rule.keeps_received:  # the device adapts nothing (Device.personalize)
                    out.append(self._logits(state["params"], idx).argmax(-1))
                    continue
                with norm_mode(self.algorithm.model, self.algorithm.adapt_norm):
                    params = self.algorithm.personalize(state, self.x[torch.from_numpy(idx)])
                adapted = self._logits(params, idx)
                if rule is not None:  # the device's safeguard decision on the client's unlabeled data
                    adapted = safeguarded_logits(self.algorithm, rule, state, params, self.x[torch.from_numpy(idx)],
                                                 self._logits(state["params"], idx), adapted)
                out.append(adapted.argmax(-1))
        return out

    def personalized_accuracies(self, clients: list[np.ndarray], state: State | None = None,
                                safeguard: bool = True) -> list[float]:
        """Per client: the accuracy of :meth:`personalized_predictions`."""
        return [float((pred == self.y[torch.from_numpy(idx)]).double().mean())
                for pred, idx in zip(self.personalized_predictions(clients, state, safeguard), clients)]

    def finalize(self, state: State, round_: int) -> dict[str, dict[str, np.ndarray]]:
        """What a bundle of ``state`` needs from the clients' data: the population statistics of a batch-normalised
        model (``stats``) and the method's finalize weights (``Algorithm.finalize``); written to the run directory
        (``device.npz``, :func:`fl_server.rundir.write_device`) for export."""
        model = self.algorithm.model
        with self.device_semantics(state):
            weights = {"stats": statistics_arrays(model)} if stat_norms(model) else {}
            weights.update(self.algorithm.finalize(state, self.x, self.fed.train))
        if self.out_dir is not None:
            write_device(self.out_dir, weights, round_)
        return weights

    def _personalized_accuracy(self, clients: list[np.ndarray]) -> float:
        """Mean over clients of the accuracy after ``personalize`` on the client's own unlabeled data."""
        return float(np.mean(self.personalized_accuracies(clients)))

    def evaluate_val(self, round_: int) -> float:
        """Mean over training clients of the accuracy on their validation split; with validation clients
        (``fed.val_clients``), the mean over them of the personalised accuracy, as for new clients. The shared
        model (and every personalisation) is scored as its bundle's device runs it (:meth:`device_semantics`:
        a batch-normalised model with its population statistics, at any batch size); per-client models (a head
        or model fine-tuned on each client's training data) normalise by their own batches."""
        if self.fed.val_clients:
            return self._personalized_accuracy(self.fed.val_clients)
        if self.algorithm.adapts_at_test_time:
            return self._personalized_accuracy(self.fed.val)
        ids = np.arange(self.fed.num_train_clients)
        rng = self._rng(round_, RNG_EVAL)
        params = self.algorithm.val_params(self.server_state, ids, self.trainer(rng))
        if self._is_stacked(params):
            accs = [self.accuracy(p, self.fed.val[k]) for k, p in enumerate(unstack(params))]
            return float(np.mean(accs))
        # one shared model, as the device runs it: a single batched forward over all validation samples
        idx = np.concatenate(self.fed.val)
        owner = np.repeat(np.arange(len(self.fed.val)), [len(v) for v in self.fed.val])
        with self.device_semantics({**self.server_state, "params": params}):
            correct = (self._logits(params, idx).argmax(-1) == self.y[torch.from_numpy(idx)]).cpu().numpy()
        return float(np.mean(np.bincount(owner, weights=correct) / np.bincount(owner)))

    def evaluate_new(self) -> float | None:
        """Mean over new clients of the accuracy of the personalised model on the client's own data."""
        if not self.fed.new:
            return None
        try:
            return self._personalized_accuracy(self.fed.new)
        except NotApplicable:
            return None

    # -------------------------------------------------------------- persistence
    def _checkpoint(self, round_: int, result: RunResult) -> None:
        if self.out_dir is None:
            return
        meta = {"fingerprint": self.fingerprint, "prefix_fingerprint": self._fingerprint(rounds=0),
                "rounds_done": round_ + 1, "best_round": result.best_round,
                "best_val": result.best_val, "test_at_best": result.test_at_best, "wall_s": result.wall_s,
                **({"diverged_round": result.diverged_round} if result.diverged_round is not None else {})}
        # best.npz moves on at every improvement; best.ckpt.npz is the best state as of this checkpoint (a hard
        # link, no copy), what a run cut short at this checkpoint reports
        if (self.out_dir / BEST).exists():
            atomic_link(self.out_dir / BEST, self.out_dir / BEST_AT_CHECKPOINT)
        # the state and the round it belongs to land in one rename (the .npz): a kill between this and the
        # json below cannot make a resumed run apply a round twice; checkpoint.json is a readable mirror
        save_state(self.out_dir / CHECKPOINT, self.server_state, meta)
        atomic_write_json(self.out_dir / CHECKPOINT_JSON, meta)

    def _resume(self, result: RunResult) -> int:
        if self.out_dir is None:
            return 0
        ckpt, legacy = self.out_dir / CHECKPOINT, self.out_dir / CHECKPOINT_JSON
        meta = checkpoint_meta(ckpt) if ckpt.exists() else None
        if meta is None and ckpt.exists() and legacy.exists():  # a checkpoint written before the meta moved in
            meta = json.loads(legacy.read_text())
        if meta is None:
            (self.out_dir / METRICS).unlink(missing_ok=True)  # rows of an aborted, uncheckpointed run
            return 0
        metrics = self.out_dir / METRICS
        # rows past the checkpoint are dropped (they will be recomputed identically)
        rows = [r for r in complete_rows(metrics.read_text()) if r["round"] < meta["rounds_done"]] \
            if metrics.exists() else []
        same_length = meta.get("fingerprint") == self.fingerprint
        if not same_length and not self._same_run_other_length(meta, rows):
            raise ValueError(f"{self.out_dir} holds a checkpoint of a different run (config changed); "
                             "use another --out directory or delete it")
        self.server_state = load_state(ckpt, self.device)
        self.best_state = self._best_state_of(meta, ckpt, same_length)
        result.best_round, result.best_val = meta["best_round"], meta["best_val"]
        result.test_at_best, result.wall_s = meta["test_at_best"], meta["wall_s"]
        result.diverged_round = meta.get("diverged_round")
        if metrics.exists():
            atomic_write_text(metrics, "".join(json.dumps(r) + "\n" for r in rows))
            result.history = rows
        return int(meta["rounds_done"])

    def _best_state_of(self, meta: dict[str, Any], ckpt: Path, same_length: bool) -> State | None:
        """The best-validation state that goes with checkpoint ``meta``: best.npz moves on after the checkpoint
        at every improvement (a replay of the same rounds finds those again), best.ckpt.npz is the one as of
        the checkpoint. Files record their round; older ones without it are trusted when they are no newer
        than the checkpoint, or when the run resumes at its own length (its replay rewrites best.npz)."""
        assert self.out_dir is not None
        for path in (self.out_dir / BEST_AT_CHECKPOINT, self.out_dir / BEST):
            if not path.exists():
                continue
            recorded = checkpoint_meta(path)
            if recorded is not None and recorded.get("round") == meta["best_round"]:
                return load_state(path, self.device)
            if recorded is None and (same_length or path.stat().st_mtime <= ckpt.stat().st_mtime):
                return load_state(path, self.device)
        if same_length or meta["best_round"] < 0:
            return None  # a same-length replay finds the improvement that moved best.npz on again
        raise ValueError(f"{self.out_dir}: no best-state file holds round {meta['best_round']}, the checkpoint's "
                         "best; this run can only resume at its own length")

    # --------------------------------------------------------------------- run
    def _validate(self, r: int, row: dict[str, Any], result: RunResult) -> None:
        """Validate the current server state (round ``r``'s) into ``row``; an improvement becomes the best state
        (best.npz records its round)."""
        row["val"] = self.evaluate_val(r)
        row["test"] = None if self.cfg.test_at_best_only else self.evaluate_new()
        if row["val"] > result.best_val:
            result.best_round, result.best_val, result.test_at_best = r, row["val"], row["test"]
            self.best_state = tree_map(torch.clone, self.server_state)
            if self.out_dir is not None:
                save_state(self.out_dir / BEST, self.server_state, {"round": r, "val": row["val"]})

    def run(self) -> RunResult:
        """Train from the run directory's checkpoint (or round 0) to ``cfg.rounds`` (or ``cfg.stop_after``),
        validating, checkpointing and writing metrics as configured; then finalize the best state."""
        result, start_round, end = self.begin()
        bar = tqdm(range(start_round, end), initial=start_round, total=self.cfg.rounds,
                   desc=f"{self.algorithm.name} {self.fed.dataset.name}", disable=not self.cfg.progress,
                   dynamic_ncols=True)
        for r in bar:
            t0 = time.perf_counter()
            self.run_round(r)
            row = self.close_round(r, result, time.perf_counter() - t0, end)
            if row.get("val") is not None:
                bar.set_postfix(val=f"{row['val']:.4f}", test="-" if row["test"] is None else f"{row['test']:.4f}")
            if result.diverged_round is not None:
                end = r + 1
                break
        bar.close()
        return self.finish(result, start_round, end)

    def begin(self) -> tuple[RunResult, int, int]:
        """Open the run: resume from the run directory's checkpoint, write ``run.json``. Returns the result so
        far, the first round to train and the round to stop before (what :meth:`run` loops over; a driver that
        steps several runs together, :func:`fl_server.engine.stacked.run_stacked`, calls it per run)."""
        result = RunResult()
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        start_round = self._resume(result)
        if self.out_dir is not None and self.description is not None:
            write_run(self.out_dir, self.description)
        if result.history:
            result.last = result.history[-1]
        if (0 < start_round == self.cfg.rounds and result.last.get("round") == start_round - 1
                and result.last.get("val") is None):
            # a longer run's checkpoint cut short at a round off its validation cadence: a run of this length
            # validates its last round, so do it now (the checkpoint holds that round's state)
            t0 = time.perf_counter()
            self._validate(start_round - 1, result.last, result)
            result.wall_s += time.perf_counter() - t0
            if self.out_dir is not None:
                atomic_write_text(self.out_dir / METRICS, "".join(json.dumps(r) + "\n" for r in result.history))
                self._checkpoint(start_round - 1, result)
        end = self.cfg.rounds if self.cfg.stop_after is None else min(self.cfg.rounds, self.cfg.stop_after)
        if result.diverged_round is not None:  # a diverged run resumed: nothing left to train
            end = start_round
        return result, start_round, end

    def close_round(self, r: int, result: RunResult, train_s: float, end: int) -> dict[str, Any]:
        """After round ``r``'s training (``train_s`` seconds of it): validate on the cadence, record the metrics
        row, checkpoint on the cadence. Returns the row. A validated state with a NaN or an infinity ends the run:
        ``result.diverged_round`` is set, the row says what is not finite, a RuntimeWarning says so and the round is
        checkpointed (a resume trains no further)."""
        t0 = time.perf_counter()
        row: dict[str, Any] = {"round": r}
        last = r == self.cfg.rounds - 1
        if (r + 1) % self.cfg.eval_every == 0 or last:
            self._validate(r, row, result)
            if bad := nonfinite_weights(self.server_state):
                result.diverged_round = r
                row["diverged"] = describe_nonfinite(bad)
                warnings.warn(f"{self.algorithm.name} seed {self.cfg.seed}: the weights are not finite at round {r} "
                              f"({row['diverged']}): training stops here, no later round can recover them; "
                              f"{NONFINITE_FIX}", RuntimeWarning, stacklevel=2)
        result.wall_s += train_s + time.perf_counter() - t0
        row["wall_s"] = round(result.wall_s, 3)
        result.history.append(row)
        result.last = row
        if self.out_dir is not None:
            with open(self.out_dir / METRICS, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            if (r + 1) % self.cfg.checkpoint_every == 0 or last or r == end - 1 or result.diverged_round is not None:
                self._checkpoint(r, result)
        return row

    def finish(self, result: RunResult, start_round: int, end: int) -> RunResult:
        """Close the run: the new clients tested on the best state (``test_at_best_only``), the best state
        finalized for export."""
        if self.cfg.test_at_best_only and self.best_state is not None:
            t0 = time.perf_counter()
            current, self.server_state = self.server_state, self.best_state
            result.test_at_best = self.evaluate_new()
            self.server_state = current
            result.wall_s += time.perf_counter() - t0
        result.rounds_done = max(end, start_round)
        if result.best_round >= 0:
            self.finalize(self.best_state if self.best_state is not None else self.server_state, result.best_round)
        return result
