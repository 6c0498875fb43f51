"""Diagnostic: why is BTFL below FedTHE on the btgfl benchmark? No training, no tuning.

Loads a finished btgfl run (``<runs>/bench/btgfl/<dataset>/seed<k>/checkpoint.npz``; the simulation resumes it
and trains nothing), rebuilds the streams exactly as ``lab.btgfl`` does and prints, per test column:
* accuracy of FedAvg / FedAvg+FT / FedTHE / BTFL, of BTFL with the oracle weight (e = 0 on IND, 1 on EXD
  samples, Eq. 21) and of FedTHE without its feature history (z~ = z: shows what the stream EMA buys);
* BTFL's mean e on the IND / EXD samples of each column, and FedTHE's mean w_g;
* AUROC (orig EXD vs orig IND, mean over clients) of the raw DLE log tau (Eq. 9, geometric mean), of log
  tau_hat (Eq. 15) and of FedTHE's d_l - d_g.
Test numbers here are diagnostics only; nothing is selected on them. ``--val`` adds the same methods on
validation streams built from the held-out TRAIN split (per client: its own val samples = IND, as many of the
other clients' val samples = EXD, and a half/half shuffled mix), the only place an option may be chosen.
``lab/research/sweep_btgfl_options.py`` runs BTFL's options on these streams (``load_seed``).

    python lab/research/probe_btgfl.py fashion_mnist 0 1 2 --runs runs --val   (per seed, then the mean over seeds)
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from edge_sdk._btfl import dle_log_likelihood, fsq_quantize
from edge_sdk._fedthe import fedthe_predict
from edge_sdk._numerics import log_softmax
from scipy.stats import rankdata

from fl_server.algorithms.btfl import BTFL, ClientArtifacts
from fl_server.data import load_dataset
from fl_server.engine import RunConfig, Simulation
from fl_server.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: lab/ is not installed
from lab.btgfl import COLUMNS, StreamConfig, _body_iterations, btfl_stream, build_data  # noqa: E402
from lab.experiments import EXPERIMENTS  # noqa: E402


@dataclass
class Streams:
    """Per-client streams over one pool of samples, with the pool's features and both heads' inputs."""

    streams: list[dict[str, np.ndarray]]  # per client: column -> indices into the pool, in stream order
    z: np.ndarray  # [N, D] features
    g: np.ndarray  # [N, C] global-head logits
    y: np.ndarray  # [N] labels
    is_ind: list[np.ndarray]  # per client: [N] bool, the sample is the client's own (IND)


def auroc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties counted 1/2."""
    r = rankdata(np.concatenate([pos, neg]))
    return float((r[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def raw_log_tau(art: ClientArtifacts, z: np.ndarray) -> np.ndarray:
    """log q_l - log q_g (Eq. 9 with the geometric mean of Sec. 4.4), before the entropy rectification."""
    codes = fsq_quantize(z)
    return dle_log_likelihood(codes, art.local_dle) - dle_log_likelihood(codes, art.global_dle)


def column_report(arts: list[ClientArtifacts], pool: Streams) -> dict[str, dict[str, float]]:
    """Method / statistic -> column -> mean over clients of ``pool``'s streams."""
    streams, z_all, g_all, y_all, is_ind = pool.streams, pool.z, pool.g, pool.y, pool.is_ind
    acc: dict[str, dict[str, list[float]]] = {}

    def add(key: str, col: str, v: float) -> None:
        acc.setdefault(key, {}).setdefault(col, []).append(float(v))

    for k, (art, s) in enumerate(zip(arts, streams)):
        for col, idx in s.items():
            z, g, y = z_all[idx], g_all[idx], y_all[idx]
            l_ = z @ art.local_head.T
            ind = is_ind[k][idx]
            pg, pl = np.exp(log_softmax(g)), np.exp(log_softmax(l_))
            out, e, _ = btfl_stream(art, g, l_, z, 32)
            o_the, w = fedthe_predict(g, l_, z, art.mu_local, art.mu_global, 32)
            o_nh, _ = fedthe_predict(g, l_, z, art.mu_local, art.mu_global, 32, history_decay=0.0, feature_mix=1.0)
            oracle = np.where(ind[:, None], pl, pg)  # Eq. 21 with e = 1[sample is EXD]
            for name, pred in (("FedAvg", g), ("FedAvg+FT", l_), ("FedTHE", o_the), ("FedTHE no history", o_nh),
                               ("BTFL", out), ("BTFL oracle e", oracle)):
                add(name, col, 100 * (pred.argmax(1) == y).mean())
            for part, m in (("IND", ind), ("EXD", ~ind)):
                if m.any():
                    add(f"BTFL e on {part}", col, e[m].mean())
                    add(f"FedTHE w_g on {part}", col, w[m, 0].mean())
        a, c = s.get("orig_ind", s.get("ind")), s.get("orig_exd", s.get("exd"))
        la, lc = (z_all[a] @ art.local_head.T, z_all[c] @ art.local_head.T)
        d = [np.linalg.norm(z_all[i] - art.mu_local, axis=1) - np.linalg.norm(z_all[i] - art.mu_global, axis=1)
             for i in (a, c)]
        add("AUROC raw log tau (Eq. 9)", "orig", auroc(-raw_log_tau(art, z_all[c]), -raw_log_tau(art, z_all[a])))
        add("AUROC log tau_hat (Eq. 15)", "orig", auroc(-btfl_stream(art, g_all[c], lc, z_all[c], 32)[2],
                                                        -btfl_stream(art, g_all[a], la, z_all[a], 32)[2]))
        add("AUROC FedTHE d_l - d_g", "orig", auroc(d[1], d[0]))
    return {key: {col: float(np.mean(v)) for col, v in cols.items()} for key, cols in acc.items()}


def print_report(title: str, rep: dict[str, dict[str, float]]) -> None:
    print(title)
    for key, cols in rep.items():
        avg = f"  avg {np.mean(list(cols.values())):6.2f}" if len(cols) == len(COLUMNS) else ""
        print(f"  {key:28s}" + " ".join(f"{c}={v:6.2f}" for c, v in cols.items()) + avg)


def mean_report(reports: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Entry-wise mean over seeds of :func:`column_report` results."""
    return {key: {col: float(np.mean([r[key][col] for r in reports])) for col in cols}
            for key, cols in reports[0].items()}


def load_seed(dataset_name: str, seed: int, runs: str, val: bool
              ) -> tuple[list[ClientArtifacts], Streams, Streams | None]:
    """(client artifacts, test streams, validation streams or None) of one finished seed; trains nothing."""
    protocol = EXPERIMENTS["btgfl"].protocols[dataset_name]
    dataset = load_dataset(protocol.dataset, split="all")
    data = build_data(dataset, protocol, seed, StreamConfig())
    model = build_model(protocol.model, dataset.x.shape[1:], dataset.num_classes, seed=seed)
    hyper = {**protocol.method_hp.get("BTFL", {}), "body_iterations": _body_iterations(protocol.local_iterations)}
    alg = BTFL(model, seed=seed, **hyper)
    run = RunConfig(rounds=protocol.rounds, local_iterations=protocol.local_iterations,
                    batch_size=protocol.batch_size, eval_every=protocol.eval_every, seed=seed, device="cpu",
                    out_dir=f"{runs}/bench/btgfl/{dataset_name}/seed{seed}", progress=False, checkpoint_every=5)
    sim = Simulation(alg, data.fed, run)
    if sim.run().rounds_done != protocol.rounds:
        raise SystemExit(f"the run of seed {seed} is not finished")
    params = sim.server_state["params"]
    arts = alg.client_artifacts(sim.server_state, sim.x, data.fed.train)

    def feats(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        with torch.no_grad():
            z = torch.cat([alg.features(params, x[s:s + 4096]) for s in range(0, len(x), 4096)])
            return z.double().numpy(), alg.global_head(params, z).double().numpy()

    z, g = feats(torch.from_numpy(data.x_test).to(sim.x.dtype))
    p = len(data.y_test) // 2
    is_ind = []
    for s in data.streams:
        own = np.zeros(len(data.y_test), dtype=bool)
        own[s["orig_ind"]] = own[s["orig_ind"] + p] = True
        is_ind.append(own)
    test = Streams(data.streams, z, g, data.y_test, is_ind)
    if not val:
        return arts, test, None
    val_idx = np.concatenate(data.fed.val)
    owner = np.repeat(np.arange(len(data.fed.val)), [len(v) for v in data.fed.val])
    zv, gv = feats(sim.x[torch.from_numpy(val_idx)])
    rng = np.random.default_rng([seed, 99])
    vstreams = []
    for k in range(len(data.fed.val)):
        ind = rng.permutation(np.flatnonzero(owner == k))
        exd = rng.choice(np.flatnonzero(owner != k), size=len(ind), replace=False)
        h = len(ind) // 2
        vstreams.append({"ind": ind, "exd": exd, "mix": rng.permutation(np.concatenate([ind[:h], exd[:h]]))})
    return arts, test, Streams(vstreams, zv, gv, dataset.y[val_idx], [owner == k for k in range(len(vstreams))])


def seed_reports(dataset_name: str, seed: int, runs: str, val: bool
                 ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]] | None]:
    """(test report, validation report or None) of one finished seed."""
    arts, test, vals = load_seed(dataset_name, seed, runs, val)
    return column_report(arts, test), None if vals is None else column_report(arts, vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("seeds", type=int, nargs="+")
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--val", action="store_true", help="also report the validation streams")
    a = ap.parse_args()
    tests, vals = [], []
    for seed in a.seeds:
        test, val = seed_reports(a.dataset, seed, a.runs, a.val)
        print_report(f"== {a.dataset} seed {seed}: TEST columns (diagnostic only)", test)
        tests.append(test)
        if val is not None:
            print_report(f"== {a.dataset} seed {seed}: VALIDATION streams (held-out train split)", val)
            vals.append(val)
    if len(a.seeds) > 1:
        print_report(f"== {a.dataset} mean over seeds {a.seeds}: TEST columns (diagnostic only)", mean_report(tests))
        if vals:
            print_report(f"== {a.dataset} mean over seeds {a.seeds}: VALIDATION streams", mean_report(vals))


if __name__ == "__main__":
    main()
