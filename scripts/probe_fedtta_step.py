"""Diagnostic for issue 3: does FedTTA's one-step adaptation depend on the size of the adaptation batch?

Loads a trained FedTTA checkpoint (best.npz of a `fl-server bench upfl-table1 --methods FedTTA` run) and adapts
on each *training* client's own training data used unlabeled (never the new clients' test split): no
adaptation, one full-batch step, one step per batch of 64, and a full-batch step scaled by sqrt(64/N).

    python scripts/probe_fedtta_step.py runs/bench/upfl-table1/mnist/FedTTA/seed0/best.npz --dataset mnist --seed 0
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from fl_server.algorithms import build_algorithm
from fl_server.bench.experiments import get_experiment
from fl_server.bench.runner import build_federated
from fl_server.engine.simulation import load_state
from fl_server.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    protocol = get_experiment("upfl-table1").protocols[args.dataset]
    fed = build_federated(protocol, args.seed)
    alg = build_algorithm("FedTTA", build_model(protocol.model, fed.dataset.x.shape[1:], 10, seed=args.seed),
                          fed.num_train_clients, seed=args.seed, **protocol.method_hp["FedTTA"])
    state = load_state(args.checkpoint)
    x_all, y_all = torch.from_numpy(fed.dataset.x), torch.from_numpy(fed.dataset.y)
    psi, phi, b = state["params"], state["phi"], args.batch

    def predict(p, x):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return alg.forward(p, x).argmax(-1)

    res: dict[str, list[float]] = {"none": [], "full batch": [], f"batches of {b}": [], "full, sqrt-scaled": []}
    for idx in fed.train:
        x, y = x_all[idx], y_all[idx]
        res["none"].append(float((predict(psi, x) == y).float().mean()))
        res["full batch"].append(float((predict(alg.adapt_step(psi, phi, x), x) == y).float().mean()))
        per_batch = torch.cat([predict(alg.adapt_step(psi, phi, x[s:s + b]), x[s:s + b]) for s in range(0, len(x), b)])
        res[f"batches of {b}"].append(float((per_batch == y).float().mean()))
        g = torch.func.grad(alg.personalization_loss)(psi, phi, x)
        scaled = {k: v - alg.hp.inner_lr * (b / len(x)) ** 0.5 * g[k] for k, v in psi.items()}
        res["full, sqrt-scaled"].append(float((predict(scaled, x) == y).float().mean()))
    for name, accs in res.items():
        print(f"{name:>20}: {100 * np.mean(accs):.2f}% (mean over {len(accs)} training clients)")


if __name__ == "__main__":
    main()
