"""Why is FedTTA++ seed-sensitive? Trace its entropy early stopping on a finished run.

For every client of a run directory (run.json + best.npz of a FedTTA / FedTTA-Prox / FedTTA++ run), on the
training clients' validation sets (``--split val``, for decisions) or the new clients (``--split test``,
diagnosis only), iterate the adaptation step of UPFL Eq. 5 for ``max_steps`` steps and record, per step, the
mean prediction entropy and the accuracy. Reports the accuracy of the iterate that FedTTA++'s rule picks
(lowest entropy until ``patience`` steps without a decrease), the same rule started at the one-step model
(iterate 1) instead of the un-adapted one, of fixed step counts, of the lowest-entropy
iterate over all steps (no early stop), and of the per-client best iterate (oracle), plus where the rule
stops. Nothing here is used to choose a hyperparameter on the test split.

    python lab/research/probe_fedttapp_stopping.py RUN_DIR [RUN_DIR ...] [--split val|test] [--patience 1 5]
        [--max-steps 50] [--out docs/results/fedttapp-stopping-probe.json]
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "edge_sdk"), str(REPO / "benchmarks")]
from edge_sdk import EntropyEarlyStopping  # noqa: E402
from fl_server.algorithms import build_algorithm  # noqa: E402
from fl_server.algorithms.losses import entropy_from_logits  # noqa: E402
from fl_server.engine.simulation import load_state  # noqa: E402
from fl_server.models import build_model  # noqa: E402
from run_dirs import run_clients  # noqa: E402


def trajectories(run_dir: Path, split: str, max_steps: int, data_dir: str | None) -> dict[str, np.ndarray]:
    """Per client: entropy [S+1] and accuracy [S+1] of iterates 0 (un-adapted) .. S of Eq. 5."""
    run, fed = run_clients(run_dir, data_dir)
    model = build_model(run["model"], tuple(run["input_shape"]), run["num_classes"], seed=run["seed"])
    algo = build_algorithm(run["method"], model, 1, seed=run["seed"], **run["hyper"])
    state = {k: {n: v.float() for n, v in d.items()} for k, d in load_state(run_dir / "best.npz").items()}
    clients = fed.new if split == "test" else fed.val
    ent = np.zeros((len(clients), max_steps + 1))
    acc = np.zeros_like(ent)
    for c, idx in enumerate(clients):
        x, y = torch.from_numpy(fed.dataset.x[idx]), fed.dataset.y[idx]
        psi = state["params"]
        for s in range(max_steps + 1):
            if s:
                psi = {k: v.detach() for k, v in algo.adapt_step(psi, state["phi"], x).items()}
            with torch.no_grad():
                logits = algo.forward(psi, x)
            ent[c, s] = float(entropy_from_logits(logits).mean())
            acc[c, s] = float((logits.argmax(-1).numpy() == y).mean())
    return {"entropy": ent, "accuracy": acc}


def stop_step(entropy: np.ndarray, patience: int, first: int = 0) -> int:
    """The iterate FedTTA++ returns for this entropy trace (the shared rule, edge_sdk.EntropyEarlyStopping);
    ``first`` = 1: candidates start at the one-step model."""
    stopper = EntropyEarlyStopping(patience, len(entropy) - 1, first)
    for h in entropy:
        if stopper.update(float(h)):
            break
    return stopper.best_step


def summarize(tr: dict[str, np.ndarray], patience: list[int]) -> dict[str, Any]:
    ent, acc = tr["entropy"], tr["accuracy"]
    rows = np.arange(len(acc))
    out: dict[str, Any] = {f"step_{s}": round(100 * float(acc[:, s].mean()), 2)
                           for s in (0, 1, 5, 10, 20, acc.shape[1] - 1) if s < acc.shape[1]}
    out["lowest_entropy_any_step"] = round(100 * float(acc[rows, ent.argmin(1)].mean()), 2)
    out["oracle_best_step"] = round(100 * float(acc.max(1).mean()), 2)
    for p in patience:
        picks = np.array([stop_step(e, p) for e in ent])
        out[f"patience_{p}"] = round(100 * float(acc[rows, picks].mean()), 2)
        out[f"patience_{p}_stop_steps_p10_p50_p90"] = [int(v) for v in np.percentile(picks, [10, 50, 90])]
        out[f"patience_{p}_clients_kept_at_step_0"] = int((picks == 0).sum())
        from_one = np.array([stop_step(e, p, first=1) for e in ent])
        out[f"patience_{p}_from_step_1"] = round(100 * float(acc[rows, from_one].mean()), 2)
    # entropy not monotone in the first steps: how many clients see a rise right after step 0 or 1
    out["clients_entropy_rises_at_step_1"] = int((ent[:, 1] >= ent[:, 0]).sum())
    out["clients"] = len(acc)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--split", choices=("val", "test"), default="val")
    ap.add_argument("--patience", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--max-steps", type=int, default=50)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=None, help="JSON rows (default: print only)")
    args = ap.parse_args()
    command = "python lab/research/probe_fedttapp_stopping.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows = []
    for r in args.runs:
        run = json.loads((Path(r) / "run.json").read_text())
        s = summarize(trajectories(Path(r), args.split, args.max_steps, args.data_dir), args.patience)
        rows.append({"what": f"{run['method']} {run['dataset']} seed {run['seed']}: early stopping trace",
                     "split": args.split, "metric": "mean client accuracy % by adaptation rule", **s,
                     "run": r, "device": "cpu", "command": command})
        print(json.dumps(rows[-1]))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
