"""edge_sdk.EdgeClient against a real coordinator process: join, manifest, resumable verified downloads,
cache corruption, offline mode, timeouts."""
from __future__ import annotations

import socket
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from coordinator_proc import Coordinator, free_port, start
from edge_sdk import EdgeClient, EdgeClientError
from edge_sdk.bundle import BundleError, load_bundle

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    coord = start(tmp_path_factory.mktemp("sdk") / "store", methods="TENT", workers=1)
    yield coord
    coord.stop()


def test_wait_join_download(server: Coordinator, tmp_path: Path) -> None:
    with EdgeClient(server.url, cache_dir=tmp_path, backoff=0.05) as c:
        m = c.wait_ready(timeout=300)
        info = c.join()
        assert info.manifest["bundle_id"] == m["bundle_id"] and "TENT" in info.methods
        bundle = c.download(info.manifest)
        assert bundle.method == "TENT" and (bundle.root / "manifest.json").is_file()
        psi = bundle.weights("params")
        forward = bundle.session("forward")
        x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
        (logits,) = forward.run(["logits"], {"x": x, **{f"psi.{k}": v for k, v in psi.items()}})
        assert logits.shape == (3, 10)
        assert (tmp_path / "identity.json").stat().st_mode & 0o077 == 0  # the token file is private
        with pytest.raises(EdgeClientError, match="404"):
            c.manifest("NoSuchMethod")


def test_resume_partial_download(server: Coordinator, tmp_path: Path) -> None:
    seen: list[dict[str, str]] = []
    hooks = {"request": [lambda req: seen.append(dict(req.headers))]}
    with EdgeClient(server.url, cache_dir=tmp_path, event_hooks=hooks) as c:
        m = c.manifest()
        a = next(a for a in m["artifacts"] if a["name"] == "params")
        full = httpx.get(server.url + a["url"]).content
        part = tmp_path / "objects" / f"{a['sha256']}.part"
        part.write_bytes(full[: len(full) // 3])  # an interrupted earlier download
        path = c.fetch(a["sha256"])
        assert path.read_bytes() == full and not part.exists()
        ranged = [h for h in seen if "range" in h]
        assert ranged and ranged[-1]["range"] == f"bytes={len(full) // 3}-"
        # a bogus partial file (wrong bytes) fails the hash, is discarded, and the clean download succeeds
        path.unlink()
        part.write_bytes(b"\0" * 100)
        assert c.fetch(a["sha256"]).read_bytes() == full


def test_corrupt_cache_is_refetched(server: Coordinator, tmp_path: Path) -> None:
    with EdgeClient(server.url, cache_dir=tmp_path) as c:
        bundle = c.download()
        target = bundle.path("forward")
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))  # breaks the hard link's twin too, or the copy
        with pytest.raises(BundleError, match="sha256"):
            load_bundle(bundle.root)
        again = c.download()  # detected and fetched again
        assert again.path("forward").read_bytes() != bytes(data)


def test_offline_uses_cache(server: Coordinator, tmp_path: Path) -> None:
    with EdgeClient(server.url, cache_dir=tmp_path) as c:
        online = c.download()
    dead = f"http://127.0.0.1:{free_port()}"
    with EdgeClient(dead, cache_dir=tmp_path, retries=1, backoff=0.01, timeout=1) as c:
        m = c.manifest()
        assert m["bundle_id"] == online.root.name
        offline = c.download(m)
        assert offline.root == online.root and offline.method == "TENT"
    with EdgeClient(dead, cache_dir=tmp_path / "empty", retries=1, backoff=0.01, timeout=1) as c:
        with pytest.raises(EdgeClientError, match="unreachable"):
            c.manifest()


def test_hanging_server_times_out(tmp_path: Path) -> None:
    """A server that accepts the connection and never answers: the SDK times out and says so."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(sock.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        with EdgeClient(f"http://127.0.0.1:{sock.getsockname()[1]}", cache_dir=tmp_path, timeout=0.3, retries=1,
                        backoff=0.01) as c:
            with pytest.raises(EdgeClientError, match="timed out .*2 attempts"):
                c.join()
    finally:
        stop.set()
        t.join()
        for s in conns:
            s.close()
        sock.close()


def test_client_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, edge_sdk; from edge_sdk import EdgeClient; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1] / "edge_sdk")


def test_stream_example_runs(server: Coordinator, tmp_path: Path) -> None:
    """examples/stream_inference.py end to end against the coordinator (TENT), and BTFL's clear refusal."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "edge_sdk")])}
    cmd = [sys.executable, str(repo / "examples" / "stream_inference.py"), "--server", server.url,
           "--cache", str(tmp_path / "cache"), "--png", str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json")]
    run = subprocess.run([*cmd, "--method", "tent"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["samples"] > 0 and set(summary["accuracy"]) == {"in-distribution", "corrupted", "external classes"}
    assert summary["torch_imported"] is False and (tmp_path / "s.png").stat().st_size > 1000
    btfl = subprocess.run([*cmd, "--method", "btfl"], env=env, capture_output=True, text=True, timeout=300)
    assert btfl.returncode == 3 and "has no BTFL bundle and no BTFL job" in btfl.stderr  # this server trains none
