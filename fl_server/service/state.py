"""The coordinator's state object behind the routers: store, artifacts, job runner, hypernetworks, and
which bundle serves which method."""
from __future__ import annotations

import io
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

from edge_sdk.shared import json_finite, strict_dumps
from fl_server.atomic import atomic_write_text
from fl_server.service.artifacts import ArtifactStore, Corrupt
from fl_server.service.dle import DLEAggregate, DLEView
from fl_server.service.config import ServiceConfig, default_methods
from fl_server.service.hypernet import GenerateBatcher, HypernetCache
from fl_server.service.jobs import JobRunner
from fl_server.service.metrics import Metrics
from fl_server.service.publish import publish_archive
from fl_server.service.ratelimit import Buckets, Limit
from fl_server.service.store import JOB_STATES, Store
from fl_server.signing import ManifestSigner

log = logging.getLogger("fl_server.service")
NONE_METHOD = "none"  # plain inference with any bundle's forward graph and weights
BLOB_BUDGET = 256 << 20  # artifact memory cache, in all (per file: ServiceConfig.artifact_cache_file_max)


class Service:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        cfg.store_dir.mkdir(parents=True, exist_ok=True)
        try:  # the database, the admin token and the signing key live here
            os.chmod(cfg.store_dir, 0o700)
        except OSError as exc:  # e.g. a mounted volume owned by another user: say so, serve anyway
            log.warning("cannot make %s owner-only (%s); chmod 700 it", cfg.store_dir, exc.strerror)
        self.store = Store(cfg.store_dir / "coordinator.sqlite3")
        self.artifacts = ArtifactStore(cfg.store_dir / "objects")
        self.runner = JobRunner(cfg, self.store, self.artifacts)
        self.hypernets = HypernetCache(self.artifacts)
        self.generator = GenerateBatcher(self.hypernets)
        self.metrics = Metrics()
        self.token_limits = Buckets(Limit(cfg.token_rate, cfg.token_burst))
        self.join_limits = Buckets(Limit(cfg.join_rate, cfg.join_burst))
        self.address_limits = Buckets(Limit(cfg.address_rate, cfg.address_burst))  # also keyed by enrollment
        self.admin_failures = Buckets(Limit(cfg.admin_fail_rate, cfg.admin_fail_burst))  # refused admin tokens
        self._public: set[str] = set()
        self._bundle_version = -1
        self._by_method: dict[str, dict[str, Any]] = {}
        self._by_id: dict[str, dict[str, Any]] = {}
        self._versions: dict[str, int] = {}  # bundle id -> release version (store.bundle_versions)
        self._manifest_json: dict[str, tuple[dict[str, str], bytes]] = {}  # id -> (signature, serialised view)
        self._blobs: dict[str, bytes] = {}  # small artifacts kept in memory (they never change)
        self._blob_bytes = 0
        self._btfl_base: dict[str, tuple[str, np.ndarray, int]] = {}
        self._lock = threading.Lock()
        self._objects: dict[str, set[str]] = {}  # bundle id -> every object it needs (manifest, artifacts, server)
        self._scrubbing = threading.Event()
        # BTFL: running sums of the clients' DLEs
        self.dles = DLEAggregate(self.store, cfg.dle_source_share, cfg.dle_uploads_share)
        self.admin_token_file = cfg.store_dir / "admin_token"
        self.signer = ManifestSigner.load_or_create(cfg.store_dir)
        # id -> (record, when to re-sign, the version it signs)
        self._signatures: dict[str, tuple[dict[str, str], float, int]] = {}

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._ensure_admin_token()
        self.check_integrity()  # a corrupt object degrades its methods; it does not stop the coordinator
        # bundles of a previous run: tables and hypernetworks loaded before the first request is answered (a
        # background load holds the GIL for ~0.1-0.5 s: a burst of devices right after a restart waited on it)
        self._refresh(background=False)
        log.info("manifest signing key (Ed25519, pin it on devices): %s (from %s)", self.signer.public_hex,
                 self.signer.source)
        if self.store.count("jobs") == 0:  # empty store: train the embedded default
            for method in self.cfg.default_methods:
                self.runner.submit({"method": method, "dataset": "digits", "partition": "pathological",
                                    "rounds": self.cfg.default_rounds, "seed": 0}, is_default=True)
        self.runner.start()
        if self.cfg.scrub_s > 0:
            threading.Thread(target=self._scrub_loop, name="integrity-scrub", daemon=True).start()

    def stop(self) -> None:
        self._scrubbing.set()
        self.runner.stop()
        self.generator.close()
        self.store.close()

    def _ensure_admin_token(self) -> None:
        """FL_ADMIN_TOKEN if set; else a generated token kept in ``<store>/admin_token`` (mode 0600)."""
        if self.cfg.admin_token:
            self.store.set_admin_token(self.cfg.admin_token)
            self.admin_token_file.unlink(missing_ok=True)  # retired: unsetting FL_ADMIN_TOKEN must not revive it
            return
        if not self.admin_token_file.is_file():
            token = self.store.add_token("admin")
            atomic_write_text(self.admin_token_file, token + "\n", mode=0o600)
        # the file's token is the only admin token: an earlier FL_ADMIN_TOKEN or a deleted file's token is revoked
        self.store.set_admin_token(self.admin_token_file.read_text().strip())
        log.info("admin token: %s", self.admin_token_file)

    # -------------------------------------------------------------- bundles
    def _refresh(self, background: bool = True) -> None:
        """Reload the bundle tables when the store recorded a new bundle (no SQL on the request path); the
        served hypernetworks are loaded on a background thread, or here when not ``background``."""
        version = self.store.bundles_version
        if version == self._bundle_version:
            return
        with self._lock:
            bundles = self.store.bundles()  # oldest first: the newest bundle of a method wins
            self._by_method = {b["method"]: b for b in bundles}
            self._by_id = {b["id"]: b for b in bundles}
            self._versions = self.store.bundle_versions()
            self._public = set(self._by_id) | {a["sha256"] for b in bundles
                                                         for a in b["manifest"]["artifacts"]}
            self._objects = {b["id"]: _objects(b) for b in bundles}
            self._bundle_version = version
        for b in bundles:  # the served hypernetworks are loaded before the first generate needs them
            if "hn" in b["server"] and self._by_method.get(b["method"]) is b and not self.degraded_reason(b):
                if background:
                    self.hypernets.preload(b)
                else:
                    try:
                        self.hypernets.get(b)
                    except Corrupt:  # quarantined: ODPFL-HN is reported degraded, the others serve
                        pass

    # ------------------------------------------------------------ integrity
    def check_integrity(self) -> set[str]:
        """Hash every object of every recorded bundle against its address (at start, and every
        ``cfg.scrub_s`` seconds); a corrupt or missing object is quarantined. Returns the quarantined set."""
        needed = set().union(*(_objects(b) for b in self.store.bundles()))
        bad = self.artifacts.recheck(needed)
        for sha in bad:  # nothing of a quarantined object is served, not even a copy in memory
            data = self._blobs.pop(sha, None)
            self._blob_bytes -= 0 if data is None else len(data)
        return bad

    def _scrub_loop(self) -> None:
        while not self._scrubbing.wait(self.cfg.scrub_s):
            try:
                self.check_integrity()
            except Exception:  # a failing pass (e.g. the disk went away) must not end the scrubbing
                log.exception("integrity scrub failed")

    def degraded_reason(self, bundle: dict[str, Any]) -> str | None:
        """Why ``bundle`` cannot be served (an object of it is quarantined), or None."""
        bad = self._objects.get(bundle["id"], _objects(bundle)) & self.artifacts.quarantined
        if not bad:
            return None
        return (f"{len(bad)} object(s) of bundle {bundle['id'][:16]} failed the integrity check and are "
                f"quarantined ({', '.join(sorted(s[:16] for s in bad))}); retrain the method or restore the objects")

    def degraded(self) -> dict[str, str]:
        """Methods whose served bundle is degraded, with the reason; plus ``disk`` while it is (nearly) full."""
        self._refresh()
        out = {m: r for m, b in self._by_method.items() if (r := self.degraded_reason(b))}
        disk = self.disk_problem()
        if disk:
            out["disk"] = disk
        return out

    def disk_problem(self) -> str | None:
        """A message while the store's disk has less than ``cfg.min_free_bytes`` free (writes then fail with
        507), else None."""
        try:
            free = shutil.disk_usage(self.cfg.store_dir).free
        except OSError as exc:
            return f"the store's disk cannot be read ({exc.strerror})"
        if free < self.cfg.min_free_bytes:
            return f"the store's disk has {free} bytes free (FL_SERVE_MIN_FREE_BYTES: {self.cfg.min_free_bytes})"
        return None

    def methods(self) -> list[str]:
        """The methods served now (a degraded method is left out; 'none' when any bundle is served)."""
        self._refresh()
        served = [m for m, b in self._by_method.items() if not self.degraded_reason(b)]
        return [*served, NONE_METHOD] if served else []

    def bundle_for(self, method: str | None) -> dict[str, Any] | None:
        """The newest bundle serving ``method``; for None / 'none' the default (the first served of
        :func:`~fl_server.service.config.default_methods`, else the first served)."""
        self._refresh()
        if method not in (None, NONE_METHOD):
            return self._by_method.get(method)
        order = (*default_methods(), *self._by_method)
        healthy = [m for m in order if m in self._by_method and not self.degraded_reason(self._by_method[m])]
        fallback = [m for m in order if m in self._by_method]
        return self._by_method[(healthy or fallback)[0]] if fallback else None

    def step_method(self, step: str) -> str | None:
        """The method whose bundles run the device step ``step``, for a route that serves one kind of step
        ("btfl": /v1/btfl/dle): the method of the newest served bundle of
        that step (its manifest's ``device_step``), else the first registered method declaring it (a job of it
        may be training), else None."""
        self._refresh()
        for b in reversed(self._by_id.values()):
            if self._by_method.get(b["method"]) is b and b["manifest"].get("device_step") == step:
                return b["method"]
        from fl_server.algorithms import ALGORITHMS

        return next((name for name, cls in ALGORITHMS.items() if cls.device_step == step), None)

    def bundle_by_id(self, bundle_id: str) -> dict[str, Any] | None:
        self._refresh()
        return self._by_id.get(bundle_id)

    def is_public(self, sha256: str) -> bool:
        """Only bundle manifests and their artifacts are served (server-only state such as theta is not)."""
        self._refresh()
        return sha256 in self._public

    def is_bundle(self, sha256: str) -> bool:
        """Whether ``sha256`` names a bundle (its manifest.json)."""
        self._refresh()
        return sha256 in self._by_id

    def signature(self, bundle_id: str) -> dict[str, str]:
        """The ``manifest.sig`` record of a bundle: a signed release (edge_sdk.signing) binding the sha256 of
        its manifest.json to its method, its release version and an expiry ``cfg.manifest_ttl_s`` ahead. Kept
        and re-signed once half of that has passed, so a device always gets at least half the validity."""
        now = time.time()
        self._refresh()  # a bundle published again has a new version: its cached record is re-signed
        cached = self._signatures.get(bundle_id)
        if cached is None or now >= cached[1] or cached[2] != self._versions.get(bundle_id):
            bundle = self.bundle_by_id(bundle_id)
            if bundle is None:
                raise KeyError(f"no bundle {bundle_id}")
            version = self._versions.get(bundle_id)
            if version is None:  # numbered after the tables were last read
                version = self._versions[bundle_id] = self.store.bundle_versions()[bundle_id]
            record = self.signer.record(self.artifact_bytes(bundle_id), bundle["manifest"]["method"], version,
                                        now + self.cfg.manifest_ttl_s)
            cached = self._signatures[bundle_id] = (record, now + self.cfg.manifest_ttl_s / 2, version)
        return cached[0]

    def manifest_view(self, bundle: dict[str, Any]) -> dict[str, Any]:
        m = bundle["manifest"]
        arts = [{**a, "url": f"/v1/artifacts/{a['sha256']}"} for a in m["artifacts"]]
        return {**m, "bundle_id": bundle["id"], "job_id": bundle["job_id"], "artifacts": arts,
                "signature": self.signature(bundle["id"])}

    def manifest_json(self, bundle: dict[str, Any]) -> bytes:
        """The manifest view serialised once per signature (the hot path of joins and manifest requests);
        strict JSON (a bundle of an older export may hold Infinity: it is served as null)."""
        record = self.signature(bundle["id"])
        cached = self._manifest_json.get(bundle["id"])
        if cached is None or cached[0] is not record:
            view = strict_dumps(json_finite(self.manifest_view(bundle))).encode()
            cached = self._manifest_json[bundle["id"]] = (record, view)
        return cached[1]

    def btfl_base(self) -> tuple[str, np.ndarray, int] | None:
        """(bundle id, global DLE [D, L], clients) of the newest bundle of BTFL's device step ("btfl"): its
        training clients' average DLE, counted as that many clients in the average with every device's upload
        (POST /v1/btfl/dle); None without such a bundle."""
        method = self.step_method("btfl")
        bundle = None if method is None else self.bundle_for(method)
        if bundle is None:
            return None
        cached = self._btfl_base.get(bundle["id"])
        if cached is None:
            sha = next(a["sha256"] for a in bundle["manifest"]["artifacts"] if a["name"] == "btfl")
            with np.load(io.BytesIO(self.artifacts.read(sha)), allow_pickle=False) as arrays:
                cached = (bundle["id"], np.asarray(arrays["global_dle"], dtype=np.float64),
                          # older bundles carry dle_samples (a sample-weighted DLE) instead: it counts once
                          int(arrays["dle_clients"].reshape(-1)[0]) if "dle_clients" in arrays.files else 1)
            self._btfl_base[bundle["id"]] = cached
        return cached

    def global_dle(self, client_id: str,
                   source: str | None) -> tuple[DLEView, tuple[str, np.ndarray, int] | None] | None:
        """BTFL's global DLE as ``client_id`` sees it (its own upload left out of ``others_dle``) and the served
        bundle's base it was averaged with; None while there is neither a BTFL bundle nor an upload."""
        base = self.btfl_base()
        view = self.dles.view(client_id, base, source)
        return None if view is None else (view, base)

    def upload_dle(self, client_id: str, freqs: list[list[float]], num_samples: int, source: str | None) -> None:
        """Record a client's DLE upload (replacing its previous one), weighted against the served bundle's base
        (:mod:`fl_server.service.dle`). Raises ``ShapeMismatch`` or ``SourceFull``."""
        self.dles.put(client_id, freqs, num_samples, self.btfl_base(), source, self.cfg.dle_per_source)

    def cached_artifact(self, sha256: str) -> bytes | None:
        """An artifact's bytes from memory, read in (and checked against its address) once if it fits the
        cache; None for a file over ``cfg.artifact_cache_file_max`` or the cache budget: stream it from disk
        (after :meth:`ArtifactStore.verify`). Raises :class:`Corrupt` for a quarantined object."""
        data = self._blobs.get(sha256)
        if data is not None:
            if sha256 in self.artifacts.quarantined:  # the disk copy failed a scrub: serve nothing of it
                raise Corrupt(sha256)
            return data
        try:
            size = self.artifacts.path(sha256).stat().st_size
        except FileNotFoundError:
            size = 0  # read() below quarantines it
        if size > self.cfg.artifact_cache_file_max or self._blob_bytes + size > BLOB_BUDGET:
            return None
        data = self._blobs[sha256] = self.artifacts.read(sha256)
        self._blob_bytes += len(data)
        return data

    def artifact_file(self, sha256: str) -> Path:
        """The file of an artifact to stream from disk (:meth:`cached_artifact` gave None), checked against its
        address first (hashed again only if it changed since its last check); blocking, so a route runs it in a
        worker thread. Raises :class:`Corrupt` (and quarantines the object)."""
        self.artifacts.verify(sha256)
        return self.artifacts.path(sha256)

    def quarantined(self) -> list[str]:
        """The objects that failed the integrity check (nothing of them is served until restored), sorted."""
        return sorted(self.artifacts.quarantined)

    def artifact_bytes(self, sha256: str) -> bytes:
        """An artifact's whole bytes (a manifest to sign, a small file), checked: cached, else read."""
        data = self.cached_artifact(sha256)
        return self.artifacts.read(sha256) if data is None else data

    def pending_default(self) -> dict[str, Any]:
        """Progress of the training that will produce the first bundle (for 503 bodies)."""
        return {"jobs": [{"id": j["id"], "method": j["spec"].get("method"), "status": j["status"],  # a recipe's own
                          "rounds_done": len(self.store.rounds(j["id"])), "rounds": j["spec"].get("rounds")}
                         for j in self.active_jobs()]}

    # ------------------------------------------- what the routers ask of the store (they never reach into it)
    def active_jobs(self) -> list[dict[str, Any]]:
        """The queued and running jobs, oldest first."""
        return [j for j in self.store.jobs() if j["status"] in ("queued", "running")]

    def jobs(self) -> list[dict[str, Any]]:
        """Every job, oldest first."""
        return self.store.jobs()

    def job(self, job_id: str) -> dict[str, Any] | None:
        return self.store.job(job_id)

    def job_rounds(self, job_id: str) -> list[dict[str, Any]]:
        """A job's rounds so far (round, val, test, wall_s), in order."""
        return self.store.rounds(job_id)

    def submit_job(self, spec: dict[str, Any]) -> str:
        """Queue a training job (its id); raises :class:`QueueFull` at ``cfg.max_queued_jobs`` queued jobs."""
        return self.runner.submit(spec)

    def cancel_job(self, job_id: str) -> bool:
        """Cancel a queued or running job (a running job's process is killed); False when it is finished or
        unknown."""
        return self.runner.cancel(job_id)

    def job_outcome(self, job: dict[str, Any]) -> dict[str, Any]:
        """A job's ``method`` and, once it is done, its ``warning``, ``best_round``, ``new_client_accuracy``,
        ``test_of``, ``labeled_device_accuracy`` and ``safeguard`` (:meth:`JobRunner.outcome`)."""
        return self.runner.outcome(job)

    def job_counts(self) -> dict[str, int]:
        """How many jobs are in each state (every state of :data:`JOB_STATES`, 0 included)."""
        counts = dict.fromkeys(JOB_STATES, 0)
        for j in self.store.jobs():
            counts[j["status"]] += 1
        return counts

    def totals(self) -> dict[str, int]:
        """How many clients, bundles and uploaded BTFL DLEs the store holds."""
        return {table: self.store.count(table) for table in ("clients", "bundles", "dles")}

    def recorded_bundles(self) -> list[dict[str, Any]]:
        """Every bundle the store recorded, oldest first (served or superseded)."""
        return self.store.bundles()

    def latest_clients(self, limit: int) -> list[dict[str, Any]]:
        """The ``limit`` clients that joined last, newest first."""
        return self.store.clients(limit)

    def principal(self, token: str) -> tuple[str, str | None, str | None] | None:
        """(scope, client id, source) of a presented bearer token, or None; a client's use is recorded (a client
        in use is never reclaimed)."""
        return self.store.lookup_principal(token, record_use=True)

    def add_client(self, method: str, bundle_id: str, user_agent: str, source: str,
                   enrollment_token: str | None) -> tuple[str, str]:
        """Register a client under this coordinator's limits and enrollment mode: (client id, bearer token);
        raises :class:`RegistryFull` or :class:`EnrollmentRefused`."""
        return self.store.add_client(method, bundle_id, user_agent, self.cfg.max_clients,
                                     self.cfg.unused_client_ttl_s, source=source,
                                     enrollment=self.cfg.enrollment == "token", enrollment_token=enrollment_token)

    def add_enrollment(self, uses: int, ttl_s: float | None) -> tuple[str, str, float | None]:
        """(enrollment id, token, expiry) of a new enrollment token good for ``uses`` joins."""
        return self.store.add_enrollment(uses, ttl_s)

    def revoke_clients(self, client_ids: list[str]) -> tuple[int, int]:
        """Revoke each client's token and take its DLE out of the global DLE: (clients revoked, DLEs removed)."""
        revoked = removed = 0
        for client_id in client_ids:
            exists, source = self.store.client_source(client_id)
            if exists and self.store.revoke_client(client_id):
                revoked += 1
                removed += self.dles.remove(client_id, source)
        return revoked, removed

    def revoke_enrollment(self, enrollment_id: str) -> list[str] | None:
        """No further join spends the enrollment token; the ids of the clients that joined with it (None: no such
        enrollment)."""
        return self.store.revoke_enrollment(enrollment_id)

    def publish(self, archive: IO[bytes]) -> dict[str, Any]:
        """Publish a bundle sent as a tar archive (:func:`publish_archive`); raises :class:`PublishError`."""
        return publish_archive(self.store, self.artifacts, archive, self.cfg.max_bundle_bytes)


def _objects(bundle: dict[str, Any]) -> set[str]:
    """Every object a bundle needs: its manifest (the bundle id), its artifacts, its server-only state."""
    return {bundle["id"], *(a["sha256"] for a in bundle["manifest"]["artifacts"]), *bundle["server"].values()}
