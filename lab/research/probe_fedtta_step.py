"""Diagnostic: does FedTTA's test-time step depend on the size of the adaptation set?

A new client adapts on its full unlabeled set (N = 700 on the Table-1 protocol) while meta-training only ever
took steps on batches of B = 64; the paper's loss ||g(Z)||_2 grows like sqrt(N), so the full-set step is about
sqrt(N/B) = 3.3 times larger than any step seen in training. This probe decides the remedy on *validation*:
each training client adapts on its whole local set (train + val, N ~ 700, used unlabeled, like a new client)
and is scored on its validation labels only. The new clients' test split is never touched.

    python lab/research/probe_fedtta_step.py runs/bench/upfl-table1/mnist/FedTTApp/seed0/best.npz \
        --method FedTTA++ --dataset mnist --seed 0
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from fl_server.algorithms import build_algorithm
from fl_server.engine.simulation import load_state
from fl_server.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: lab/ is not installed
from lab.experiments import get_experiment  # noqa: E402
from lab.rows import merge_rows  # noqa: E402
from lab.runner import build_federated  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--method", default="FedTTA")
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/fedtta-loss-probe.json", help="rows merged by (method, variant)")
    args = ap.parse_args()
    torch.set_grad_enabled(True)
    protocol = get_experiment("upfl-table1").protocols[args.dataset]
    fed = build_federated(protocol, args.seed)
    model = build_model(protocol.model, fed.dataset.x.shape[1:], 10, seed=args.seed)
    hp = protocol.method_hp[args.method]
    variants = {"paper ||g||_2 (raw)": None, f"sqrt(B mean g^2), B={protocol.batch_size}": protocol.batch_size}
    state = load_state(args.checkpoint)
    x_all, y_all = torch.from_numpy(fed.dataset.x), torch.from_numpy(fed.dataset.y)
    sizes = [len(t) + len(v) for t, v in zip(fed.train, fed.val)]
    print(f"{args.method} {args.dataset} seed {args.seed}: {len(sizes)} training clients, adaptation set N = "
          f"{min(sizes)}..{max(sizes)}, scored on the validation labels")
    command = "python lab/research/probe_fedtta_step.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows = []
    for name, loss_batch in variants.items():
        alg = build_algorithm(args.method, model, fed.num_train_clients, seed=args.seed, **{**hp, "loss_batch": loss_batch})
        accs, none = [], []
        for tr, va in zip(fed.train, fed.val):
            x = x_all[np.concatenate([tr, va])]
            new = alg.personalize(state, x)
            with torch.no_grad():
                pred = alg.forward(new, x_all[va]).argmax(-1)
                pred0 = alg.forward(state["params"], x_all[va]).argmax(-1)
            accs.append(float((pred == y_all[va]).float().mean()))
            none.append(float((pred0 == y_all[va]).float().mean()))
        print(f"  {name:>28}: {100 * np.mean(accs):.2f}%   (no adaptation: {100 * np.mean(none):.2f}%)")
        rows.append({"what": f"{args.method} {args.dataset} seed {args.seed}: {name}", "metric": "val accuracy %",
                     "value": round(100 * float(np.mean(accs)), 2),
                     "dataset": args.dataset, "method": args.method,
                     "seed": args.seed, "variant": name, "loss_batch": loss_batch,
                     "accuracy_no_adaptation": round(100 * float(np.mean(none)), 2),
                     "adaptation_set": f"each training client's train+val ({min(sizes)}..{max(sizes)} samples), unlabeled",
                     "checkpoint": args.checkpoint, "device": "cpu", "command": command})
    merge_rows(args.out, rows, key=("dataset", "method", "seed", "variant"))


if __name__ == "__main__":
    main()
