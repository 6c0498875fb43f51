"""Per-client accuracies behind an ``odpfl-dirichlet`` row: FedAvg's global model and ODPFL-HN's served model
on each new client and each validation client, from the best-validation checkpoints (``best.npz``) that
``python -m lab bench odpfl-dirichlet`` left in its run directories. With 10 new clients at Dir(0.1) the clients'
label mixes differ a lot, so the 10-client mean of either method moves by several points with which clients
happen to be new; this shows how the two methods' wins and losses are spread over the clients.

    python lab/research/odpfl_client_breakdown.py --dataset fashion_mnist-a0.1 --seed 0 --runs-dir runs
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from fl_server.torch_device import describe
from fl_server.engine.simulation import load_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: lab/ is not installed
from lab.experiments import get_experiment  # noqa: E402
from lab.rows import merge_rows  # noqa: E402
from lab.runner import build_federated, build_simulation, safe_name  # noqa: E402

METHODS = ("FedAvg", "ODPFL-HN")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="fashion_mnist-a0.1", help="odpfl-dirichlet protocol key")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs-dir", default="runs", help="the --runs-dir of the bench run")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="docs/results/odpfl-client-breakdown.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    protocol = get_experiment("odpfl-dirichlet").protocols[args.dataset]
    fed = build_federated(protocol, args.seed, args.data_dir)
    per_method: dict[str, dict[str, list[float]]] = {}
    for method in METHODS:
        best = Path(args.runs_dir) / "odpfl-dirichlet" / args.dataset / safe_name(method) / f"seed{args.seed}" / "best.npz"
        if not best.exists():
            sys.exit(f"{best} is missing: run `python -m lab bench odpfl-dirichlet --dataset {args.dataset} "
                     f"--seed {args.seed} --runs-dir {args.runs_dir}` first")
        sim = build_simulation(protocol, method, args.seed, None, device="cpu", progress=False,
                               data_root=args.data_dir, fed=fed)
        state = load_state(best, sim.device)
        per_method[method] = {group: [round(100 * a, 2) for a in sim.personalized_accuracies(clients, state)]
                              for group, clients in (("new", fed.new), ("validation", fed.val_clients))}
        if method == "ODPFL-HN":  # the same hypernetwork without personalisation: one model for every client
            alg = sim.algorithm
            emb = alg.embed_clients(state["enc"], np.arange(fed.num_train_clients))
            mean_model = alg.generate(state["hn"], emb.mean(0))
            per_method["ODPFL-HN mean embedding"] = {
                group: [round(100 * sim.accuracy(mean_model, c), 2) for c in clients]
                for group, clients in (("new", fed.new), ("validation", fed.val_clients))}
    command = "python lab/research/odpfl_client_breakdown.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows = []
    for group, clients in (("new", fed.new), ("validation", fed.val_clients)):
        fedavg, odpfl = (np.array(per_method[m][group]) for m in METHODS)
        rows.append({
            "what": f"odpfl-dirichlet {args.dataset} seed {args.seed}: {group} clients, ODPFL-HN minus FedAvg",
            "metric": "mean accuracy difference (points)", "value": round(float(np.mean(odpfl - fedavg)), 2),
            "dataset": args.dataset, "seed": args.seed, "clients": group,
            "odpfl_hn_wins": int(np.sum(odpfl > fedavg)), "fedavg_wins": int(np.sum(fedavg > odpfl)),
            "fedavg_per_client": fedavg.tolist(), "odpfl_hn_per_client": odpfl.tolist(),
            "odpfl_hn_mean_embedding_per_client": per_method["ODPFL-HN mean embedding"][group],
            "odpfl_hn_personalisation_gain": round(float(np.mean(
                odpfl - np.array(per_method["ODPFL-HN mean embedding"][group]))), 2),
            "largest_class_share": [round(float(np.bincount(fed.dataset.y[c]).max() / len(c)), 2) for c in clients],
            "client_sizes": [len(c) for c in clients], "device": describe(torch.device("cpu")), "command": command,
        })
        print(f"{group}: ODPFL-HN - FedAvg = {rows[-1]['value']:+.2f} points "
              f"(ODPFL-HN better on {rows[-1]['odpfl_hn_wins']} of {len(clients)} clients); own embedding - "
              f"mean embedding = {rows[-1]['odpfl_hn_personalisation_gain']:+.2f}")
    merged = merge_rows(args.out, rows, key=("dataset", "seed", "clients"))
    merge_rows(args.out, pooled_over_seeds(merged, args.dataset, command), key=("dataset", "seed", "clients"))


def pooled_over_seeds(rows: list[dict], dataset: str, command: str) -> list[dict]:
    """One row per client group with the per-seed rows of ``dataset`` pooled: the mean and std over seeds of
    the 10-client mean difference (the quantity the criterion compares) and the wins over all clients."""
    pooled = []
    for group in ("new", "validation"):
        per_seed = sorted((r for r in rows if r["dataset"] == dataset and r["clients"] == group
                           and isinstance(r["seed"], int)), key=lambda r: r["seed"])
        if len(per_seed) < 2:
            continue
        diffs = np.array([r["value"] for r in per_seed])
        pooled.append({
            "what": f"odpfl-dirichlet {dataset} seeds {[r['seed'] for r in per_seed]}: {group} clients, "
                    f"ODPFL-HN minus FedAvg",
            "metric": "mean over seeds of the mean accuracy difference (points)",
            "value": round(float(diffs.mean()), 2), "std_over_seeds": round(float(diffs.std()), 2),
            "per_seed": diffs.tolist(), "dataset": dataset, "seed": "pooled", "clients": group,
            "odpfl_hn_wins": sum(r["odpfl_hn_wins"] for r in per_seed),
            "fedavg_wins": sum(r["fedavg_wins"] for r in per_seed),
            "clients_total": sum(len(r["fedavg_per_client"]) for r in per_seed),
            "device": per_seed[-1]["device"], "command": command + " (pooled over the seeds already in the file)",
        })
        print(f"{group}, {len(per_seed)} seeds: ODPFL-HN - FedAvg = {diffs.mean():+.2f} +- {diffs.std():.2f} points")
    return pooled


if __name__ == "__main__":
    main()
