"""The FedTTA family's shared meta-training under other settings, scored on VALIDATION only: the gap-to-the-paper
study of docs/research/fedttapp-diagnosis.md (more rounds, a larger eta_outer, FedTTA++'s eta_adapt).

The UPFL Table-1 protocol of ``--dataset`` trains ``--method`` at ``--seed`` with the protocol's rates overridden by
``--set KEY=VALUE`` (JSON values: ``lr`` is eta_outer, ``inner_lr`` eta_inner, ``adapt_lr`` eta_adapt) and
``--rounds``. The new clients are removed from the federation before the run, so their data is never touched and no
setting can be chosen on them; everything else (the training clients, their validation splits, client sampling and
mini-batches) is the table row's, so at the protocol's own settings a probe run's validation curve is the row's.
Each run has its own resumable folder (``RUNS/probe-family/<dataset>/<method>/<setting>/seed<k>``; a run cut off at
a lease's end resumes there) and one row in ``RESULTS/fedtta-family-gap-probe.json`` (merged by ``what``): best
validation accuracy, its round, the curve, and the table row's validation at the same seed where there is one. In a
GPU lease a row of lab/research/device_rows.tsv runs it (``gap-*``; gpu_engine_session.sh).

    python lab/research/probe_family_training.py --method FedTTA++ --seed 0 --set lr=0.2 --device cuda
    python lab/research/probe_family_training.py --method FedTTA --seed 0 --rounds 500 --device cuda
    python lab/research/probe_family_training.py --method FedTTA++ --seed 0 --set adapt_lr=0.01 --quick  # smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "edge_sdk")]  # lab/ is not installed
from fl_server.torch_device import describe  # noqa: E402
from lab.experiments import get_experiment  # noqa: E402
from lab.protocol import Protocol  # noqa: E402
from lab.rows import merge_rows  # noqa: E402
from lab.runner import build_federated, build_simulation, raw_path, safe_name  # noqa: E402

FAMILY = ("FedTTA", "FedTTA-Prox", "FedTTA++")
OUT_NAME = "fedtta-family-gap-probe.json"
DONE = "probe-row.json"  # written into a finished run's folder


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """``["lr=0.2", "patience=5"]`` -> {"lr": 0.2, "patience": 5} (JSON values, else the string)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def setting_label(changes: dict[str, Any], rounds: int | None) -> str:
    """"lr=0.2, rounds=500"; "protocol" when nothing is changed."""
    parts = [f"{k}={v}" for k, v in sorted(changes.items())] + ([f"rounds={rounds}"] if rounds else [])
    return ", ".join(parts) or "protocol"


def probe_protocol(base: Protocol, method: str, changes: dict[str, Any], rounds: int | None) -> Protocol:
    """``base`` with ``method``'s hyperparameters updated by ``changes`` and its round budget set to ``rounds``."""
    protocol = dataclasses.replace(base, method_hp={**base.method_hp,
                                                    method: {**base.method_hp.get(method, {}), **changes}})
    if rounds:
        protocol = dataclasses.replace(protocol, rounds=rounds,
                                       method_rounds={k: v for k, v in protocol.method_rounds.items() if k != method})
    return protocol


def fill_table_val(row: dict[str, Any], results: Path) -> dict[str, Any]:
    """``row`` with its ``table_val`` read from ``results`` where it is missing (not for a --quick row)."""
    if row.get("table_val") is not None or row["what"].endswith("(--quick)"):
        return row
    return {**row, "table_val": table_val(results, row["dataset"], row["method"], row["seed"])}


def table_val(results: Path, dataset: str, method: str, seed: int) -> float | None:
    """The committed table row's validation accuracy at ``seed`` (docs/results/raw/upfl-table1), if present."""
    path = raw_path(results, "upfl-table1", dataset, method, seed)
    return json.loads(path.read_text())["val"] if path.exists() else None


def parser() -> argparse.ArgumentParser:
    """The probe's command line (lab/tests/test_device_rows.py checks the lease rows with it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", required=True, choices=FAMILY)
    ap.add_argument("--dataset", default="fashion_mnist")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override one of the method's hyperparameters (repeatable)")
    ap.add_argument("--rounds", type=int, help="the round budget (default: the protocol's)")
    ap.add_argument("--quick", action="store_true", help="the protocol's CI size (a smoke test, not a result)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--mode", default="auto", choices=("auto", "vmap", "loop"))
    ap.add_argument("--runs-dir", type=Path, default=Path("runs/probe"))
    ap.add_argument("--results-dir", type=Path, help="default: docs/results (runs/quick/results with --quick)")
    ap.add_argument("--table-results", type=Path, default=REPO / "docs" / "results",
                    help="where the table's raw records are read from (its validation at the same seed; a lease "
                         "call has them aside, and merge_device_results.py fills it in)")
    ap.add_argument("--data-dir")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    base = get_experiment("upfl-table1").protocols[args.dataset]
    changes = parse_sets(args.sets)
    protocol = probe_protocol(base.quick() if args.quick else base, args.method, changes, args.rounds)
    label = setting_label(changes, args.rounds)
    fed = build_federated(protocol, args.seed, args.data_dir)
    fed = dataclasses.replace(fed, new=[])  # validation only: the new clients never enter the run
    results = args.results_dir or Path("runs/quick/results" if args.quick else "docs/results")
    setting = safe_name(label).replace(",", "") + ("-quick" if args.quick else "")  # a smoke run is another run
    run = f"probe-family/{args.dataset}/{safe_name(args.method)}/{setting}/seed{args.seed}"
    run_dir = args.runs_dir / run
    sim = build_simulation(protocol, args.method, args.seed, run_dir, args.device, args.mode, not args.no_progress,
                           args.data_dir, fed)
    result = sim.run()
    what = f"{args.method} {args.dataset} seed {args.seed}: {label}" + (" (--quick)" if args.quick else "")
    row = {"what": what, "method": args.method, "dataset": args.dataset, "seed": args.seed, "setting": label,
           "metric": "best validation accuracy %", "value": round(100 * result.best_val, 2),
           "best_round": result.best_round, "rounds": protocol.rounds_for(args.method),
           "table_val": None if args.quick else table_val(args.table_results, args.dataset, args.method, args.seed),
           "curve": [{"round": r["round"], "val": round(100 * r["val"], 2)} for r in result.history if "val" in r],
           "hyper": sim.algorithm.hp.__dict__, "device": describe(sim.device), "wall_s": round(result.wall_s, 1),
           "run": run,  # the run folder under --runs-dir (a lease keeps its checkpoint until this row lands)
           "command": "python lab/research/probe_family_training.py "
                      + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
                                 if a not in ("--no-progress",))}
    merge_rows(results / OUT_NAME, [row], key=("what",))
    (run_dir / DONE).write_text(json.dumps(row, indent=1))  # finished: the lease script packs no checkpoint of it
    print(json.dumps({k: v for k, v in row.items() if k not in ("curve", "hyper")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
