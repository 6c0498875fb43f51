"""One training job in its own process: ``python -m fl_server.service.worker JOB_DIR``.

Reads ``JOB_DIR/spec.json``, trains with the results harness (:func:`fl_server.bench.runner.run_seed`) in the
resumable run directory ``JOB_DIR/run`` (metrics.jsonl is the progress the coordinator reads), then exports
the best-validation model to ``JOB_DIR/bundle`` (atomic). Server-only state (ODPFL-HN's hypernetwork theta)
goes to ``JOB_DIR/server/hn.npz``. A killed worker is simply started again and resumes from its checkpoint.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np


def run_job(job_dir: Path) -> None:
    import torch

    from export.run import export_run
    from fl_server.bench.experiments import get_experiment
    from fl_server.bench.runner import run_seed

    spec = json.loads((job_dir / "spec.json").read_text())
    torch.set_num_threads(int(spec.get("threads", 1)))
    base = get_experiment("upfl-table1").protocols[spec["dataset"]]
    changes = {k: spec[k] for k in ("rounds", "num_clients", "partition", "alpha") if spec.get(k) is not None}
    protocol = replace(base, **changes)
    run_dir = job_dir / "run"
    run_seed(protocol, spec["method"], int(spec.get("seed", 0)), run_dir, device=spec.get("device", "auto"),
             progress=False, data_root=spec.get("data_dir"), test_at_best_only=True)
    export_run(run_dir, job_dir / "bundle", data_root=spec.get("data_dir"))
    with np.load(run_dir / "best.npz", allow_pickle=False) as arrays:
        hn = {k[len("hn/"):]: arrays[k] for k in arrays.files if k.startswith("hn/")}
    if hn:
        (job_dir / "server").mkdir(exist_ok=True)
        tmp = job_dir / "server" / "hn.tmp.npz"
        np.savez(tmp, **hn)
        os.replace(tmp, job_dir / "server" / "hn.npz")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m fl_server.service.worker JOB_DIR", file=sys.stderr)
        return 2
    try:
        run_job(Path(argv[0]))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
