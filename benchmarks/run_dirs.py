"""Shared by the benchmarks that measure finished run directories (run.json + best.npz)."""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from fl_server import rundir
from fl_server.data.federated import FederatedData
from fl_server.recipes.run import client_data

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.rows import merge_rows  # noqa: E402


def run_clients(run_dir: Path, data_dir: str | None) -> tuple[dict[str, Any], FederatedData]:
    """The run's description and its federated data, rebuilt from run.json by the recipe layer (the one
    place that partitions: a run of a built-in data set, a bench protocol or a recipe file)."""
    run = rundir.read_run(run_dir)
    return run, client_data(run, data_dir)


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
