"""Integrity of what the coordinator serves (issue 36, defects 5 and 6), against a real coordinator: a
corrupt object is found at start, on load and by the periodic scrub; it is quarantined, its method is
reported degraded (/healthz, dashboard) and answers 503, and the other methods keep serving."""
from __future__ import annotations

import json
import shutil
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from coordinator_proc import join, start

pytestmark = pytest.mark.timeout(600)


def _flip(path: Path, at: int = 100) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x01]))


def _obj(store: Path, sha: str) -> Path:
    return store / "objects" / sha[:2] / sha


def _bundles(store: Path) -> dict[str, dict]:
    with sqlite3.connect(store / "coordinator.sqlite3") as db:
        rows = db.execute("SELECT method, id, manifest, server FROM bundles").fetchall()
    return {m: {"id": i, "manifest": json.loads(mf), "server": json.loads(sv)} for m, i, mf, sv in rows}


def _wait(pred, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.2)


def test_corrupt_objects_are_quarantined_and_only_their_method_degrades(trained_store: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(trained_store, store, ignore=lambda d, names: ["jobs"] if Path(d) == trained_store else [])
    bundles = _bundles(store)
    hn = bundles["ODPFL-HN"]["server"]["hn"]
    _flip(_obj(store, hn))  # defect 5: one flipped byte in theta and the coordinator refused to start
    coord = start(store, env={"FL_SERVE_ARTIFACT_CACHE_FILE_MAX": "0", "FL_SERVE_SCRUB_S": "1"})
    try:
        health = httpx.get(f"{coord.url}/healthz", timeout=30).json()
        assert health["status"] == "degraded" and health["quarantined"] == [hn]
        assert list(health["degraded"]) == ["ODPFL-HN"]
        assert (store / "objects" / "quarantine" / hn).is_file() and not _obj(store, hn).exists()
        r = httpx.post(f"{coord.url}/v1/clients", json={"method": "ODPFL-HN"}, timeout=30)
        assert r.status_code == 503 and r.json()["detail"].startswith("method ODPFL-HN is degraded: 1 object(s)")
        assert "ODPFL-HN" in httpx.get(f"{coord.url}/", timeout=30).text.split("<h2>Degraded</h2>")[1]
        tent = join(coord.url, "TENT")  # the other methods keep serving
        assert tent["methods"] == ["TENT", "none"]
        assert join(coord.url)["manifest"]["method"] == "TENT"  # the default skips the degraded method

        # defect 6: a served artifact corrupted on disk is no longer served (it is streamed from disk here)
        art = tent["manifest"]["artifacts"][0]
        assert httpx.get(f"{coord.url}{art['url']}", timeout=30).status_code == 200
        _flip(_obj(store, art["sha256"]))
        r = httpx.get(f"{coord.url}{art['url']}", timeout=30)
        assert r.status_code == 503 and art["sha256"] in r.json()["detail"]
        health = httpx.get(f"{coord.url}/healthz", timeout=30).json()
        assert set(health["degraded"]) == {"ODPFL-HN", "TENT"}
        r = httpx.get(f"{coord.url}/v1/manifest", params={"method": "TENT"}, timeout=30)
        assert r.status_code == 503  # no manifest is handed out (signed) over bytes that fail their hash

        # restoring the good bytes at the address releases the object (the scrub runs every second)
        good = store / "objects" / "quarantine" / art["sha256"]
        shutil.copyfile(good, _obj(store, art["sha256"]))
        _flip(_obj(store, art["sha256"]))  # the quarantined copy is the corrupt one: flip it back
        _wait(lambda: "TENT" not in httpx.get(f"{coord.url}/healthz", timeout=30).json()["degraded"])
        assert httpx.get(f"{coord.url}{art['url']}", timeout=30).status_code == 200

        # the scrub finds a corrupt object nobody asked for
        manifest_sha = bundles["TENT"]["id"]
        _flip(_obj(store, manifest_sha), at=10)
        _wait(lambda: manifest_sha in httpx.get(f"{coord.url}/healthz", timeout=30).json()["quarantined"])
    finally:
        coord.stop()
