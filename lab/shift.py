"""The ``fedicon-shift`` protocol: training clients with Dir(alpha) labels, each with a local test set under
test-time shift (FedICON Sec. 5.1, with corrupted MNIST / Fashion-MNIST and the 8x8 digits standing in for
Digit-5).

Data: the clients partition the *train* split (85/15 train/val per client); each client's local test set
is drawn from the official *test* split with the client's own label proportions (the same label
distribution as its training data, a different feature distribution once shifted). Conditions:
- ``split="test"``: ``clean``; every corruption in ``test_corruptions`` at every severity (covariate
  shift), plus ``covariate-s<k>`` (mean over the corruptions at severity k); ``digits`` (domain shift: the
  scikit-learn 8x8 digits upsampled to 28x28, assigned to clients the same way; MNIST only);
- ``split="val"``: the clients' validation data, clean and under ``val_corruptions`` (types not used for
  testing) -- the numbers hyperparameters are chosen on.
Test-time hyperparameters (``options["tune"]``: TENT's and FedICON's TTA rates) are chosen per seed on the
mean over the validation conditions, then the test conditions are evaluated once.
Methods share trainings: FedAvg, FedAvg-FT and TENT evaluate one FedAvg run; FedICON, FedICON online and
FedICON w/o TTA one FedICON run (the run folder of the training method is reused; without it the same seed
retrains the same model). Every number is the final-round model.
FedICON adapts on a client's whole unlabeled set, then predicts it (batch mode); FedICON online sees the set
as a stream in the client's order, ``online_chunk`` samples at a time, each chunk predicted right after the
step on it, with a memory of ``memory_size`` random samples of the client's training data (Sec. 4.2).
"""
from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fl_server.algorithms import build_algorithm
from fl_server.algorithms.fedicon import FedICON
from lab.protocol import Protocol
from lab.runner import build_federated, own_simulation, safe_name
from fl_server.data import load_dataset
from fl_server.data.corruptions import corrupt
from fl_server.data.federated import FederatedData
from fl_server.data.shifts import resize
from fl_server.torch_device import describe
from fl_server.engine import Simulation
from fl_server.functional import make_forward, unstack
from fl_server.models.norm import calibrate, norm_mode, stat_norms


# display name -> (training method, evaluation method in the registry)
SHIFT_METHODS: dict[str, tuple[str, str]] = {
    "FedAvg": ("FedAvg", "FedAvg"), "FedAvg-FT": ("FedAvg", "FedAvg+FT"), "TENT": ("FedAvg", "TENT"),
    "FedICON w/o TTA": ("FedICON", "FedICON w/o TTA"), "FedICON": ("FedICON", "FedICON"),
    "FedICON online": ("FedICON", "FedICON"),
    # batch-normalised encoders only (the -bn protocols): FedICON w/o TTA predicting with the client's test-batch
    # statistics instead of the training population's -- the part of a TTA gain that needs no Eq. 7 step
    "FedICON BN-stats": ("FedICON", "FedICON w/o TTA"),
    # batch-normalised models only: the original TENT's parameters (normalisation affine scale and shift)
    "TENT (BN affine)": ("FedAvg", "TENT"),
}
# with a batch-normalised model, these predict with the test batch's statistics (BatchNorm in train mode, as TENT
# and FedICON's test-time step run); the others with the training population's (fl_server.models.norm)
BATCH_STATS_AT_TEST = ("TENT", "TENT (BN affine)", "FedICON", "FedICON online", "FedICON BN-stats")


def assign_by_label(labels: np.ndarray, client_counts: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Split ``labels``' indices over clients: class c goes to clients in proportion to ``client_counts[:, c]``
    (each client's training count of c). Returns one index array per client."""
    k, c = client_counts.shape
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for cls in range(c):  # C classes, not samples
        idx = rng.permutation(np.flatnonzero(labels == cls))
        share = client_counts[:, cls] / max(client_counts[:, cls].sum(), 1)
        cuts = np.round(np.cumsum(share)[:-1] * len(idx)).astype(int)
        for j, chunk in enumerate(np.split(idx, cuts)):
            parts[j].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def _conditions(protocol: Protocol, fed: FederatedData, seed: int,
                data_root: str | None) -> list[tuple[str, str, list[np.ndarray], list[np.ndarray]]]:
    """(split, shift, per-client images, per-client labels) for every evaluation condition."""
    opt = protocol.options
    rng = np.random.default_rng([seed, 99])
    counts = np.stack([np.bincount(fed.dataset.y[t], minlength=fed.dataset.num_classes) for t in fed.train])
    out: list[tuple[str, str, list[np.ndarray], list[np.ndarray]]] = []

    def add(split: str, shift: str, x: np.ndarray, y: np.ndarray, parts: list[np.ndarray]) -> None:
        out.append((split, shift, [x[p] for p in parts], [y[p] for p in parts]))

    val_idx = np.concatenate(fed.val)
    val_parts = np.split(np.arange(len(val_idx)), np.cumsum([len(v) for v in fed.val])[:-1])
    xv, yv = fed.dataset.x[val_idx], fed.dataset.y[val_idx]
    add("val", "clean", xv, yv, val_parts)
    for name in opt.get("val_corruptions", ()):
        add("val", f"{name}-3", corrupt(xv, name, 3, np.random.default_rng([seed, 1, len(out)])), yv, val_parts)

    test = load_dataset(protocol.dataset, root=data_root, split="test")
    keep = opt.get("max_test_per_client")
    parts = assign_by_label(test.y, counts, rng)
    if keep:
        parts = [p[:keep] for p in parts]
    add("test", "clean", test.x, test.y, parts)
    for name in opt.get("test_corruptions", ()):
        for sev in opt.get("severities", (3,)):
            add("test", f"{name}-{sev}", corrupt(test.x, name, sev, np.random.default_rng([seed, 2, len(out)])),
                test.y, parts)
    if opt.get("domain_shift") and protocol.dataset == "mnist":
        digits = load_dataset("digits", split="all")
        dparts = assign_by_label(digits.y, counts, rng)
        add("test", "digits", resize(digits.x, (28, 28)), digits.y, dparts)
    return out


def _online(algo: Any) -> bool:
    return isinstance(algo, FedICON) and algo.hp.tta and algo.hp.tta_mode == "online"


def _online_memories(algo: Any, fed: FederatedData, seed: int, device: torch.device,
                     dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Online FedICON's initial memory per training client: ``memory_size`` random samples of its training
    data (None for the other methods)."""
    if not _online(algo):
        return None
    rng = np.random.default_rng([seed, 23])
    picks = [np.sort(rng.choice(t, min(algo.hp.memory_size, len(t)), replace=False)) for t in fed.train]
    return [torch.from_numpy(fed.dataset.x[p]).to(device, dtype) for p in picks]


def _mean_accuracy(algo: Any, state: dict, params: Any, stacked: bool, xs: list[np.ndarray],
                   ys: list[np.ndarray], device: torch.device, dtype: torch.dtype,
                   memories: list[torch.Tensor] | None = None) -> float:
    """Mean over clients of the accuracy after the method's test-time step on the client's unlabeled data
    (online FedICON: of the predictions made as the data stream in, from the client's initial memory)."""
    per_client = unstack(params) if stacked else [params] * len(xs)
    accs = []
    for i, (p, x, y) in enumerate(zip(per_client, xs, ys)):  # one adaptation per client
        if len(y) == 0:
            continue
        xt = torch.from_numpy(x).to(device, dtype)
        if memories is not None:
            logits = algo.online(p, algo.projection_state(state), xt, memories[i])[1]
        else:
            adapted = algo.personalize({**state, "params": p}, xt)
            with torch.no_grad():
                logits = algo.predict(adapted, xt)
        accs.append(float((logits.argmax(-1).cpu().numpy() == y).mean()))
    return float(np.mean(accs))


def _tune_and_evaluate(protocol: Protocol, grid: dict[str, Any], algo: Any,
                       evaluate: Callable[[str], list[dict[str, Any]]], chosen: dict[str, Any],
                       results: list[dict[str, Any]]) -> None:
    """Test-time hyperparameters chosen on the validation conditions (mean over them), then tested once; the
    covariate-s<k> rows are the means over the corruptions at severity k."""
    for name, values in grid.items():
        scores = []
        for v in values:
            setattr(algo.hp, name, v)
            scores.append(float(np.mean([r["value"] for r in evaluate("val")])))
        chosen[name] = values[int(np.argmax(scores))]
        setattr(algo.hp, name, chosen[name])
        results += [{"split": "val-tuning", "shift": f"{name}={v}", "value": sc} for v, sc in zip(values, scores)]
    results += evaluate("val") + evaluate("test")
    for sev in protocol.options.get("severities", ()):
        vals = [r["value"] for r in results if r["split"] == "test" and r["shift"].endswith(f"-{sev}")]
        if vals:
            results.append({"split": "test", "shift": f"covariate-s{sev}", "value": float(np.mean(vals))})


def training_hyper(protocol: Protocol, train_name: str) -> dict[str, Any]:
    """The training run's hyperparameters: the protocol's, and FedICON's encoder stage over ``encoder_fraction``
    of the rounds."""
    hp = dict(protocol.method_hp.get(train_name, {}))
    if train_name == "FedICON":
        hp["encoder_rounds"] = int(round(protocol.options.get("encoder_fraction", 0.8) * protocol.rounds))
    return hp


def build_shift_simulation(protocol: Protocol, method: str, seed: int, run_dir: Path | None, fed: FederatedData,
                           device: str = "auto", mode: str = "auto", progress: bool = True,
                           data_root: str | None = None) -> Simulation:
    """The training run ``method`` evaluates (shared by the methods trained alike: the run folder is the
    training method's, beside ``run_dir``), built from its recipe."""
    train_name = SHIFT_METHODS[method][0]
    train_dir = None if run_dir is None else run_dir.parent.parent / safe_name(train_name) / run_dir.name
    return own_simulation(protocol, train_name, seed, train_dir, fed, device, mode, progress, data_root,
                          hyper=training_hyper(protocol, train_name))


def run_shift_seed(protocol: Protocol, method: str, seed: int, run_dir: Path | None, device: str = "auto",
                   mode: str = "auto", progress: bool = True, data_root: str | None = None,
                   fed: FederatedData | None = None) -> dict[str, Any]:
    """Train (or reuse) the method's training run, then evaluate every shift condition."""

    if method not in SHIFT_METHODS:
        raise ValueError(f"fedicon-shift has no method {method!r}; choose one of {', '.join(SHIFT_METHODS)}")
    train_name, eval_name = SHIFT_METHODS[method]
    fed = fed if fed is not None else build_federated(protocol, seed, data_root)
    sim = build_shift_simulation(protocol, method, seed, run_dir, fed, device, mode, progress, data_root)
    model, hp = sim.algorithm.model, training_hyper(protocol, train_name)
    if protocol.method_hp.get(method, {}).get("adapt") == "norm_affine" and not stat_norms(model):
        raise ValueError(f"{method} needs a batch-normalised model and {protocol.model} has none "
                         "(run it on a -bn protocol)")
    result = sim.run()
    t0 = time.perf_counter()
    eval_hp = {**hp, **protocol.method_hp.get(method, {})}
    if eval_name.startswith("FedICON"):
        eval_hp.pop("tta", None)
    algo = build_algorithm(eval_name, model, fed.num_train_clients, seed=seed, **eval_hp)
    state = sim.server_state
    if stat_norms(model):  # population statistics of the final global model over the training clients' data
        forward = make_forward(model)
        calibrate(model, lambda xb: forward(state["params"], xb),
                  (sim.x[torch.as_tensor(t[i:i + 256])] for t in fed.train for i in range(0, len(t), 256)))
    ids = np.arange(fed.num_train_clients)
    rng = np.random.default_rng([seed, 7])
    params = algo.val_params(state, ids, sim.trainer(rng))
    stacked = sim._is_stacked(params)
    conditions = _conditions(protocol, fed, seed, data_root)
    memories = _online_memories(algo, fed, seed, sim.device, sim.dtype)

    def evaluate(split: str) -> list[dict[str, Any]]:
        return [{"split": sp, "shift": shift,
                 "value": 100 * _mean_accuracy(algo, state, params, stacked, xs, ys, sim.device, sim.dtype,
                                               memories)}
                for sp, shift, xs, ys in conditions if sp == split]

    chosen: dict[str, Any] = {}
    grid = protocol.options.get("tune", {}).get(method, {})
    results: list[dict[str, Any]] = []
    test_mode = "batch" if method in BATCH_STATS_AT_TEST else "population"
    with norm_mode(model, test_mode):  # a no-op for models without batch normalisation
        _tune_and_evaluate(protocol, grid, algo, evaluate, chosen, results)
    by = {(r["split"], r["shift"]): r["value"] for r in results}
    return {
        "dataset": protocol.dataset, "method": method, "seed": seed, "model": protocol.model,
        "rounds": protocol.rounds, "best_round": protocol.rounds - 1, "trained_as": train_name,
        "val": by.get(("val", "clean")), "test": by.get(("test", "clean")), "results": results, "chosen": chosen,
        "train_wall_s": round(result.wall_s, 2), "wall_s": round(result.wall_s + time.perf_counter() - t0, 2),
        "device": describe(sim.device), "mode": sim.mode, "hyper": dataclasses.asdict(algo.hp),
        "protocol_note": protocol.note, "host": platform.node(),
    }
