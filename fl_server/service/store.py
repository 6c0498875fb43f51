"""Coordinator state in SQLite: clients, hashed bearer tokens, jobs, rounds, bundles, BTFL DLE uploads.

One connection guarded by a lock (SQLite serialises writers anyway); WAL journal with synchronous=NORMAL: a
commit appends to the WAL without an fsync (a power cut may lose the last commits, never corrupt the database),
so a join's commit on the event loop costs ~0.1 ms here, and a reader never waits for a writer's fsync.
Checkpoints (WAL -> database file, with an fsync) never run inside a request's commit: SQLite's automatic
checkpoint is off and a daemon thread checkpoints every ``checkpoint_s`` seconds on its own connection (PASSIVE:
it never blocks readers or writers). Tokens are stored as their sha256 only: a copy of the database does not
let anyone authenticate. Kept behind this small class so another backend can replace it (DESIGN.md, Persistence).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS clients (id TEXT PRIMARY KEY, created REAL NOT NULL, method TEXT, bundle_id TEXT,
                                    user_agent TEXT, first_used REAL);
CREATE TABLE IF NOT EXISTS tokens (hash TEXT PRIMARY KEY, scope TEXT NOT NULL, client_id TEXT, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS tokens_client ON tokens (client_id);
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, spec TEXT NOT NULL, status TEXT NOT NULL, created REAL NOT NULL,
                                 started REAL, finished REAL, error TEXT, bundle_id TEXT, is_default INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (job_id TEXT NOT NULL, round INTEGER NOT NULL, val REAL, test REAL, wall_s REAL,
                                   PRIMARY KEY (job_id, round));
CREATE TABLE IF NOT EXISTS bundles (id TEXT PRIMARY KEY, job_id TEXT NOT NULL, method TEXT NOT NULL,
                                    dataset TEXT NOT NULL, manifest TEXT NOT NULL, server TEXT NOT NULL,
                                    created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS dles (client_id TEXT PRIMARY KEY, dims INTEGER NOT NULL, levels INTEGER NOT NULL,
                                 num_samples INTEGER NOT NULL, freqs TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS bundle_versions (bundle_id TEXT PRIMARY KEY, method TEXT NOT NULL,
                                            version INTEGER NOT NULL, UNIQUE (method, version));
CREATE TABLE IF NOT EXISTS enrollments (id TEXT PRIMARY KEY, hash TEXT UNIQUE NOT NULL, uses_left INTEGER NOT NULL,
                                        expires REAL, created REAL NOT NULL);
"""
# clients that never used their token, oldest first: what a join at the cap may reclaim (created after the
# migration below, which adds first_used to a store of an older version)
UNUSED_INDEX = "CREATE INDEX IF NOT EXISTS clients_unused ON clients (created) WHERE first_used IS NULL"
RECLAIM_BATCH = 10_000  # clients reclaimed per pass at most (a pass a minute: 14M a day, past any join rate)
JOB_STATES = ("queued", "running", "done", "failed", "cancelled")


class RegistryFull(RuntimeError):
    """A join past ``FL_SERVE_MAX_CLIENTS`` registered clients."""


class EnrollmentRefused(PermissionError):
    """A join whose enrollment token is missing, unknown, used up, expired or revoked (FL_SERVE_ENROLLMENT=token)."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Store:
    def __init__(self, path: Path, checkpoint_s: float = 2.0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # every client's DLE and the token hashes: owner-only (SQLite gives the -wal/-shm files the same mode)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            if f.exists() and f.stat().st_mode & 0o077:
                os.chmod(f, 0o600)  # a store of an older version
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self.bundles_version = 0  # bumped by add_bundle: readers cache bundles until it changes
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints: _checkpoint_loop, off the request path
            self._db.executescript(SCHEMA)
            self._add_first_used_column()
            self._db.execute(UNUSED_INDEX)
            self._number_bundles()  # bundles of a store that predates release versions
            if "source" not in {row["name"] for row in self._db.execute("PRAGMA table_info(clients)")}:
                self._db.execute("ALTER TABLE clients ADD COLUMN source TEXT")  # stores of an older version
            self._db.execute("CREATE INDEX IF NOT EXISTS clients_source ON clients (source)")
        self._num_clients = self.count("clients")  # add_client keeps it: one process owns the store
        self._last_reclaim = -float("inf")  # time.monotonic() of the last reclaim pass
        self._closed = threading.Event()
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, args=(path, checkpoint_s),
                                              name="sqlite-checkpoint", daemon=True)
        self._checkpointer.start()

    def _add_first_used_column(self) -> None:
        """Stores of an older version have no ``clients.first_used``: add it and count their clients as used
        (the old version did not record use, and a client that did use its token must never be reclaimed)."""
        columns = {row["name"] for row in self._db.execute("PRAGMA table_info(clients)")}
        if "first_used" not in columns:
            self._db.execute("BEGIN")
            self._db.execute("ALTER TABLE clients ADD COLUMN first_used REAL")
            self._db.execute("UPDATE clients SET first_used = created")
            self._db.execute("COMMIT")

    def _checkpoint_loop(self, path: Path, every_s: float) -> None:
        db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        try:
            while not self._closed.wait(every_s):
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error:  # e.g. busy: the next pass catches up
                    pass
        finally:
            db.close()

    @contextmanager
    def _transaction(self, begin: str = "BEGIN") -> Iterator[None]:
        """A transaction on the shared connection, rolled back on any error (a full disk, a refused join), so
        that no transaction stays open for the next caller. Caller holds the lock."""
        self._db.execute(begin)
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def _run(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        self._closed.set()
        self._checkpointer.join()
        with self._lock:
            self._db.close()

    # ---------------------------------------------------------------- tokens
    def add_token(self, scope: str, client_id: str | None = None) -> str:
        """A new random bearer token (256 bits); only its hash is stored."""
        token = f"fl{scope[0]}_{secrets.token_urlsafe(32)}"
        self._run("INSERT INTO tokens VALUES (?, ?, ?, ?)", (hash_token(token), scope, client_id, time.time()))
        return token

    def set_admin_token(self, token: str) -> None:
        """Make ``token`` the only admin token (idempotent): one the operator replaced stops working."""
        digest = hash_token(token)
        self._run("DELETE FROM tokens WHERE scope = 'admin' AND hash != ?", (digest,))
        self._run("INSERT OR IGNORE INTO tokens VALUES (?, 'admin', NULL, ?)", (digest, time.time()))

    def lookup_token(self, token: str, record_use: bool = False) -> tuple[str, str | None] | None:
        """(scope, client_id) of a presented token, or None (:meth:`lookup_principal` without the source)."""
        found = self.lookup_principal(token, record_use)
        return None if found is None else found[:2]

    def lookup_principal(self, token: str, record_use: bool = False) -> tuple[str, str | None, str | None] | None:
        """(scope, client_id, source) of a presented token, or None; ``source`` is where the client joined from
        (``enr:<enrollment id>`` or ``ip:<address>``). The row is found by the token's hash and the hash is
        compared again in constant time. ``record_use``: a client's first authenticated request is written to
        ``clients.first_used`` (one write per client: such a client is never reclaimed)."""
        digest = hash_token(token)
        rows = self._run("SELECT t.hash, t.scope, t.client_id, c.first_used, c.source FROM tokens t "
                         "LEFT JOIN clients c ON c.id = t.client_id WHERE t.hash = ?", (digest,))
        if not rows or not hmac.compare_digest(rows[0]["hash"], digest):
            return None
        scope, client_id = rows[0]["scope"], rows[0]["client_id"]
        if record_use and client_id is not None and rows[0]["first_used"] is None:
            self._run("UPDATE clients SET first_used = ? WHERE id = ? AND first_used IS NULL", (time.time(), client_id))
        return scope, client_id, rows[0]["source"]

    # ----------------------------------------------------------- enrollment
    def add_enrollment(self, uses: int, ttl_s: float | None = None) -> tuple[str, str, float | None]:
        """An operator-issued enrollment token good for ``uses`` joins (until ``ttl_s`` seconds from now when
        given): (enrollment id, token, expiry). Only the token's hash is stored."""
        enrollment_id, token = uuid.uuid4().hex[:16], f"fle_{secrets.token_urlsafe(32)}"
        expires = None if ttl_s is None else time.time() + ttl_s
        self._run("INSERT INTO enrollments VALUES (?, ?, ?, ?, ?)",
                  (enrollment_id, hash_token(token), uses, expires, time.time()))
        return enrollment_id, token, expires

    def _take_enrollment(self, token: str | None) -> str:
        """Spend one use of an enrollment token; returns its id. Caller holds the lock, inside a transaction."""
        if not token:
            raise EnrollmentRefused("joining needs an enrollment token from the operator (enrollment_token; "
                                    "FL_SERVE_ENROLLMENT=token)")
        digest = hash_token(token[:512])
        row = self._db.execute("SELECT id, hash, uses_left, expires FROM enrollments WHERE hash = ?",
                               (digest,)).fetchone()
        if row is None or not hmac.compare_digest(row["hash"], digest):
            raise EnrollmentRefused("unknown enrollment token")
        if row["uses_left"] < 1 or (row["expires"] is not None and row["expires"] < time.time()):
            raise EnrollmentRefused("this enrollment token is used up, expired or revoked; ask the operator for another")
        self._db.execute("UPDATE enrollments SET uses_left = uses_left - 1 WHERE id = ?", (row["id"],))
        return str(row["id"])

    # --------------------------------------------------------------- clients
    def add_client(self, method: str, bundle_id: str, user_agent: str = "", max_clients: int = 0,
                   unused_ttl_s: float = 0.0, source: str = "", enrollment: bool = False,
                   enrollment_token: str | None = None) -> tuple[str, str]:
        """Register a client: (client id, bearer token). At ``max_clients`` (> 0) registered clients, first
        reclaims those that never used their token and joined over ``unused_ttl_s`` (> 0) seconds ago (one pass
        per min(ttl, 60) s at most), then raises :class:`RegistryFull` if the registry is still full.
        ``enrollment``: the join spends one use of ``enrollment_token`` (else :class:`EnrollmentRefused`) and
        the client's source is that enrollment; otherwise ``source`` (its address)."""
        client_id = uuid.uuid4().hex
        with self._lock:
            if 0 < max_clients <= self._num_clients and unused_ttl_s > 0:
                self._reclaim_unused(unused_ttl_s)
            if 0 < max_clients <= self._num_clients:
                raise RegistryFull(f"the coordinator has registered its maximum of {max_clients} clients "
                                   "(FL_SERVE_MAX_CLIENTS)")
            with self._transaction():
                if enrollment:
                    source = "enr:" + self._take_enrollment(enrollment_token)
                self._db.execute("INSERT INTO clients (id, created, method, bundle_id, user_agent, source) VALUES "
                                 "(?, ?, ?, ?, ?, ?)", (client_id, time.time(), method, bundle_id, user_agent[:200],
                                                        source[:100]))
                token = f"flc_{secrets.token_urlsafe(32)}"
                self._db.execute("INSERT INTO tokens VALUES (?, 'client', ?, ?)",
                                 (hash_token(token), client_id, time.time()))
            self._num_clients += 1
        return client_id, token

    def _reclaim_unused(self, ttl_s: float) -> None:
        """Delete the clients (and their tokens) that never used their token and joined over ``ttl_s`` seconds
        ago: joins that nobody followed up, e.g. a flood of unauthenticated joins. A client that never
        authenticated has uploaded nothing, so no DLE row refers to it. The oldest ``RECLAIM_BATCH`` per pass
        (the join waits for it, so a pass stays short), and one pass per min(ttl, 60) s at most, so that a
        registry full of used clients is not scanned on every join. Caller holds the lock."""
        now = time.monotonic()
        if now - self._last_reclaim < min(ttl_s, 60.0):
            return
        self._last_reclaim = now
        with self._transaction():
            # the batch is chosen once (the partial index clients_unused serves it), then both tables lose it
            self._db.execute("CREATE TEMP TABLE IF NOT EXISTS reclaim (id TEXT PRIMARY KEY)")
            self._db.execute("INSERT INTO reclaim SELECT id FROM clients WHERE first_used IS NULL AND created < ? "
                             "ORDER BY created LIMIT ?", (time.time() - ttl_s, RECLAIM_BATCH))
            self._db.execute("DELETE FROM tokens WHERE scope = 'client' AND client_id IN (SELECT id FROM reclaim)")
            removed = self._db.execute("DELETE FROM clients WHERE id IN (SELECT id FROM reclaim)").rowcount
            self._db.execute("DELETE FROM reclaim")
        self._num_clients -= removed

    def clients(self, limit: int = 100) -> list[dict[str, Any]]:
        return [dict(r) for r in self._run("SELECT * FROM clients ORDER BY created DESC LIMIT ?", (limit,))]

    def count(self, table: str) -> int:
        assert table in ("clients", "jobs", "bundles", "dles", "rounds")
        return int(self._run(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"])

    # ------------------------------------------------------------------ jobs
    def add_job(self, spec: dict[str, Any], is_default: bool = False) -> str:
        job_id = uuid.uuid4().hex[:12]
        self._run("INSERT INTO jobs (id, spec, status, created, is_default) VALUES (?, ?, 'queued', ?, ?)",
                  (job_id, json.dumps(spec), time.time(), int(is_default)))
        return job_id

    def set_job(self, job_id: str, **fields: Any) -> None:
        allowed = {"status", "started", "finished", "error", "bundle_id"}
        if not fields or set(fields) - allowed:
            raise ValueError(f"bad job fields {sorted(fields)}")
        cols = ", ".join(f"{k} = ?" for k in fields)
        self._run(f"UPDATE jobs SET {cols} WHERE id = ?", (*fields.values(), job_id))

    def claim_job(self) -> dict[str, Any] | None:
        """Atomically move the oldest queued job to running and return it."""
        with self._lock:
            with self._transaction("BEGIN IMMEDIATE"):
                row = self._db.execute("SELECT * FROM jobs WHERE status = 'queued' ORDER BY created LIMIT 1").fetchone()
                if row is not None:
                    self._db.execute("UPDATE jobs SET status = 'running', started = COALESCE(started, ?) WHERE id = ?",
                                     (time.time(), row["id"]))
        return None if row is None else self._job_dict(row, status="running")

    def count_jobs(self, status: str) -> int:
        return int(self._run("SELECT COUNT(*) AS n FROM jobs WHERE status = ?", (status,))[0]["n"])

    def cancel_job(self, job_id: str) -> bool:
        """Mark a queued or running job cancelled; False when it is finished (or unknown)."""
        with self._lock:
            return self._db.execute("UPDATE jobs SET status = 'cancelled', finished = ? WHERE id = ? AND status "
                                    "IN ('queued', 'running')", (time.time(), job_id)).rowcount == 1

    def requeue_interrupted(self) -> int:
        """After a restart: jobs that were running go back to the queue (their run dirs resume)."""
        with self._lock:
            return self._db.execute("UPDATE jobs SET status = 'queued' WHERE status = 'running'").rowcount

    @staticmethod
    def _job_dict(row: sqlite3.Row, **override: Any) -> dict[str, Any]:
        d = dict(row)
        d["spec"] = json.loads(d["spec"])
        d["is_default"] = bool(d["is_default"])
        d.update(override)
        return d

    def job(self, job_id: str) -> dict[str, Any] | None:
        rows = self._run("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return self._job_dict(rows[0]) if rows else None

    def jobs(self) -> list[dict[str, Any]]:
        return [self._job_dict(r) for r in self._run("SELECT * FROM jobs ORDER BY created")]

    def put_rounds(self, job_id: str, rows: list[dict[str, Any]]) -> None:
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO rounds VALUES (?, ?, ?, ?, ?)",
                                 [(job_id, r["round"], r.get("val"), r.get("test"), r.get("wall_s")) for r in rows])

    def rounds(self, job_id: str) -> list[dict[str, Any]]:
        rows = self._run("SELECT round, val, test, wall_s FROM rounds WHERE job_id = ? ORDER BY round", (job_id,))
        return [dict(r) for r in rows]

    # --------------------------------------------------------------- bundles
    def add_bundle(self, bundle_id: str, job_id: str, method: str, dataset: str, manifest: dict[str, Any],
                   server: dict[str, str]) -> int:
        """Record a bundle; it becomes the one served for ``method``. Returns its release version: the next of
        the method for a new bundle or an earlier one published again (an operator's rollback: a device that
        has a newer release takes it, since versions only rise), unchanged for the one already served."""
        with self._lock:  # the bundle and its version appear together to readers
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO bundles VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (bundle_id, job_id, method, dataset, json.dumps(manifest), json.dumps(server),
                                  time.time()))
                self._db.execute("UPDATE bundle_versions SET version = (SELECT MAX(version) + 1 FROM bundle_versions "
                                 "WHERE method = ?) WHERE bundle_id = ? AND version < (SELECT MAX(version) FROM "
                                 "bundle_versions WHERE method = ?)", (method, bundle_id, method))
                self._number_bundles()
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            version = self._db.execute("SELECT version FROM bundle_versions WHERE bundle_id = ?",
                                       (bundle_id,)).fetchone()[0]
        self.bundles_version += 1
        return int(version)

    def _number_bundles(self) -> None:
        """Give every bundle without a release version the next version of its method, oldest first (under the
        lock, in a transaction). Versions are stored, so they only ever rise, across restarts too: devices refuse
        a lower one."""
        new = self._db.execute("SELECT id, method FROM bundles WHERE id NOT IN (SELECT bundle_id FROM "
                               "bundle_versions) ORDER BY created").fetchall()
        for row in new:  # one by one: each sees the version given to the one before
            self._db.execute("INSERT INTO bundle_versions SELECT ?, ?, COALESCE(MAX(version), 0) + 1 FROM "
                             "bundle_versions WHERE method = ?", (row["id"], row["method"], row["method"]))

    def bundle_versions(self) -> dict[str, int]:
        """Bundle id -> its release version (rising per method, in the order bundles were added)."""
        return {r["bundle_id"]: r["version"] for r in self._run("SELECT bundle_id, version FROM bundle_versions")}

    @staticmethod
    def _bundle_dict(row: sqlite3.Row) -> dict[str, Any]:
        d = dict(row)
        d["manifest"], d["server"] = json.loads(d["manifest"]), json.loads(d["server"])
        return d

    def bundles(self) -> list[dict[str, Any]]:
        return [self._bundle_dict(r) for r in self._run("SELECT * FROM bundles ORDER BY created")]

    def bundle(self, bundle_id: str) -> dict[str, Any] | None:
        rows = self._run("SELECT * FROM bundles WHERE id = ?", (bundle_id,))
        return self._bundle_dict(rows[0]) if rows else None

    # ------------------------------------------------------------- BTFL DLEs
    def put_dle(self, client_id: str, freqs: list[list[float]], num_samples: int) -> None:
        self._run("INSERT OR REPLACE INTO dles VALUES (?, ?, ?, ?, ?, ?)",
                  (client_id, len(freqs), len(freqs[0]), num_samples, json.dumps(freqs), time.time()))

    def dle(self, client_id: str) -> dict[str, Any] | None:
        rows = self._run("SELECT * FROM dles WHERE client_id = ?", (client_id,))
        return {**dict(rows[0]), "freqs": json.loads(rows[0]["freqs"])} if rows else None

    def dles(self) -> list[dict[str, Any]]:
        """Every DLE row, oldest upload first, with its client's ``source`` (None for an unknown client)."""
        rows = self._run("SELECT d.*, c.source FROM dles d LEFT JOIN clients c ON c.id = d.client_id "
                         "ORDER BY d.updated")
        return [{**dict(r), "freqs": json.loads(r["freqs"])} for r in rows]

    def dles_of_source(self, source: str) -> dict[str, list[list[float]]]:
        """client id -> DLE of every client of ``source`` that has one."""
        rows = self._run("SELECT d.client_id, d.freqs FROM dles d JOIN clients c ON c.id = d.client_id "
                         "WHERE c.source = ?", (source,))
        return {r["client_id"]: json.loads(r["freqs"]) for r in rows}

    def delete_dle(self, client_id: str) -> None:
        self._run("DELETE FROM dles WHERE client_id = ?", (client_id,))

    # ------------------------------------------------------------ revocation
    def client_source(self, client_id: str) -> tuple[bool, str | None]:
        """(whether the client exists, its source)."""
        rows = self._run("SELECT source FROM clients WHERE id = ?", (client_id,))
        return (True, rows[0]["source"]) if rows else (False, None)

    def revoke_client(self, client_id: str) -> bool:
        """The client's bearer token stops working (its DLE: :meth:`DLEAggregate.remove`); False: no such client."""
        with self._lock, self._transaction():
            self._db.execute("DELETE FROM tokens WHERE scope = 'client' AND client_id = ?", (client_id,))
            return self._db.execute("SELECT 1 FROM clients WHERE id = ?", (client_id,)).fetchone() is not None

    def revoke_enrollment(self, enrollment_id: str) -> list[str] | None:
        """No further join spends the enrollment token; returns the ids of the clients that joined with it
        (None: no such enrollment)."""
        with self._lock, self._transaction():
            found = self._db.execute("UPDATE enrollments SET uses_left = 0, expires = 0 WHERE id = ?",
                                     (enrollment_id,)).rowcount
            ids = [r["id"] for r in self._db.execute("SELECT id FROM clients WHERE source = ?",
                                                     ("enr:" + enrollment_id,))]
        return ids if found else None
