"""A full disk (issue 36, defect 9): the coordinator's store on a small tmpfs of its own (a private mount
namespace: ``unshare``), filled up from outside. Writes are answered 507 with Retry-After, never 500;
/healthz says the disk is degraded; freeing space heals both. Devices do not retry a 507."""
from __future__ import annotations

import http.server
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from coordinator_proc import ADMIN, auth, start
from edge_sdk._client import EdgeClient, EdgeClientError

pytestmark = pytest.mark.timeout(300)
UNSHARE = ["unshare", "-Urm"] if shutil.which("unshare") else None


def _can_mount(tmp: Path) -> bool:
    if UNSHARE is None:
        return False
    probe = subprocess.run([*UNSHARE, "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp}"], capture_output=True)
    return probe.returncode == 0


def test_full_disk_is_507_and_degraded_then_heals(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    if not _can_mount(store):
        pytest.skip("no private mount namespace here (unshare -Urm and mount tmpfs failed)")
    wrap = [*UNSHARE, "sh", "-c", 'mount -t tmpfs -o size=8m tmpfs "$0" && exec "$@"', str(store)]
    coord = start(store, methods="", env={"FL_SERVE_MIN_FREE_BYTES": str(1 << 20)}, wrap=wrap)
    try:
        assert httpx.get(f"{coord.url}/healthz", timeout=30).json()["status"] == "ok"
        filler = Path(f"/proc/{coord.proc.pid}/root") / str(store).lstrip("/") / "filler"
        block = b"\0" * (1 << 16)
        with open(filler, "wb") as fh:  # the server's tmpfs, seen through its own root
            try:
                while True:
                    fh.write(block)
                    fh.flush()
            except OSError:
                pass
        codes: list[int] = []
        for _ in range(200):  # SQLite reuses its WAL after a checkpoint: a few writes may still fit
            r = httpx.post(f"{coord.url}/v1/enrollments", json={"uses": 1}, headers=auth(ADMIN), timeout=30)
            codes.append(r.status_code)
            if r.status_code != 201:
                break
        assert codes[-1] == 507, codes  # was a generic 500
        assert r.headers["retry-after"] == "60"
        assert r.json() == {"detail": "the coordinator's disk is full: nothing was stored; retry later"}
        health = httpx.get(f"{coord.url}/healthz", timeout=30).json()
        assert health["status"] == "degraded" and health["degraded"]["disk"].startswith("the store's disk has ")
        filler.unlink()
        r = httpx.post(f"{coord.url}/v1/enrollments", json={"uses": 1}, headers=auth(ADMIN), timeout=30)
        assert r.status_code == 201  # no transaction was left open by the failed write
        assert httpx.get(f"{coord.url}/healthz", timeout=30).json()["status"] == "ok"
    finally:
        coord.stop()


class _Full(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_POST(self) -> None:  # noqa: N802
        type(self).hits += 1
        body = b'{"detail": "the coordinator\'s disk is full: nothing was stored; retry later"}'
        self.send_response(507)
        self.send_header("Retry-After", "60")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_device_does_not_retry_507(tmp_path: Path) -> None:
    """An HTTP server that answers 507 as the coordinator does: the client reports it after one request
    (it retried each 5xx four more times)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Full)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = EdgeClient(f"http://127.0.0.1:{server.server_port}", cache_dir=tmp_path, retries=4, backoff=0.01)
        with pytest.raises(EdgeClientError) as err:
            client.join()
        assert err.value.status == 507 and "disk is full" in str(err.value)
        assert _Full.hits == 1
    finally:
        server.shutdown()
