"""The ``upfl-hetero`` protocol (UPFL Sec. 4.6): HeteroFedTTA with three model sizes and the KD loss of
Eq. 14 at several lambda.

The engine steps clients of one architecture, so each size group is its own
:class:`~fl_server.engine.Simulation` of FedTTA (FedTTA++ where the protocol's ``patience`` stops adaptation
early: it trains as FedTTA) over the group's clients (client sampling, mini-batches,
vmap/loop, server averaging of psi and phi within the group: unchanged); this module drives the groups
round by round and adds Algorithm 2's knowledge exchange between them:
  digest (Eq. 14 on D_p toward the consensus) -> revisit (the group's FedTTA round on the clients' own data)
  -> communicate (each client's f(D_p|psi_i), f(D_p|psi~_i)) -> consensus F_base, F_per = means over clients.
The digest of a group is computed once per round: every client of the group starts from the same group model
and digests the same consensus on the same chunks, so each would reach the same state. A new client (and a
training client's validation) gets its group's digested model and personalizes it with FedTTA's
``personalize`` (one step, or FedTTA++'s entropy early stopping when ``patience`` >= 1).
"HeteroFedTTA (no KD)" is the control: the three groups trained side by side, never exchanging anything.
A run checkpoints every validation round into its run folder (``checkpoint.npz``: the groups' states and the
progress; ``best.npz``: the groups' states at the best validation round) and resumes from there; a round
depends only on its index and the states, so a resumed run repeats the uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fl_server.algorithms.fedtta import FedTTA
from fl_server.algorithms.hetero_fedtta import (SIZE_GROUPS, assign_sizes, clients_public_logits, digest,
                                                public_chunks)
from lab.protocol import Protocol
from lab.runner import build_federated, own_simulation
from fl_server.data.federated import FederatedData
from fl_server.torch_device import describe
from fl_server.engine import Simulation
from fl_server.engine.graphs import GraphedLocalSteps
from fl_server.engine.stacked import check_stackable, level_rounds, stacked_round
from fl_server.functional import State, tree_map
from fl_server.rundir import checkpoint_meta, load_state, save_state


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

    def __init__(self, protocol: Protocol, fed: FederatedData, seed: int, lam: float | None, device: str = "auto",
                 mode: str = "auto", data_root: str | None = None, engine: dict[str, Any] | None = None) -> None:
        """``engine``: further RunConfig fields of the groups' runs (``dtype``)."""
        self.lam, self.opt, self.seed = lam, protocol.options, seed
        hp = protocol.method_hp.get("HeteroFedTTA", {})
        self.sims: dict[str, Simulation] = {}
        method = FedTTA.family_member(hp)  # the protocol's FedTTA++ early stopping makes the groups FedTTA++
        for name, group in split_by_size(fed, seed).items():  # each group: that method's recipe at its model size
            arch, width = SIZE_GROUPS[name]
            self.sims[name] = own_simulation(protocol, method, seed, None, group, device, mode, False, data_root,
                                             engine=engine, model=arch, hyper={**hp, "adapt_width": width})
        first = next(iter(self.sims.values()))
        self.chunks = public_chunks(first.x[torch.from_numpy(fed.public)], self.opt.get("public_batch", 64))
        self.digest_steps = int(self.opt.get("digest_epochs", 1) * len(self.chunks))

    def round(self, r: int) -> None:
        """Revisit every group (its FedTTA round), then :meth:`exchange`."""
        hetero_round([self], r)

    def exchange(self, local_states: dict[str, State]) -> None:
        """After the groups' revisit (``local_states``: per group, its clients' local states before aggregation):
        communicate, aggregate the consensus and let every group digest it (the start of the next round, also
        what a new client receives). The 'no KD' control exchanges nothing."""
        if self.lam is None:
            return
        base, per = [], []
        for name, sim in self.sims.items():
            b, p = clients_public_logits(sim.algorithm, local_states[name], self.chunks, sim.mode)
            base.append(b)
            per.append(p)
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

    def load_states(self, states: dict[str, State]) -> None:
        for name, sim in self.sims.items():
            sim.server_state = states[name]

    def fingerprint(self) -> str:
        """What identifies the run: lambda, the exchange's settings and every group's own run fingerprint."""
        ident = {"lambda": self.lam, "digest_steps": self.digest_steps, "public_chunks": list(self.chunks.shape),
                 "groups": {name: sim.fingerprint for name, sim in self.sims.items()}}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def hetero_round(runs: list[HeteroRun], r: int, graphs: dict[str, GraphedLocalSteps | None] | None = None) -> None:
    """Round ``r`` of every run in ``runs`` (lambda variants of one seed): each size group's revisit is one stacked
    round over the runs (:func:`~fl_server.engine.stacked.stacked_round`; a single run's is its plain round), then
    each run's own :meth:`~HeteroRun.exchange`. ``graphs``: a graph cache per group (default: the first run's)."""
    graphs = graphs or {name: sim.graphed for name, sim in runs[0].sims.items()}
    together = {name: stacked_round([run.sims[name] for run in runs], r, graphs[name]) for name in runs[0].sims}
    for j, run in enumerate(runs):
        run.exchange({name: rounds[j][1] for name, rounds in together.items()})


@dataclass
class HeteroProgress:
    """Where a run stands: rounds done, the best validation round so far and the validation curve."""
    rounds_done: int = 0
    best_val: float = -1.0
    best_round: int = -1
    best_val_groups: dict[str, list[float]] = field(default_factory=dict)
    best_states: dict[str, State] = field(default_factory=dict)
    curve: list[dict[str, float]] = field(default_factory=list)
    wall_s: float = 0.0

    def meta(self, fingerprint: str) -> dict[str, Any]:
        return {"fingerprint": fingerprint, "rounds_done": self.rounds_done, "best_val": self.best_val,
                "best_round": self.best_round, "best_val_groups": self.best_val_groups, "curve": self.curve,
                "wall_s": self.wall_s}


def resume_hetero(run: HeteroRun, run_dir: Path | None) -> HeteroProgress:
    """The progress stored in ``run_dir`` (the run's states loaded into ``run``), or a fresh start."""
    ckpt = None if run_dir is None else run_dir / "checkpoint.npz"
    if ckpt is None or not ckpt.exists():
        return HeteroProgress()
    meta = checkpoint_meta(ckpt)
    if meta is None or meta.get("fingerprint") != run.fingerprint():
        raise ValueError(f"{run_dir} holds a checkpoint of a different run (config changed); use another "
                         "--runs-dir or delete it")
    device = next(iter(run.sims.values())).device
    run.load_states(load_state(ckpt, device))
    best = load_state(run_dir / "best.npz", device) if meta["best_round"] >= 0 else {}
    return HeteroProgress(meta["rounds_done"], meta["best_val"], meta["best_round"], meta["best_val_groups"],
                          best, meta["curve"], meta["wall_s"])


def train_hetero(run: HeteroRun, protocol: Protocol, run_dir: Path | None, progress: bool = True,
                 until: int | None = None) -> HeteroProgress:
    """Rounds from the last checkpoint in ``run_dir`` up to ``until`` (default: all), validating every
    ``eval_every`` rounds and checkpointing at each validation round."""
    return train_hetero_stacked([run], protocol, [run_dir], progress, until)[0]


def close_hetero_round(run: HeteroRun, state: HeteroProgress, protocol: Protocol, run_dir: Path | None, r: int,
                       train_s: float) -> None:
    """After round ``r`` of ``run`` (``train_s`` seconds): validate every ``eval_every`` rounds (keeping the best
    states) and checkpoint at each validation round."""
    t0 = time.perf_counter()
    validate = (r + 1) % protocol.eval_every == 0 or r == protocol.rounds - 1
    if validate:
        val = run.accuracies("val")
        overall = float(np.mean([v for a in val.values() for v in a]))
        state.curve.append({"round": r, "val": 100 * overall})
        if overall > state.best_val:
            state.best_val, state.best_round, state.best_val_groups = overall, r, val
            state.best_states = run.states()
            if run_dir is not None:
                save_state(run_dir / "best.npz", state.best_states)
    state.rounds_done = r + 1
    state.wall_s += train_s + time.perf_counter() - t0
    if validate and run_dir is not None:  # the states and the progress they belong to: one rename
        save_state(run_dir / "checkpoint.npz", run.states(), state.meta(run.fingerprint()))


def train_hetero_stacked(runs: list[HeteroRun], protocol: Protocol, run_dirs: list[Path | None],
                         progress: bool = True, until: int | None = None) -> list[HeteroProgress]:
    """:func:`train_hetero` for the lambda variants of one seed at once: per round and size group, the variants'
    local steps are one stacked round, then each variant exchanges and digests on its own (:func:`hetero_round`).
    The variants share the seed, hence each group's clients, sampling, batches and round shapes; each keeps its own
    states, validation, best states and checkpoints, and equals its solo run in float64
    (lab/tests/test_hetero_fedtta.py). Variants resumed at different rounds are brought level first
    (:func:`~fl_server.engine.stacked.level_rounds`); a round's training time is shared equally by its runs."""
    if len({run.seed for run in runs}) > 1:
        raise ValueError(f"only the variants of one seed train together, got seeds {sorted({r.seed for r in runs})}")
    if len(runs) > 1:
        for name in runs[0].sims:
            check_stackable([run.sims[name] for run in runs])
    states = [resume_hetero(run, run_dir) for run, run_dir in zip(runs, run_dirs)]
    for run_dir in run_dirs:
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
    end = protocol.rounds if until is None else min(until, protocol.rounds)
    at = [state.rounds_done for state in states]
    graphs = {name: sim.graphed for name, sim in runs[0].sims.items()}  # one graph cache per group's shapes
    lambdas = ", ".join(str(run.lam) for run in runs)
    with tqdm(total=sum(max(end - a, 0) for a in at), disable=not progress,
              desc=f"lambda={lambdas} {protocol.dataset} seed {runs[0].seed}") as bar:
        for r, group in level_rounds(at, [end] * len(runs)):
            t0 = time.perf_counter()
            hetero_round([runs[k] for k in group], r, graphs)
            share = (time.perf_counter() - t0) / len(group)
            for k in group:
                close_hetero_round(runs[k], states[k], protocol, run_dirs[k], r, share)
                at[k] += 1
            bar.update(len(group))
    return states


def _rows(split: str, accs: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = [{"split": split, "group": name, "value": 100 * float(np.mean(a))} for name, a in accs.items() if a]
    pooled = [v for a in accs.values() for v in a]
    return rows + [{"split": split, "group": "all", "value": 100 * float(np.mean(pooled))}]


def run_hetero_seed(protocol: Protocol, method: str, seed: int, run_dir: Path | None, device: str = "auto",
                    mode: str = "auto", progress: bool = True, data_root: str | None = None,
                    fed: FederatedData | None = None) -> dict[str, Any]:
    """Train HeteroFedTTA for one seed, validate every ``eval_every`` rounds, test the new clients once on
    the groups' models of the best validation round (mean over all training clients)."""
    _check_methods([method])
    fed = fed if fed is not None else build_federated(protocol, seed, data_root)
    run = HeteroRun(protocol, fed, seed, HETERO_METHODS[method], device, mode, data_root)
    return hetero_record(protocol, method, run, train_hetero(run, protocol, run_dir, progress), fed)


def run_hetero_variants(protocol: Protocol, methods: list[str], seed: int, run_dirs: list[Path | None],
                        device: str = "auto", mode: str = "auto", progress: bool = True, data_root: str | None = None,
                        fed: FederatedData | None = None, engine: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """:func:`run_hetero_seed` for several ``methods`` (lambda variants) of one seed trained together
    (:func:`train_hetero_stacked`; ``mode`` "auto" means vmap, which stacking needs); one raw record per method,
    each naming the variants it trained with (``stacked_variants``)."""
    _check_methods(methods)
    fed = fed if fed is not None else build_federated(protocol, seed, data_root)
    runs = [HeteroRun(protocol, fed, seed, HETERO_METHODS[m], device, "vmap" if mode == "auto" else mode, data_root,
                      engine) for m in methods]
    states = train_hetero_stacked(runs, protocol, run_dirs, progress)
    return [{**hetero_record(protocol, method, run, state, fed), "stacked_variants": list(methods)}
            for method, run, state in zip(methods, runs, states)]


def _check_methods(methods: list[str]) -> None:
    for method in methods:
        if method not in HETERO_METHODS:
            raise ValueError(f"upfl-hetero has no method {method!r}; choose one of {', '.join(HETERO_METHODS)}")


def hetero_record(protocol: Protocol, method: str, run: HeteroRun, state: HeteroProgress,
                  fed: FederatedData) -> dict[str, Any]:
    """The raw record of a trained run: the new clients tested once on the groups' models of the best validation
    round."""
    seed = run.seed
    t0 = time.perf_counter()
    test = run.accuracies("new", state.best_states)
    results = _rows("val", state.best_val_groups) + _rows("test", test)
    sim = next(iter(run.sims.values()))
    return {
        "dataset": protocol.dataset, "method": method, "seed": seed, "model": "/".join(
            SIZE_GROUPS[g][0] for g in SIZE_GROUPS), "rounds": protocol.rounds, "best_round": state.best_round,
        "val": next(e["value"] for e in results if e["split"] == "val" and e["group"] == "all"),
        "test": results[-1]["value"], "results": results,
        "group_clients": {g: [s.fed.num_train_clients, len(s.fed.new)] for g, s in run.sims.items()},
        "public_size": int(len(fed.public)), "digest_steps": run.digest_steps, "lambda": HETERO_METHODS[method],
        "wall_s": round(state.wall_s + time.perf_counter() - t0, 2), "device": describe(sim.device), "mode": sim.mode,
        "hyper": dataclasses.asdict(sim.algorithm.hp), "protocol_note": protocol.note, "host": platform.node(),
        "curve": state.curve,
    }
