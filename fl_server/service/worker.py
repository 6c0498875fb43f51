"""One training job in its own process: ``python -m fl_server.service.worker JOB_DIR``.

Reads ``JOB_DIR/spec.json``, trains its recipe (:func:`job_recipe`, :func:`fl_server.recipes.train`) in the
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
import dataclasses
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # the recipes (torch) load after guard() has armed the death signal
    from fl_server.recipes import Recipe

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


def job_recipe(spec: dict[str, Any]) -> Recipe:
    """The job's recipe: ``spec["recipe"]`` (``FILE.py[:NAME]`` in the operator's recipe directory, resolved by
    the coordinator) with the method, rounds, clients, partition and alpha the request set (the rest is the
    recipe's own), or the built-in recipe of ``spec["dataset"]`` with the request's."""
    from fl_server.recipes import RecipeError, load_recipe
    from fl_server.recipes.presets import builtin_recipe
    from fl_server.recipes.recipe import refuse_idle_overrides
    from fl_server.service.config import served_methods

    fed_changes = {k: spec[k] for k in ("num_clients", "partition", "alpha") if spec.get(k) is not None}
    if spec.get("recipe"):
        recipe = load_recipe(spec["recipe"], registered_only=True)  # no other function of the file is called
        method, served = spec.get("method") or recipe.method, served_methods()
        if method not in served:
            raise RecipeError(f"the recipe's method {method} is not served by the coordinator; name one of "
                              f"{', '.join(served)} in the job's method")
        federation = dataclasses.replace(recipe.federation, **fed_changes) if fed_changes else recipe.federation
        return refuse_idle_overrides(recipe.replace(
            method=method, rounds=int(spec.get("rounds") or recipe.rounds), federation=federation,
            hyper=recipe.hyper if recipe.method == method else {}), fed_changes)
    changes = {**fed_changes, **({"rounds": spec["rounds"]} if spec.get("rounds") is not None else {})}
    return refuse_idle_overrides(builtin_recipe(spec["dataset"], spec["method"], spec.get("data_dir"), **changes),
                                 fed_changes)


def run_job(job_dir: Path) -> None:
    import torch

    from fl_server import rundir
    from fl_server.algorithms import ALGORITHMS
    from fl_server.atomic import atomic_write_npz
    from fl_server.export.device_scores import labeled_score, own_bundle
    from fl_server.export.run import export_run
    from fl_server.recipes import train

    spec = json.loads((job_dir / "spec.json").read_text())
    torch.set_num_threads(int(spec.get("threads", 1)))
    recipe = job_recipe(spec)
    run_dir = job_dir / "run"
    print(f"worker {os.getpid()}: training from round {rundir.rounds_done(run_dir)} of {recipe.rounds}", flush=True)
    train(recipe, run_dir, seed=int(spec.get("seed", 0)), device=spec.get("device", "auto"), progress=False,
          data_root=spec.get("data_dir"), test_at_best_only=True, checkpoint_every=int(spec.get("checkpoint_every", 1)))
    bundle = export_run(run_dir, job_dir / "bundle", data_root=spec.get("data_dir"))
    if ALGORITHMS[recipe.method].device_labels:  # what training cannot score: a device's labeled personalisation
        try:
            score = labeled_score(own_bundle(bundle), spec.get("data_dir"), recipe)["personalised"]
        except ValueError as exc:  # e.g. images of several sizes: no sample set to hand a device; the job stands
            print(f"worker {os.getpid()}: a device's labeled personalisation not measured ({exc})", flush=True)
        else:
            rundir.write_run(run_dir, {**rundir.read_run(run_dir), "labeled_device_accuracy": score})
    hn = rundir.best_arrays(run_dir, "hn")
    if hn:
        (job_dir / "server").mkdir(exist_ok=True)
        atomic_write_npz(job_dir / "server" / "hn.npz", hn)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m fl_server.service.worker JOB_DIR", file=sys.stderr)
        return 2
    try:
        lock = guard(Path(argv[0]))
        from fl_server.service.config import load_plugins

        load_plugins()  # the coordinator's FL_SERVE_PLUGINS (inherited): the methods its jobs may train
        run_job(Path(argv[0]))
        lock.close()
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
