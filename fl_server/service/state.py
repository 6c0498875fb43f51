"""The coordinator's state object behind the routers: store, artifacts, job runner, hypernetworks, and
which bundle serves which method."""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from fl_server.service.artifacts import ArtifactStore
from fl_server.service.config import DEFAULT_METHODS, ServiceConfig
from fl_server.service.hypernet import GenerateBatcher, HypernetCache
from fl_server.service.jobs import JobRunner
from fl_server.service.metrics import Metrics
from fl_server.service.ratelimit import Buckets, Limit
from fl_server.service.store import Store

log = logging.getLogger("fl_server.service")
NONE_METHOD = "none"  # plain inference with any bundle's forward graph and weights
BLOB_MAX, BLOB_BUDGET = 16 << 20, 256 << 20  # artifact memory cache: per file, in all


class Service:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        cfg.store_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(cfg.store_dir / "coordinator.sqlite3")
        self.artifacts = ArtifactStore(cfg.store_dir / "objects")
        self.runner = JobRunner(cfg, self.store, self.artifacts)
        self.hypernets = HypernetCache(self.artifacts)
        self.generator = GenerateBatcher(self.hypernets)
        self.metrics = Metrics()
        self.token_limits = Buckets(Limit(cfg.token_rate, cfg.token_burst))
        self.join_limits = Buckets(Limit(cfg.join_rate, cfg.join_burst))
        self._public: set[str] = set()
        self._bundle_count = -1
        self._by_method: dict[str, dict[str, Any]] = {}
        self._manifest_json: dict[str, bytes] = {}
        self._blobs: dict[str, bytes] = {}  # small artifacts kept in memory (they never change)
        self._blob_bytes = 0
        self._lock = threading.Lock()
        self.dle_lock = threading.Lock()  # BTFL DLE uploads: shape check and write are one step
        self.admin_token_file = cfg.store_dir / "admin_token"

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._ensure_admin_token()
        if self.store.count("jobs") == 0:  # empty store: train the embedded default
            for method in self.cfg.default_methods:
                self.runner.submit({"method": method, "dataset": "digits", "partition": "pathological",
                                    "rounds": self.cfg.default_rounds, "seed": 0}, is_default=True)
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop()
        self.store.close()

    def _ensure_admin_token(self) -> None:
        """FL_ADMIN_TOKEN if set; else a generated token kept in ``<store>/admin_token`` (mode 0600)."""
        if self.cfg.admin_token:
            self.store.set_admin_token(self.cfg.admin_token)
            return
        if not self.admin_token_file.is_file():
            token = self.store.add_token("admin")
            fd = os.open(self.admin_token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(token + "\n")
        log.info("admin token: %s", self.admin_token_file)

    # -------------------------------------------------------------- bundles
    def _refresh(self) -> None:
        n = self.store.count("bundles")
        if n == self._bundle_count:
            return
        with self._lock:
            bundles = self.store.bundles()  # oldest first: the newest bundle of a method wins
            self._by_method = {b["method"]: b for b in bundles}
            self._public = {b["id"] for b in bundles} | {a["sha256"] for b in bundles
                                                         for a in b["manifest"]["artifacts"]}
            self._bundle_count = n

    def methods(self) -> list[str]:
        self._refresh()
        return [*self._by_method, NONE_METHOD] if self._by_method else []

    def bundle_for(self, method: str | None) -> dict[str, Any] | None:
        """The newest bundle serving ``method``; for None / 'none' the default (first of DEFAULT_METHODS)."""
        self._refresh()
        if method not in (None, NONE_METHOD):
            return self._by_method.get(method)
        for m in (*DEFAULT_METHODS, *self._by_method):
            if m in self._by_method:
                return self._by_method[m]
        return None

    def bundle_by_id(self, bundle_id: str) -> dict[str, Any] | None:
        return self.store.bundle(bundle_id)

    def is_public(self, sha256: str) -> bool:
        """Only bundle manifests and their artifacts are served (server-only state such as theta is not)."""
        self._refresh()
        return sha256 in self._public

    @staticmethod
    def manifest_view(bundle: dict[str, Any]) -> dict[str, Any]:
        m = bundle["manifest"]
        arts = [{**a, "url": f"/v1/artifacts/{a['sha256']}"} for a in m["artifacts"]]
        return {**m, "bundle_id": bundle["id"], "job_id": bundle["job_id"], "artifacts": arts}

    def manifest_json(self, bundle: dict[str, Any]) -> bytes:
        """The manifest view serialised once per bundle (the hot path of joins and manifest requests)."""
        cached = self._manifest_json.get(bundle["id"])
        if cached is None:
            cached = self._manifest_json[bundle["id"]] = json.dumps(self.manifest_view(bundle)).encode()
        return cached

    def artifact_bytes(self, sha256: str) -> bytes:
        """An artifact's bytes, from memory when it is small enough to keep (content never changes)."""
        data = self._blobs.get(sha256)
        if data is None:
            data = self.artifacts.path(sha256).read_bytes()
            if len(data) <= BLOB_MAX and self._blob_bytes + len(data) <= BLOB_BUDGET:
                self._blobs[sha256] = data
                self._blob_bytes += len(data)
        return data

    def pending_default(self) -> dict[str, Any]:
        """Progress of the training that will produce the first bundle (for 503 bodies)."""
        jobs = [j for j in self.store.jobs() if j["status"] in ("queued", "running")]
        return {"jobs": [{"id": j["id"], "method": j["spec"]["method"], "status": j["status"],
                          "rounds_done": len(self.store.rounds(j["id"])), "rounds": j["spec"]["rounds"]}
                         for j in jobs]}
