"""ODPFL-HN experiments beyond UPFL Table 1 (SPEC.md section 2; seeds/odpfl-hn.txt Sec. 6-7).

``odpfl-dirichlet`` is a plain harness protocol (see experiments.py): Dir(alpha) labels over 100 clients,
10% new clients, 500 steps with 10% of the training clients per step (the ODPFL-HN paper's protocol).

``odpfl-dp`` (Sec. 7) needs new clients with up to 3,000 samples, more than any client of a 100-client split
holds, so it has its own split (:func:`dp_split`), seeded:
  * 10 new clients; new client j holds classes j and j+1 (mod 10), so every class serves exactly two of them.
    Each gets ``pool`` (3,000) samples for its embedding set, half of each class, shuffled so that every
    prefix keeps the 50/50 mix, plus ``eval_size`` (300) disjoint samples of the same classes for scoring.
    The embedding sets are nested: |D| = 100 uses the first 100 samples of the 3,000.
  * Everything else (3,700 samples per class of the 70,000) is split pathologically (2 classes per client)
    over the training clients, 85/15 train/validation.
ODPFL-HN is trained with the DP encoder (unit-sphere per-sample outputs, mean pooling, Lemma 2). A new client
then computes e on its first |D| samples, adds Gaussian noise calibrated to (eps, delta = 0.01, |D|) and
receives w = f_theta(e~); accuracy is the mean over new clients on their evaluation samples. FedAvg's global
model (which ignores D) is the reference row.
"""
from __future__ import annotations

import dataclasses
import math
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab.runner import own_simulation
from fl_server.data import load_dataset, partitions
from fl_server.data.datasets import ArrayDataset
from fl_server.data.federated import FederatedData
from fl_server.diagnostics import nonfinite_warning
from fl_server.torch_device import describe
from fl_server.engine import Simulation

DP_SET_SIZES = (100, 300, 1000, 3000)
DP_EPSILONS = (0.3, 1.0, math.inf)
DP_DELTA = 0.01


@dataclasses.dataclass
class DPSplit:
    fed: FederatedData  # training clients only (new = [])
    embed_pools: list[np.ndarray]  # per new client: ``pool`` indices, every prefix ~ half of each class
    eval_sets: list[np.ndarray]  # per new client: disjoint scoring indices


def dp_split(dataset: ArrayDataset, num_train_clients: int, rng: np.random.Generator, pool: int = 3000,
             eval_size: int = 300, val_fraction: float = 0.15, num_new: int = 10) -> DPSplit:
    """The odpfl-dp split described in the module docstring."""
    c = dataset.num_classes
    per_client_class = (pool + eval_size) // 2
    by_class = [rng.permutation(np.flatnonzero(dataset.y == k)) for k in range(c)]
    need = 2 * per_client_class * num_new // c  # per class: two new clients (for num_new = c)
    if min(len(b) for b in by_class) < need:
        raise ValueError(f"odpfl-dp needs {need} samples per class for {num_new} new clients of {pool} + "
                         f"{eval_size} samples; {dataset.name} has {min(len(b) for b in by_class)}")
    taken = [0] * c
    embed_pools, eval_sets = [], []
    for j in range(num_new):
        halves = []
        for k in (j % c, (j + 1) % c):
            halves.append(by_class[k][taken[k]:taken[k] + per_client_class])
            taken[k] += per_client_class
        emb = np.stack([h[:pool // 2] for h in halves], 1).reshape(-1)  # interleaved: a, b, a, b, ...
        embed_pools.append(emb)
        eval_sets.append(np.concatenate([h[pool // 2:] for h in halves]))
    rest = np.concatenate([b[t:] for b, t in zip(by_class, taken)])
    clients = [rest[i] for i in partitions.pathological(dataset.y[rest], num_train_clients, rng)]
    train, val = zip(*(partitions.train_val_split(cl, val_fraction, rng) for cl in clients))
    info = {"partition": "pathological (odpfl-dp split)", "num_clients": num_train_clients, "new_clients": num_new,
            "pool": pool, "eval_size": eval_size, "val_fraction": val_fraction}
    return DPSplit(FederatedData(dataset, list(train), list(val), [], info), embed_pools, eval_sets)


def build_dp_simulation(protocol: Any, method: str, seed: int, run_dir: Path | None, device: str = "auto",
                        mode: str = "auto", progress: bool = True,
                        data_root: str | None = None) -> tuple[Simulation, DPSplit]:
    """The engine run of ``method`` on the odpfl-dp split of ``seed`` (built from its recipe) and the split."""
    split = protocol_dp_split(protocol, seed, data_root)
    return own_simulation(protocol, method, seed, run_dir, split.fed, device, mode, progress, data_root), split


def protocol_dp_split(protocol: Any, seed: int, data_root: str | None = None) -> DPSplit:
    """The odpfl-dp split of ``seed`` under ``protocol`` (its ``pool``, ``eval_size`` and validation fraction)."""
    opts = protocol.options
    dataset = load_dataset(protocol.dataset, root=data_root, split="all")
    return dp_split(dataset, protocol.num_clients, np.random.default_rng([seed, 11]), opts.get("pool", 3000),
                    opts.get("eval_size", 300), protocol.val_fraction)


def run_dp_seed(protocol: Any, method: str, seed: int, run_dir: Path | None, device: str = "auto",
                mode: str = "auto", progress: bool = True, data_root: str | None = None,
                fed: FederatedData | None = None) -> dict[str, Any]:
    """Train ``method`` on the odpfl-dp split, then score the new clients per (|D|, eps); one raw record."""
    opts = protocol.options
    sim, split = build_dp_simulation(protocol, method, seed, run_dir, device, mode, progress, data_root)
    algorithm = sim.algorithm
    result = sim.run()
    state = sim.best_state if sim.best_state is not None else sim.server_state
    x = sim.x
    y = sim.y

    def accuracy(params: dict, idx: np.ndarray) -> float:
        with torch.no_grad():
            pred = algorithm.forward(params, x[torch.from_numpy(idx)]).argmax(-1)
        return float((pred == y[torch.from_numpy(idx)]).float().mean())

    results: list[dict[str, Any]] = []
    if method == "ODPFL-HN":
        sizes = [n for n in opts.get("set_sizes", DP_SET_SIZES) if n <= len(split.embed_pools[0])]
        for eps in opts.get("epsilons", DP_EPSILONS):
            algorithm.hp.dp_epsilon = eps  # personalize() reads it: noise for a finite eps
            algorithm.dp_rng = np.random.default_rng([seed, 13, int(1000 * eps) if math.isfinite(eps) else 0])
            for n in sizes:
                accs = [accuracy(algorithm.personalize(state, x[torch.from_numpy(pool[:n])]), ev)
                        for pool, ev in zip(split.embed_pools, split.eval_sets)]
                results.append({"split": "test", "setting": f"|D|={n}, eps={eps:g}", "set_size": n,
                                "epsilon": eps, "value": 100 * float(np.mean(accs))})
    else:  # FedAvg: the shared global model, the same at every (|D|, eps)
        accs = [accuracy(state["params"], ev) for ev in split.eval_sets]
        results.append({"split": "test", "setting": "global model (ignores D)", "value": 100 * float(np.mean(accs))})
    results.append({"split": "val", "setting": "training clients", "value": 100 * result.best_val})
    return {"dataset": protocol.dataset, "method": method, "seed": seed, "model": protocol.model,
            "rounds": protocol.rounds, "best_round": result.best_round, "val": 100 * result.best_val,
            "test": None, "results": results, "wall_s": round(result.wall_s, 2), "device": describe(sim.device),
            "mode": sim.mode, "hyper": dataclasses.asdict(algorithm.hp), "protocol_note": protocol.note,
            "host": platform.node(), "split": split.fed.info,
            # the served state diverged (NaN or inf): its rows are a collapsed model's, not the method's
            "warning": nonfinite_warning(state),
            **({"diverged_round": result.diverged_round} if result.diverged_round is not None else {})}

