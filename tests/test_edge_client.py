"""edge_sdk.EdgeClient against a real coordinator process: join, manifest, resumable verified downloads,
signatures (pinned key, trust on first use), cut and stalled connections, cache corruption, offline mode,
servers that answer garbage or hang."""
from __future__ import annotations

import json
import socket
import stat
import threading
import time
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest

from coordinator_proc import Coordinator, free_port, start
from edge_sdk import EdgeClient, EdgeClientError
from edge_sdk._bundle import BundleError, BundleSignatureError, load_bundle
from edge_sdk._client import TrustOnFirstUseWarning
from faultnet import Cut, CuttingProxy, http_reply, serve
from reliability_log import record

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
        assert bundle.id == m["bundle_id"]  # what the device names when it asks for its own bundle's answers
        psi = bundle.weights("params")
        forward = bundle.session("forward")
        x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
        (logits,) = forward.run(["logits"], {"x": x, **{f"psi.{k}": v for k, v in psi.items()}})
        assert logits.shape == (3, 10)
        assert (tmp_path / "identity.json").stat().st_mode & 0o077 == 0  # the token file is private
        with pytest.raises(EdgeClientError, match="404"):
            c.manifest("NoSuchMethod")


def test_download_checks_the_asked_method(server: Coordinator, tmp_path: Path) -> None:
    """A signed bundle of another method (say, one replayed by a man in the middle) is refused when the caller
    asked for a method; 'none' (plain inference) takes any bundle."""
    with EdgeClient(server.url, cache_dir=tmp_path) as c:
        m = c.manifest()
        with pytest.raises(EdgeClientError, match=rf"^bundle {m['bundle_id']}: a 'TENT' bundle, not the "
                                                  r"'FedTTA' bundle that was asked for$"):
            c.download(m, method="FedTTA")
        assert c.download(m, method="TENT").method == "TENT"
        assert c.download(m, method="none").method == "TENT"


def test_bundle_runs_the_bytes_it_verified(server: Coordinator, tmp_path: Path) -> None:
    """Weights and sessions come from the bytes load_bundle hashed: a cache file replaced afterwards (same
    size, other values) does not reach numpy or onnxruntime."""
    with EdgeClient(server.url, cache_dir=tmp_path) as c:
        bundle = c.download(c.manifest())
    before = bundle.weights("params")
    path = bundle.path("params")
    tampered = {k: np.full_like(v, 7.0) for k, v in before.items()}
    path.unlink()  # the bundle folder links the shared object; write a separate file in its place
    with open(path, "wb") as fh:
        np.savez(fh, **tampered)
    after = bundle.weights("params")
    assert sorted(after) == sorted(before) and all(np.array_equal(after[k], before[k]) for k in before)
    assert bundle.session("forward") is not None
    with pytest.raises(BundleError, match="does not match the manifest"):
        load_bundle(bundle.root)  # a fresh load does see the change


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
    key = httpx.get(f"{server.url}/v1/signing-key", timeout=10).json()["public_key"]
    with EdgeClient(server.url, cache_dir=tmp_path, public_key=key) as c:
        online = c.download()
    dead = f"http://127.0.0.1:{free_port()}"
    with EdgeClient(dead, cache_dir=tmp_path, retries=1, backoff=0.01, timeout=1, public_key=key) as c:
        m = c.manifest()
        assert m["bundle_id"] == online.root.name
        offline = c.download(m)
        assert offline.root == online.root and offline.method == "TENT" and offline.signed_by == bytes.fromhex(key)
    with EdgeClient(dead, cache_dir=tmp_path, retries=1, backoff=0.01, timeout=1) as c:  # no key, none trusted
        with pytest.raises(EdgeClientError, match="no public key pinned and none trusted yet .* pass public_key="):
            c.download(m)
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
    from edge_sdk.safeguard import SafeguardRule
    from fl_server.algorithms import ALGORITHMS
    from fl_server.cli import main as fl_server

    data = tmp_path / "device.npz"  # the coordinator's side prepares the device's samples
    assert fl_server(["device-data", server.url, "--method", "tent", "--wait", "300", "--out", str(data)]) == 0
    cmd = [sys.executable, str(repo / "examples" / "stream_inference.py"), "--server", server.url, "--data", str(data),
           "--cache", str(tmp_path / "cache"), "--png", str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json")]
    run = subprocess.run([*cmd, "--method", "tent"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["samples"] > 0 and set(summary["accuracy"]) == {"in-distribution", "corrupted", "external classes"}
    assert summary["torch_imported"] is False and summary["fl_server_imported"] is False
    assert (tmp_path / "s.png").stat().st_size > 1000
    # never a silent loss: the safeguard's decision is on screen, and a lower accuracy than the received model's
    declared = SafeguardRule.from_manifest(ALGORITHMS["TENT"].safeguard)
    assert "safeguard: " in run.stdout and summary["safeguard"]["rule"] == declared.name
    assert ("personalisation LOWERED accuracy" in run.stdout) == summary["lowered_accuracy"]
    strict = subprocess.run([*cmd, "--method", "tent", "--safeguard", "0"], env=env, capture_output=True, text=True,
                            timeout=300)
    kept = json.loads((tmp_path / "s.json").read_text())
    assert strict.returncode == 0, strict.stderr
    assert kept["safeguard"]["rule"] == "disagreement<=0"
    assert (kept["safeguard"]["action"] == "received") == (kept["safeguard"]["evidence"]["disagreement"] > 0)
    if kept["safeguard"]["action"] == "received":  # the received model predicts: nothing lowered, and the screen says why
        assert kept["accuracy"] == kept["accuracy_received_model"] and not kept["lowered_accuracy"]
        assert "safeguard: kept the received model" in strict.stdout
    btfl = subprocess.run([*cmd, "--method", "btfl"], env=env, capture_output=True, text=True, timeout=300)
    assert btfl.returncode == 3 and "has no BTFL bundle and no BTFL job" in btfl.stderr  # this server trains none


# ------------------------------------------------------------------ signatures
OTHER_KEY = "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c"  # RFC 8032 TEST 2's public key


def _key(server: Coordinator) -> str:
    key = httpx.get(f"{server.url}/v1/signing-key", timeout=10).json()["public_key"]
    assert httpx.get(f"{server.url}/healthz", timeout=10).json()["signing_key"] == key
    return key


def test_pinned_key_verifies_downloads(server: Coordinator, tmp_path: Path) -> None:
    key = _key(server)
    assert stat.S_IMODE((server.store / "signing_key.pem").stat().st_mode) == 0o600
    assert f"manifest signing key (Ed25519; pin it on devices: EdgeClient(url, public_key=...)): {key}" in \
        server.log.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pinned key never falls back to trust on first use
        with EdgeClient(server.url, cache_dir=tmp_path, public_key=key) as c:
            bundle = c.download()
            signature = c.manifest()["signature"]
    assert bundle.signed_by == bytes.fromhex(key)
    assert json.loads((bundle.root / "manifest.sig").read_text())["public_key"] == key
    assert load_bundle(bundle.root, public_key=key).method == "TENT"
    head = httpx.get(f"{server.url}/v1/artifacts/{bundle.root.name}", timeout=10).headers
    assert json.loads(head["X-Manifest-Signature"]) == signature


def test_wrong_pinned_key_is_refused_before_any_artifact(server: Coordinator, tmp_path: Path) -> None:
    urls: list[str] = []
    hooks = {"request": [lambda req: urls.append(req.url.path)]}
    with EdgeClient(server.url, cache_dir=tmp_path, public_key=OTHER_KEY, event_hooks=hooks) as c:
        m = c.manifest()
        with pytest.raises(BundleSignatureError, match=r"signed by key [0-9a-f]{16}\.\.\., not by the trusted key 3d4017c3"):
            c.download(m)
    fetched = {u.rsplit("/", 1)[1] for u in urls if u.startswith("/v1/artifacts/")}
    assert fetched == {m["bundle_id"]}  # only the manifest itself: no artifact of an untrusted bundle
    record("signature", "bundle signed by another key than the pinned one", "refused before any artifact download")


def test_missing_or_replayed_signature_is_refused(server: Coordinator, tmp_path: Path) -> None:
    key = _key(server)
    with EdgeClient(server.url, cache_dir=tmp_path, public_key=key) as c:
        m = c.manifest()
        with pytest.raises(BundleSignatureError, match="not signed"):
            c.download({k: v for k, v in m.items() if k != "signature"})
        replay = dict(m["signature"])
        replay["signature"] = replay["signature"][::-1]  # a signature, but not of these bytes
        with pytest.raises(BundleSignatureError, match="does not match its signature"):
            c.download({**m, "signature": replay})
    record("signature", "manifest view without its signature (key pinned)", "refused")
    record("signature", "signature that is not of this manifest's bytes", "refused")


def test_trust_on_first_use(server: Coordinator, tmp_path: Path) -> None:
    key = _key(server)
    with pytest.warns(TrustOnFirstUseWarning, match="trusting .* on first use"):
        with EdgeClient(server.url, cache_dir=tmp_path) as c:
            assert c.download().signed_by == bytes.fromhex(key)
    store = tmp_path / "trusted_keys.json"
    assert json.loads(store.read_text()) == {server.url: key} and stat.S_IMODE(store.stat().st_mode) == 0o600
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # known now: no second warning
        with EdgeClient(server.url, cache_dir=tmp_path) as c:
            c.download()
    store.write_text(json.dumps({server.url: OTHER_KEY}))  # the coordinator now presents another key
    with EdgeClient(server.url, cache_dir=tmp_path) as c:
        with pytest.raises(BundleSignatureError, match="not by the trusted key 3d4017c3.*trusted on first use"):
            c.download()
    store.write_text("{not json")
    with EdgeClient(server.url, cache_dir=tmp_path) as c:
        with pytest.raises(EdgeClientError, match="trusted_keys.json is corrupt"):
            c.download()
    record("signature", "coordinator key differs from the one trusted on first use", "refused, with the trust file named")
    record("cache", "device cache: trust file (trusted_keys.json) garbled", "clear EdgeClientError naming the file")


# ------------------------------------------------------------------ cut and stalled downloads
def _params_artifact(server: Coordinator) -> dict:
    m = httpx.get(f"{server.url}/v1/manifest", timeout=10).json()
    return next(a for a in m["artifacts"] if a["name"] == "params")


@pytest.mark.parametrize("mode", ["cut", "stall"])
def test_interrupted_download_resumes_with_range(server: Coordinator, tmp_path: Path, mode: str) -> None:
    """A proxy in front of the real coordinator cuts (or stalls until the client times out) the artifact's
    body twice; the client resumes each time with Range from the bytes it kept, and the sha256 verifies."""
    a = _params_artifact(server)
    first, second = a["size"] // 4, a["size"] // 3
    cut = Cut(prefix=f"/v1/artifacts/{a['sha256']}", after=[first, second], mode=mode, stall_s=4.0)
    with CuttingProxy(server.url, cut) as proxy:
        with EdgeClient(proxy.url, cache_dir=tmp_path, timeout=1.0, retries=1, backoff=0.05) as c:
            path = c.fetch(a["sha256"], a["size"])
    assert path.read_bytes() == httpx.get(server.url + a["url"], timeout=10).content
    assert cut.requests == [(cut.prefix, None), (cut.prefix, f"bytes={first}-"), (cut.prefix, f"bytes={first + second}-")]
    record("download", f"artifact body {'cut' if mode == 'cut' else 'stalled past the read timeout'} twice "
           f"({a['size']} bytes, at {first} and {first + second})", "resumed with Range; sha256 verified",
           injected=2)


# ------------------------------------------------------------------ cache corruption
def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


CORRUPTIONS = {
    "artifact byte flipped": (lambda b: _flip(b.path("forward")), BundleError, "sha256 does not match"),
    "artifact truncated": (lambda b: b.path("params").write_bytes(b.path("params").read_bytes()[:100]), BundleError,
                           "size 100 does not match"),
    "artifact deleted": (lambda b: b.path("params").unlink(), BundleError, "listed in the manifest but missing"),
    "manifest edited": (lambda b: _flip(b.root / "manifest.json"), BundleSignatureError, "does not match its signature"),
    "signature deleted": (lambda b: (b.root / "manifest.sig").unlink(), BundleSignatureError, "not signed"),
    "signature garbled": (lambda b: (b.root / "manifest.sig").write_text("garbage"), BundleSignatureError,
                          "malformed signature record"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_cache_is_detected_and_refetched(server: Coordinator, tmp_path: Path, kind: str) -> None:
    key = _key(server)
    damage, error, message = CORRUPTIONS[kind]
    with EdgeClient(server.url, cache_dir=tmp_path, public_key=key) as c:
        bundle = c.download()
        good = {p.name: p.read_bytes() for p in bundle.root.iterdir()}
        damage(bundle)
        with pytest.raises(error, match=message):
            load_bundle(bundle.root, public_key=key)
        again = c.download()
    assert {p.name: p.read_bytes() for p in again.root.iterdir()} == good
    record("cache", f"device cache: {kind}", "detected on load; re-fetched and verified")


# ------------------------------------------------------------------ servers that misbehave
def _trickle(conn: socket.socket, head: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    for _ in range(100):
        conn.sendall(b" ")
        time.sleep(0.1)


def _endless(conn: socket.socket, head: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n")  # no length: until close
    while True:
        conn.sendall(b"\0" * 65536)


GARBAGE = {
    "not HTTP": (lambda conn, head: conn.sendall(b"\x00\x17garbage, not http\r\n\r\n"), "join",
                 "sent an invalid HTTP response"),
    "not JSON": (lambda conn, head: conn.sendall(http_reply(b"<html>hello</html>")), "join", "the reply is not JSON"),
    "JSON of another API": (lambda conn, head: conn.sendall(http_reply(b'{"hello": "world"}')), "join",
                            "unexpected reply .*is .* an fl-edge coordinator"),
    "endless JSON body": (_endless, "join", "reply larger than 1048576 bytes"),
    "body trickled past the deadline": (_trickle, "join", r"timed out \(reply not complete after 1s\)"),
    "artifact longer than its manifest size": (_endless, "fetch", "sent more than the 1000 bytes the manifest lists"),
    "accepts, never answers": (lambda conn, head: time.sleep(3), "join", r"timed out \(ReadTimeout\)"),
}


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_misbehaving_server_gives_a_clear_error(tmp_path: Path, kind: str) -> None:
    respond, call, message = GARBAGE[kind]
    with serve(respond) as bad:
        with EdgeClient(bad.url, cache_dir=tmp_path, timeout=0.5, retries=1, backoff=0.01, deadline=1.0,
                        max_response_bytes=1 << 20) as c:
            t0 = time.monotonic()
            with pytest.raises(EdgeClientError, match=message):
                c.join() if call == "join" else c.fetch("ab" * 32, size=1000)
            assert time.monotonic() - t0 < 10
    if call == "fetch":
        assert not (tmp_path / "objects" / ("ab" * 32)).exists()
    record("server", f"server: {kind}", "clear EdgeClientError within the deadline")


def _trickle_head(conn: socket.socket, head: bytes) -> None:
    """Reply headers one byte every 0.1 s (each read gets a byte well within the read timeout), for 30 s."""
    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 250:
        conn.sendall(bytes([byte]))
        time.sleep(0.1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["join", "fetch"])
def test_reply_headers_trickled_a_byte_at_a_time_end_at_the_deadline(tmp_path: Path, call: str) -> None:
    """httpx's sync client times each read, not the reply: headers trickled a byte at a time kept a call blocked
    far past its deadline (30 s here, for a 1 s deadline). Now the deadline covers connect, headers and body."""
    with serve(_trickle_head) as bad:
        with EdgeClient(bad.url, cache_dir=tmp_path, timeout=0.5, retries=0, deadline=1.0) as c:
            t0 = time.monotonic()
            with pytest.raises(EdgeClientError, match=r"timed out \(reply not complete after 1s\)"):
                c.join() if call == "join" else c.fetch("ab" * 32, size=1000)
            assert time.monotonic() - t0 < 1.0 + 0.5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("respond, message", [(_endless, "reply larger than 1048576 bytes"),
                                              (_trickle, r"no manifest within 2s \(timed out")],
                         ids=["endless body", "trickled body"])
def test_wait_ready_has_a_size_limit_and_a_total_deadline(tmp_path: Path, respond, message: str) -> None:  # type: ignore[no-untyped-def]
    """Issue 50, N8: wait_ready (the streaming example's first call) read 645 MB from a hostile server and was
    still blocked after 45 s with timeout=5; now every reply is bounded and the call ends by its timeout."""
    with serve(respond) as bad:
        with EdgeClient(bad.url, cache_dir=tmp_path, timeout=5.0, max_response_bytes=1 << 20) as c:
            t0 = time.monotonic()
            with pytest.raises(EdgeClientError, match=message):
                c.wait_ready(timeout=2.0, poll=0.1)
            assert time.monotonic() - t0 < 2.0 + 1.5
