"""Shared by the benchmarks that measure finished run directories (run.json + best.npz)."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from fl_server.bench.rows import merge_rows
from fl_server.data import load_dataset
from fl_server.data.federated import FederatedData, make_federated


def run_clients(run_dir: Path, data_dir: str | None) -> tuple[dict[str, Any], FederatedData]:
    """The run's description and its federated data, rebuilt from the protocol and seed in run.json."""
    run = json.loads((run_dir / "run.json").read_text())
    proto = run["protocol"]
    ds = load_dataset(run["dataset"], root=data_dir, split="all")
    fed = make_federated(ds, proto["partition"], proto["num_clients"], proto["new_fraction"], proto["val_fraction"],
                         seed=run["seed"], alpha=proto["alpha"])
    return run, fed


def measure_runs(doc: str | None, script: str, measure: Callable[[Path, str | None, Path, str], dict],
                 describe: Callable[[dict], str]) -> int:
    """CLI: ``RUN_DIR ... [--data-dir] [--out]``; one row per run merged into --out, one line printed per row."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="docs/benchmarks/edge-sdk.json")
    args = ap.parse_args()
    command = f"python benchmarks/{script} " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(Path(r), args.data_dir, Path(tmp), command) for r in args.runs]
    merge_rows(args.out, rows)
    for r in rows:
        print(f"{r['what']}: {describe(r)}")
    return 0
