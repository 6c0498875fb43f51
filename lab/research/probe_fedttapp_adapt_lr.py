"""Does FedTTA++'s base model need FedTTA's eta_adapt? Train FedTTA++ on the UPFL Table-1 MNIST protocol with
other (eta_adapt, mu) pairs and print each run's best VALIDATION accuracy (docs/research/fedttapp-diagnosis.md).

Why: with Table 4's FedTTA-Prox rates (eta_adapt 0.001, mu 0.01) the trained base model psi alone scores
28-57% on new clients and the early-stopping rule follows falling entropy into falling accuracy, while FedTTA's
models (eta_adapt 0.01, mu 0) score 92-94% un-adapted (docs/results/fedttaprox-step-probe-test.json). UPFL App. C
searched eta_adapt and mu per method, so both are hyperparameters to choose on validation; the test accuracy
at the best validation round is recorded in the run's record but must not be used to choose.

    python lab/research/probe_fedttapp_adapt_lr.py --seeds 0 --adapt-lr 0.01 --mu 0.01 [--device cpu]
        (run dirs: runs/probe/fedttapp-adapt-lr/<eta_adapt>-<mu>/seed<k>, resumable; one JSON line per run)
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "edge_sdk")]
from lab.experiments import get_experiment  # noqa: E402
from lab.runner import run_seed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--adapt-lr", type=float, nargs="+", default=[0.01])
    ap.add_argument("--mu", type=float, default=0.01)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", default="runs/probe/fedttapp-adapt-lr")
    args = ap.parse_args()
    base = get_experiment("upfl-table1").protocols["mnist"]
    for adapt_lr in args.adapt_lr:
        hp = {**base.method_hp["FedTTA++"], "adapt_lr": adapt_lr, "mu": args.mu}
        protocol = replace(base, method_hp={**base.method_hp, "FedTTA++": hp})
        for seed in args.seeds:
            run_dir = Path(args.runs) / f"{adapt_lr:g}-{args.mu:g}" / f"seed{seed}"
            rec = run_seed(protocol, "FedTTA++", seed, run_dir, args.device, "auto", False)
            print(json.dumps({"what": f"FedTTA++ mnist seed {seed}: eta_adapt {adapt_lr:g}, mu {args.mu:g}",
                              "metric": "best val accuracy %", "value": round(rec["val"], 2),
                              "best_round": rec["best_round"], "hyper": hp, "device": rec["device"],
                              "wall_s": rec["wall_s"],
                              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv)}), flush=True)


if __name__ == "__main__":
    main()
