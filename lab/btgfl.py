"""The BTGFL benchmark (BTFL paper Sec. 5.1, Fig. 3; ``shared/SPEC.md`` section 3) on MNIST / Fashion-MNIST.

Protocol (per seed): the united train+test set is split over 20 clients by Dir(0.1) labels; each client holds
out ``test_fraction`` of its data as its IND test set (capped at ``max_stream`` samples), and 10% of the rest as
validation (only reported for the global model; nothing is selected on it or on the test streams). One BTFL
training run (FedAvg global model + per-client local heads, :mod:`fl_server.algorithms.btfl`) serves every
method; the model of the last round is evaluated. Per client five test streams, each a fresh stream:
  A orig IND    the client's held-out samples, in random order;
  B shifted IND A with covariate shift: each sample, at random, either one of the 14 corruptions
                (:mod:`fl_server.data.corruptions`, random type) or a rotation domain shift (random angle);
  C orig EXD    as many samples drawn from the other clients' held-out sets;
  D shifted EXD C with the same kind of shift;
  E synthetic   an even mix of A-D (a quarter of each), shuffled into one stream.
Methods: FedAvg (global head), FedAvg+FT (the local head: the global features fine-tuned by one personalization
epoch per round on frozen features), FedTHE (SPEC.md), FedTHE-code (the authors' history / z~, see
:mod:`edge_sdk._fedthe`) and BTFL, at test batch sizes 32 and 1. Accuracy of a column =
mean over clients of the client's stream accuracy; "avg" = mean of the five columns.

One raw file per (dataset, method, seed) under ``<results>/raw/btgfl/`` (the training run itself is resumable
under ``<runs>/btgfl/``); ``<results>/btgfl.json`` is aggregated from whatever seeds exist.
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from edge_sdk._btfl import BTFLStream, BTFLVariant
from edge_sdk._fedthe import fedthe_predict
from fl_server.algorithms.btfl import BTFL, ClientArtifacts
from lab.protocol import Experiment, Protocol
from lab.rows import write_atomic
from lab.runner import chance_seeds, own_simulation, raw_path, seed_list
from fl_server.data import load_dataset, partitions
from fl_server.data.corruptions import CORRUPTIONS, corrupt
from fl_server.data.datasets import ArrayDataset
from fl_server.data.federated import FederatedData
from fl_server.data.shifts import rotate
from fl_server.torch_device import describe
from fl_server.engine import Simulation

COLUMNS = ("orig_ind", "shifted_ind", "orig_exd", "shifted_exd", "synthetic")


@dataclass(frozen=True)
class StreamConfig:
    test_fraction: float = 0.2  # of each client's data, held out as its IND test set
    max_stream: int = 250  # cap on a client's stream length (bounds the shift/evaluation cost)
    severity: int = 3  # corruption severity (1..5)
    angles: tuple[float, ...] = (-40.0, -30.0, -20.0, 20.0, 30.0, 40.0)  # rotation domain shift, degrees


@dataclass
class BTGFLData:
    fed: FederatedData  # train / val indices into fed.dataset; no new clients
    x_test: np.ndarray  # [2P, C, H, W]: the P pooled test samples, then their shifted copies
    y_test: np.ndarray  # [2P]
    streams: list[dict[str, np.ndarray]]  # per client: column -> indices into x_test, in stream order


def _shift(x: np.ndarray, cfg: StreamConfig, rng: np.random.Generator) -> np.ndarray:
    """Half of the samples (at random) get a random corruption, the others a random rotation."""
    out = np.empty_like(x)
    kind = rng.random(len(x)) < 0.5
    which = rng.integers(len(CORRUPTIONS), size=len(x))
    angle = rng.integers(len(cfg.angles), size=len(x))
    for j, name in enumerate(CORRUPTIONS):  # one vectorised call per corruption type
        idx = np.flatnonzero(kind & (which == j))
        out[idx] = corrupt(x[idx], name, cfg.severity, rng)
    for j, deg in enumerate(cfg.angles):
        idx = np.flatnonzero(~kind & (angle == j))
        out[idx] = rotate(x[idx], deg)
    return out


def build_data(dataset: ArrayDataset, protocol: Protocol, seed: int, cfg: StreamConfig) -> BTGFLData:
    rng = np.random.default_rng([seed, 5])
    assert protocol.alpha is not None, "btgfl uses a Dirichlet partition"
    clients = partitions.dirichlet(dataset.y, protocol.num_clients, protocol.alpha, rng)
    rest, test = zip(*(partitions.train_val_split(c, cfg.test_fraction, rng) for c in clients))
    train, val = zip(*(partitions.train_val_split(r, protocol.val_fraction, rng) for r in rest))
    test = [rng.permutation(t)[:cfg.max_stream] for t in test]
    owner = np.repeat(np.arange(len(test)), [len(t) for t in test])
    pool = np.concatenate(test)
    p = len(pool)
    x_pool = dataset.x[pool]
    x_test = np.concatenate([x_pool, _shift(x_pool, cfg, rng)])
    y_test = np.concatenate([dataset.y[pool], dataset.y[pool]])
    streams = []
    start = 0
    for k, t in enumerate(test):
        n = len(t)
        a = start + np.arange(n)  # positions of client k's samples in the pool
        start += n
        others = np.flatnonzero(owner != k)
        c = rng.choice(others, size=n, replace=len(others) < n)
        q = max(1, n // 4)
        parts = [rng.choice(s, size=q, replace=False) for s in (a, a + p, c, c + p)]
        streams.append({"orig_ind": a, "shifted_ind": a + p, "orig_exd": c, "shifted_exd": c + p,
                        "synthetic": rng.permutation(np.concatenate(parts))})
    info = {"partition": "dirichlet", "alpha": protocol.alpha, "num_clients": protocol.num_clients, "seed": seed,
            "val_fraction": protocol.val_fraction, **asdict(cfg)}
    fed = FederatedData(dataset, list(train), list(val), [], info)
    return BTGFLData(fed, x_test, y_test, streams)


# ---------------------------------------------------------------------------------------------- evaluation
def btfl_stream(art: ClientArtifacts, g: np.ndarray, l_: np.ndarray, z: np.ndarray, bs: int, **options: Any
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One fresh BTFL stream over the samples in order, ``bs`` at a time -> (probabilities [N, C], weight of
    the global head e [N], log tau_hat [N]). ``options``: :class:`edge_sdk._btfl.BTFLVariant` fields (the
    authors' code variants); ``h_local_bar`` / ``h_global_bar`` there override the client's own."""
    h_local_bar = options.pop("h_local_bar", art.h_local_bar)
    h_global_bar = options.pop("h_global_bar", art.h_global_bar)
    stream = BTFLStream(art.local_dle, art.global_dle, h_local_bar, h_global_bar, BTFLVariant(**options))
    out, weights, log_tau = [], [], []
    for s in range(0, len(z), bs):  # the stream is sequential by definition; each call is vectorised
        out.append(stream.predict(l_[s:s + bs], g[s:s + bs], z[s:s + bs]))
        weights.append(stream.last_weights)
        log_tau.append(stream.last_log_tau_hat)
    return np.concatenate(out), np.concatenate(weights), np.concatenate(log_tau)


def _probs_and_mean_e(art: ClientArtifacts, g: np.ndarray, l_: np.ndarray, z: np.ndarray, bs: int
                      ) -> tuple[np.ndarray, float]:
    probs, e, _ = btfl_stream(art, g, l_, z, bs)
    return probs, float(e.mean())


def evaluate_methods(algorithm: BTFL, server_state: dict, data: BTGFLData, x: torch.Tensor
                     ) -> dict[str, dict[str, Any]]:
    """Per method: {"columns": {column: accuracy %}, "avg": ..., "eval_s": ...} (+ BTFL's mean weight e)."""
    arts = algorithm.client_artifacts(server_state, x, data.fed.train)
    with torch.no_grad():
        xt = torch.from_numpy(data.x_test).to(x.device, x.dtype)
        z_t = torch.cat([algorithm.features(server_state["params"], xt[s:s + 4096]) for s in range(0, len(xt), 4096)])
        g_all = algorithm.global_head(server_state["params"], z_t).double().cpu().numpy()
    z_all = z_t.double().cpu().numpy()
    predictors: dict[str, Callable[..., tuple[np.ndarray, float | None]]] = {
        "FedAvg": lambda art, g, l_, z: (g, None),
        "FedAvg+FT": lambda art, g, l_, z: (l_, None),
    }
    for bs in (32, 1):
        for name, variant in (("FedTHE", "spec"), ("FedTHE-code", "code")):
            predictors[f"{name} (bs={bs})"] = lambda art, g, l_, z, bs=bs, v=variant: (
                fedthe_predict(g, l_, z, art.mu_local, art.mu_global, bs, variant=v)[0], None)
        predictors[f"BTFL (bs={bs})"] = lambda art, g, l_, z, bs=bs: _probs_and_mean_e(art, g, l_, z, bs)
    results: dict[str, dict[str, Any]] = {}
    for method, predict in predictors.items():
        t0 = time.perf_counter()
        acc = {c: [] for c in COLUMNS}
        e_mean = {c: [] for c in COLUMNS}
        for art, streams in zip(arts, data.streams):
            for col, idx in streams.items():
                z, g = z_all[idx], g_all[idx]
                out, e = predict(art, g, z @ art.local_head.T, z)
                acc[col].append(float((out.argmax(1) == data.y_test[idx]).mean()))
                if e is not None:
                    e_mean[col].append(e)
        cols = {c: 100 * float(np.mean(v)) for c, v in acc.items()}
        results[method] = {"columns": cols, "avg": float(np.mean(list(cols.values()))),
                           "eval_s": round(time.perf_counter() - t0, 2)}
        if any(e_mean.values()):
            results[method]["mean_global_weight_e"] = {c: float(np.mean(v)) for c, v in e_mean.items()}
    return results


# ---------------------------------------------------------------------------------------------- runner
def _body_iterations(local_iterations: int) -> int:
    """5 local epochs + 1 personalization epoch per round -> the last sixth of the steps train the local head."""
    return local_iterations - max(1, round(local_iterations / 6))


def build_btfl_simulation(protocol: Protocol, seed: int, run_dir: Path | None, fed: FederatedData,
                          device: str = "auto", mode: str = "auto", progress: bool = True,
                          data_root: str | None = None) -> Simulation:
    """The one BTFL training run of ``seed`` every method's streams are scored on, built from its recipe."""
    hyper = {**protocol.method_hp.get("BTFL", {}), "body_iterations": _body_iterations(protocol.local_iterations)}
    return own_simulation(protocol, "BTFL", seed, run_dir, fed, device, mode, progress, data_root,
                          checkpoint_every=5, hyper=hyper)


def run_seed(protocol: Protocol, seed: int, run_dir: Path, cfg: StreamConfig, device: str = "auto",
             mode: str = "auto", progress: bool = True, data_root: str | None = None) -> dict[str, dict[str, Any]]:
    """Train BTFL once (resumable in ``run_dir``) and evaluate every method; returns method -> raw record."""
    dataset = load_dataset(protocol.dataset, root=data_root, split="all")
    data = build_data(dataset, protocol, seed, cfg)
    sim = build_btfl_simulation(protocol, seed, run_dir, data.fed, device, mode, progress, data_root)
    algorithm: BTFL = sim.algorithm  # type: ignore[assignment]
    result = sim.run()
    evals = evaluate_methods(algorithm, sim.server_state, data, sim.x)
    common = {"dataset": protocol.dataset, "seed": seed, "model": protocol.model, "rounds": protocol.rounds,
              "local_iterations": protocol.local_iterations, "batch_size": protocol.batch_size,
              "val_global": 100 * result.last.get("val", float("nan")), "train_wall_s": round(result.wall_s, 2),
              "device": describe(sim.device), "mode": sim.mode, "hyper": asdict(algorithm.hp),
              "streams": {**asdict(cfg), "clients": len(data.streams),
                          "samples_per_column": int(sum(len(s["orig_ind"]) for s in data.streams))},
              "protocol_note": protocol.note, "host": platform.node()}
    return {m: {**common, "method": m, **r, "wall_s": round(result.wall_s + r["eval_s"], 2)} for m, r in evals.items()}


def run_btgfl(exp: Experiment, datasets: list[str], methods: list[str], seeds: int | Sequence[int],
              results_dir: Path, runs_dir: Path, quick: bool = False, device: str = "auto", mode: str = "auto",
              progress: bool = True, data_root: str | None = None, command: str = "") -> list[dict]:
    """Harness entry (``python -m lab bench btgfl``): run every missing (dataset, seed), write raw files, aggregate."""
    cfg = StreamConfig(max_stream=40) if quick else StreamConfig()
    for dataset in datasets:
        if dataset not in exp.protocols:
            raise ValueError(f"{exp.name} has no protocol for {dataset!r}; choose from {', '.join(exp.protocols)}")
        protocol = exp.protocols[dataset]
        if quick:  # 3 rounds x 6 steps (5 body + 1 local head), short streams: a smoke test, not a result
            protocol = protocol.quick()
            protocol = replace(protocol, local_iterations=6, eval_every=protocol.rounds)
        for seed in seed_list(seeds):
            outs = {m: raw_path(results_dir, exp.name, dataset, m, seed) for m in methods}
            outs = {m: p for m, p in outs.items() if not p.exists()}
            if not outs:
                continue
            records = run_seed(protocol, seed, runs_dir / exp.name / dataset / f"seed{seed}", cfg, device, mode,
                               progress, data_root)
            for m, out in outs.items():
                out.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(out, json.dumps({**records[m], "command": command}, indent=1))
    return aggregate(exp, results_dir, command)


def aggregate(exp: Experiment, results_dir: Path, command: str = "") -> list[dict]:
    """Rows (DESIGN.md schema + ``column``) from the raw seed files: one per dataset, method and column."""
    rows: list[dict] = []
    for dataset in exp.protocols:
        for method in exp.methods:
            files = sorted(raw_path(results_dir, exp.name, dataset, method, 0).parent.glob("seed*.json"))
            records = [json.loads(p.read_text()) for p in files]
            if not records:
                continue
            for col in (*COLUMNS, "avg"):
                values = [r["avg"] if col == "avg" else r["columns"][col] for r in records]
                rows.append({
                    "experiment": exp.name, "dataset": dataset, "method": method, "split": "test", "column": col,
                    "metric": "accuracy", "mean": round(float(np.mean(values)), 2),
                    "std": round(float(np.std(values, ddof=1)) if len(values) > 1 else 0.0, 2),
                    "seeds": len(values), "paper": exp.paper.get((dataset, method, col)),
                    "device": ", ".join(sorted({r["device"] for r in records})),
                    "wall_s": round(float(np.mean([r["wall_s"] for r in records])), 1),
                    "rounds": records[0]["rounds"], "note": records[0].get("protocol_note", ""),
                    "command": records[0].get("command") or command,
                    **({"chance_seeds": low} if (low := chance_seeds(records, exp.protocols[dataset].dataset,
                                                                     "val_global")) else {}),
                })
    out = results_dir / f"{exp.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(rows, indent=1) + "\n")
    return rows
