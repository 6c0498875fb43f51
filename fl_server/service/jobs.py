"""Background job runner: worker threads claim queued jobs from the store and run each in a subprocess
(:mod:`fl_server.service.worker`), so training never holds the API process's GIL or memory. Progress is read
from the run directory's ``metrics.jsonl`` into the ``rounds`` table; a finished bundle is verified and moved
into the content-addressed artifact store. A restart re-queues interrupted jobs, which resume from their
run directory's last checkpoint."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from edge_sdk import UnverifiedSignatureWarning, load_bundle
from edge_sdk.shared import MANIFEST
from fl_server import rundir
from fl_server.recipes.loader import resolve_in_dir
from fl_server.service.artifacts import ArtifactStore
from fl_server.service.config import ServiceConfig
from fl_server.service.store import Store

log = logging.getLogger("fl_server.service")
SECRET_ENV = frozenset({"FL_ADMIN_TOKEN", "FL_SIGNING_KEY"})  # never handed to a training worker


class QueueFull(RuntimeError):
    """A job submitted while ``FL_SERVE_MAX_QUEUED_JOBS`` jobs are queued."""


def import_bundle(store: Store, artifacts: ArtifactStore, job: dict[str, Any], job_dir: Path) -> str:
    """Verify ``job_dir/bundle`` (every sha256), copy its files into the artifact store, record it."""
    with warnings.catch_warnings():  # the worker's own export, unsigned: the coordinator signs what it serves
        warnings.simplefilter("ignore", UnverifiedSignatureWarning)
        bundle = load_bundle(job_dir / "bundle")
    for a in bundle.manifest["artifacts"]:
        artifacts.put_file(bundle.root / a["file"], expected=a["sha256"])
    bundle_id = artifacts.put_file(bundle.root / MANIFEST)
    server: dict[str, str] = {}
    if (job_dir / "server" / "hn.npz").is_file():
        server["hn"] = artifacts.put_file(job_dir / "server" / "hn.npz")
    store.add_bundle(bundle_id, job["id"], bundle.method, bundle.manifest["dataset"], bundle.manifest, server)
    return bundle_id


def _import_path() -> str:
    """PYTHONPATH for the worker: wherever this process found fl_server and edge_sdk, then the caller's."""
    import edge_sdk
    import fl_server

    roots = [str(Path(m.__file__).resolve().parents[1]) for m in (fl_server, edge_sdk)]
    return os.pathsep.join([*dict.fromkeys(roots), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


class JobRunner:
    def __init__(self, cfg: ServiceConfig, store: Store, artifacts: ArtifactStore) -> None:
        self.cfg, self.store, self.artifacts = cfg, store, artifacts
        self.jobs_dir = cfg.store_dir / "jobs"
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._procs: dict[str, subprocess.Popen] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def outcome(self, job: dict[str, Any]) -> dict[str, Any]:
        """A job's ``method`` (its request's, else a recipe job's own once its run records it) and, once it is done,
        its result as its run.json records it (:func:`fl_server.recipes.train`): ``warning`` (collapsed or
        chance-level new-client predictions, else None), ``best_round`` and ``new_client_accuracy`` (its new
        clients' accuracy at that round, a fraction: what a device gets from the job's bundle), ``test_of``
        (``"received"``: the received model's, for a method whose devices personalise on labels),
        ``labeled_device_accuracy`` (for such a method, what a device gets after personalising on a labeled random
        half of each new client, scored on the other half: :func:`fl_server.export.device_scores.labeled_score`)
        and ``safeguard`` (the rule its devices apply after personalising; ``"rollback"``: they keep the received
        model); all None before the job is done. run.json is read once."""
        requested = job["spec"].get("method")
        out: dict[str, Any] = {"method": str(requested) if requested else None, "warning": None, "best_round": None,
                               "new_client_accuracy": None, "test_of": None, "safeguard": None,
                               "labeled_device_accuracy": None}
        if job["status"] == "done" or not requested:
            try:
                run = rundir.read_run(self.jobs_dir / job["id"] / "run")
            except (FileNotFoundError, ValueError):
                return out
            out["method"] = out["method"] or run.get("method")
            if job["status"] == "done":
                out.update({key: run.get(key) for key in out if key != "method"})
        return out

    def start(self) -> None:
        self.store.requeue_interrupted()
        for i in range(self.cfg.workers):
            t = threading.Thread(target=self._loop, name=f"job-runner-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, spec: dict[str, Any], is_default: bool = False) -> str:
        """Queue a job; raises :class:`QueueFull` at ``cfg.max_queued_jobs`` queued jobs (default jobs excepted)."""
        if not is_default and self.store.count_jobs("queued") >= self.cfg.max_queued_jobs:
            raise QueueFull(f"{self.cfg.max_queued_jobs} jobs are queued already (FL_SERVE_MAX_QUEUED_JOBS); "
                            "retry when one has started, or cancel one (DELETE /v1/jobs/{id})")
        job_id = self.store.add_job(spec, is_default)
        self._wake.set()
        return job_id

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or running job: a running job's worker process is killed (SIGKILL; it resumes from
        nothing, the job is over). False when the job is finished or unknown."""
        with self._lock:
            if not self.store.cancel_job(job_id):
                return False
            self._cancelled.add(job_id)
            proc = self._procs.get(job_id)
        if proc is not None:
            proc.kill()
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the workers; running jobs stay 'running' in the store and are re-queued at the next start."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            procs = list(self._procs.values())
        for p in procs:
            p.terminate()
        for t in self._threads:
            t.join(timeout)

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            job = self.store.claim_job()
            if job is None:
                self._wake.wait(self.cfg.poll_s * 4)
                self._wake.clear()
                continue
            try:
                self._run(job)
            except Exception as exc:  # a broken job must not kill the runner
                log.exception("job %s failed", job["id"])
                self.store.set_job(job["id"], status="failed", finished=time.time(), error=str(exc)[:2000])

    def _run(self, job: dict[str, Any]) -> None:
        job_dir = self.jobs_dir / job["id"]
        job_dir.mkdir(parents=True, exist_ok=True)
        spec = {**job["spec"], "data_dir": self.cfg.data_dir, "threads": self.cfg.worker_threads}
        if spec.get("recipe"):  # FILE[:NAME] -> the file in the operator's recipe directory
            spec["recipe"] = resolve_in_dir(self.cfg.recipes_dir, spec["recipe"])
        (job_dir / "spec.json").write_text(json.dumps(spec, indent=1))
        # no secret reaches a worker: it needs none, and a process's environment is readable by its user
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        env.update(OMP_NUM_THREADS=str(self.cfg.worker_threads), PYTHONPATH=_import_path(),
                   FL_COORDINATOR_PID=str(os.getpid()))
        with open(job_dir / "log.txt", "ab") as logf, self._lock:
            if job["id"] in self._cancelled:  # cancelled between claim and start
                return
            proc = subprocess.Popen([sys.executable, "-m", "fl_server.service.worker", str(job_dir)],
                                    stdout=logf, stderr=subprocess.STDOUT, env=env)
            self._procs[job["id"]] = proc
        try:
            while proc.poll() is None:
                self._stop.wait(self.cfg.poll_s)
                self.store.put_rounds(job["id"], rundir.read_metrics(job_dir / "run"))
        finally:
            with self._lock:
                self._procs.pop(job["id"], None)
        if self._stop.is_set() or job["id"] in self._cancelled:
            return  # interrupted by shutdown (re-queued at the next start) or cancelled (DELETE /v1/jobs/{id})
        self.store.put_rounds(job["id"], rundir.read_metrics(job_dir / "run"))
        if proc.returncode != 0:
            tail = (job_dir / "log.txt").read_text(errors="replace")[-2000:]
            self.store.set_job(job["id"], status="failed", finished=time.time(),
                               error=f"worker exited with {proc.returncode}: {tail}")
            return
        bundle_id = import_bundle(self.store, self.artifacts, job, job_dir)
        self.store.set_job(job["id"], status="done", finished=time.time(), bundle_id=bundle_id)
        log.info("job %s done: bundle %s", job["id"], bundle_id)
