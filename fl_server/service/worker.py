"""One training job in its own process: ``python -m fl_server.service.worker JOB_DIR``.

Reads ``JOB_DIR/spec.json``, trains with the results harness (:func:`fl_server.bench.runner.run_seed`) in the
resumable run directory ``JOB_DIR/run`` (metrics.jsonl is the progress the coordinator reads), then exports
the best-validation model to ``JOB_DIR/bundle`` (atomic). Server-only state (ODPFL-HN's hypernetwork theta)
goes to ``JOB_DIR/server/hn.npz``. A killed worker is simply started again and resumes from its checkpoint
(written every round for coordinator jobs).

A worker dies with its coordinator (Linux: ``PR_SET_PDEATHSIG``), and holds an exclusive lock on
``JOB_DIR/worker.lock`` while it runs, so a restarted coordinator's worker can never train the same run
directory at the same time as an orphan of the old one (it waits for the lock instead).
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import IO

import numpy as np

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def guard(job_dir: Path) -> IO[str]:
    """Die with the coordinator and hold the job's lock; returns the lock file (keep it open)."""
    parent = int(os.environ.get("FL_COORDINATOR_PID", "0"))
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent and os.getppid() != parent:  # the coordinator died before the signal was armed
        sys.exit(3)
    lock = open(job_dir / "worker.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)  # an orphaned worker of this job still running: wait for it
    (job_dir / "worker.pid").write_text(f"{os.getpid()}\n")
    return lock


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
    ckpt = run_dir / "checkpoint.json"
    done = json.loads(ckpt.read_text())["rounds_done"] if ckpt.is_file() else 0
    print(f"worker {os.getpid()}: training from round {done} of {protocol.rounds}", flush=True)
    run_seed(protocol, spec["method"], int(spec.get("seed", 0)), run_dir, device=spec.get("device", "auto"),
             progress=False, data_root=spec.get("data_dir"), test_at_best_only=True,
             checkpoint_every=int(spec.get("checkpoint_every", 1)))
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
        lock = guard(Path(argv[0]))
        run_job(Path(argv[0]))
        lock.close()
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
