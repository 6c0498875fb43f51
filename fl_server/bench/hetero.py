"""The ``upfl-hetero`` protocol (UPFL Sec. 4.6): HeteroFedTTA with three model sizes and the KD loss of
Eq. 14 at several lambda.

The engine steps clients of one architecture, so each size group is its own
:class:`~fl_server.engine.Simulation` of FedTTA over the group's clients (client sampling, mini-batches,
vmap/loop, server averaging of psi and phi within the group: unchanged); this module drives the groups
round by round and adds Algorithm 2's knowledge exchange between them:
  digest (Eq. 14 on D_p toward the consensus) -> revisit (the group's FedTTA round on the clients' own data)
  -> communicate (each client's f(D_p|psi_i), f(D_p|psi~_i)) -> consensus F_base, F_per = means over clients.
The digest of a group is computed once per round: every client of the group starts from the same group model
and digests the same consensus on the same chunks, so each would reach the same state. A new client (and a
training client's validation) gets its group's digested model and personalizes it with FedTTA's
``personalize`` (one step, or FedTTA++'s entropy early stopping when ``patience`` >= 1).
"HeteroFedTTA (no KD)" is the control: the three groups trained side by side, never exchanging anything.
"""
from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fl_server.algorithms import build_algorithm
from fl_server.algorithms.hetero_fedtta import (SIZE_GROUPS, assign_sizes, clients_public_logits, digest,
                                                public_chunks)
from fl_server.data.federated import FederatedData
from fl_server.device import describe
from fl_server.engine import Simulation
from fl_server.functional import State, tree_map
from fl_server.models import build_model

if TYPE_CHECKING:
    from fl_server.bench.experiments import Protocol

# display name -> lambda of Eq. 14 (None: no knowledge exchange)
HETERO_METHODS: dict[str, float | None] = {
    "HeteroFedTTA (no KD)": None, "HeteroFedTTA (lambda=0)": 0.0, "HeteroFedTTA (lambda=0.1)": 0.1,
    "HeteroFedTTA (lambda=1)": 1.0,
}


def split_by_size(fed: FederatedData, seed: int) -> dict[str, FederatedData]:
    """One FederatedData per size group (training and new clients each assigned with equal probability)."""
    rng = np.random.default_rng([seed, 0x4E7])
    train_group, new_group = assign_sizes(fed.num_train_clients, rng), assign_sizes(len(fed.new), rng)
    out = {}
    for g, name in enumerate(SIZE_GROUPS):
        train = np.flatnonzero(train_group == g)
        out[name] = dataclasses.replace(
            fed, train=[fed.train[k] for k in train], val=[fed.val[k] for k in train],
            new=[fed.new[j] for j in np.flatnonzero(new_group == g)], info={**fed.info, "size_group": name})
    return out


class HeteroRun:
    """The size groups of one seed, and the exchange between them."""

    def __init__(self, protocol: "Protocol", fed: FederatedData, seed: int, lam: float | None, device: str = "auto",
                 mode: str = "auto") -> None:
        self.lam, self.opt = lam, protocol.options
        shape, classes = fed.dataset.x.shape[1:], fed.dataset.num_classes
        hp = protocol.method_hp.get("HeteroFedTTA", {})
        self.sims: dict[str, Simulation] = {}
        for name, group in split_by_size(fed, seed).items():
            arch, width = SIZE_GROUPS[name]
            algo = build_algorithm("FedTTA", build_model(arch, shape, classes, seed=seed), group.num_train_clients,
                                   seed=seed, **{**hp, "adapt_width": width})
            self.sims[name] = Simulation(algo, group, protocol.run_config(seed, None, device, mode, progress=False))
        first = next(iter(self.sims.values()))
        self.chunks = public_chunks(first.x[torch.from_numpy(fed.public)], self.opt.get("public_batch", 64))
        self.digest_steps = int(self.opt.get("digest_epochs", 1) * len(self.chunks))

    def round(self, r: int) -> None:
        """Revisit every group (its FedTTA round), then communicate, aggregate the consensus and let every
        group digest it (the start of round r + 1, also what a new client receives)."""
        base, per = [], []
        for sim in self.sims.values():
            _, states = sim.run_round(r)
            if self.lam is not None:
                b, p = clients_public_logits(sim.algorithm, states, self.chunks, sim.mode)
                base.append(b)
                per.append(p)
        if self.lam is None:
            return
        f_base, f_per = torch.cat(base).mean(0), torch.cat(per).mean(0)  # F_base(D_p), F_per(D_p), 1/N sum_i
        for sim in self.sims.values():
            sim.server_state = digest(sim.algorithm, sim.server_state, self.chunks, f_base, f_per, self.lam,
                                      self.digest_steps)

    def accuracies(self, split: str, states: dict[str, State] | None = None) -> dict[str, list[float]]:
        """Per group, per client accuracy after personalization (``split``: "val" or "new")."""
        return {name: sim.personalized_accuracies(getattr(sim.fed, split), None if states is None else states[name])
                for name, sim in self.sims.items()}

    def states(self) -> dict[str, State]:
        return {name: tree_map(torch.clone, sim.server_state) for name, sim in self.sims.items()}


def _rows(split: str, accs: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = [{"split": split, "group": name, "value": 100 * float(np.mean(a))} for name, a in accs.items() if a]
    pooled = [v for a in accs.values() for v in a]
    return rows + [{"split": split, "group": "all", "value": 100 * float(np.mean(pooled))}]


def run_hetero_seed(protocol: "Protocol", method: str, seed: int, run_dir: Path | None, device: str = "auto",
                    mode: str = "auto", progress: bool = True, data_root: str | None = None,
                    fed: FederatedData | None = None) -> dict[str, Any]:
    """Train HeteroFedTTA for one seed, validate every ``eval_every`` rounds, test the new clients once on
    the groups' models of the best validation round (mean over all training clients)."""
    from fl_server.bench.runner import build_federated  # runner imports the experiments

    if method not in HETERO_METHODS:
        raise ValueError(f"upfl-hetero has no method {method!r}; choose one of {', '.join(HETERO_METHODS)}")
    fed = fed if fed is not None else build_federated(protocol, seed, data_root)
    run = HeteroRun(protocol, fed, seed, HETERO_METHODS[method], device, mode)
    t0 = time.perf_counter()
    best: tuple[float, int, dict[str, State], dict[str, list[float]]] = (-1.0, -1, {}, {})
    curve = []
    for r in tqdm(range(protocol.rounds), desc=f"{method} {protocol.dataset}", disable=not progress):
        run.round(r)
        if (r + 1) % protocol.eval_every == 0 or r == protocol.rounds - 1:
            val = run.accuracies("val")
            overall = float(np.mean([v for a in val.values() for v in a]))
            curve.append({"round": r, "val": 100 * overall})
            if overall > best[0]:
                best = (overall, r, run.states(), val)
    test = run.accuracies("new", best[2])
    results = _rows("val", best[3]) + _rows("test", test)
    sim = next(iter(run.sims.values()))
    return {
        "dataset": protocol.dataset, "method": method, "seed": seed, "model": "/".join(
            SIZE_GROUPS[g][0] for g in SIZE_GROUPS), "rounds": protocol.rounds, "best_round": best[1],
        "val": next(e["value"] for e in results if e["split"] == "val" and e["group"] == "all"),
        "test": results[-1]["value"], "results": results,
        "group_clients": {g: [s.fed.num_train_clients, len(s.fed.new)] for g, s in run.sims.items()},
        "public_size": int(len(fed.public)), "digest_steps": run.digest_steps, "lambda": HETERO_METHODS[method],
        "wall_s": round(time.perf_counter() - t0, 2), "device": describe(sim.device), "mode": sim.mode,
        "hyper": dataclasses.asdict(sim.algorithm.hp), "protocol_note": protocol.note, "host": platform.node(),
        "curve": curve,
    }
