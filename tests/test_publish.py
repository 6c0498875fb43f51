"""Publishing a bundle exported elsewhere: ``POST /v1/bundles`` on a real coordinator (uvicorn) and
``fl-server publish --store``; the device then gets it signed with the coordinator's key and runs it
(onnxruntime). Every kind of bad bundle is refused with a clear 4xx."""
from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest

import edge_sdk
from coordinator_proc import ADMIN, Coordinator, auth, start
from edge_sdk._bundle import sha256_file
from fl_server.cli import main as cli
from fl_server.data import load_dataset
from fl_server.service.publish import tar_bundle

pytestmark = pytest.mark.timeout(600)
LIMIT = 3_000_000  # FL_SERVE_MAX_BUNDLE_BYTES of the test server


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TENT bundle trained and exported outside any coordinator (fl-server train + fl-server export)."""
    root = tmp_path_factory.mktemp("elsewhere")
    assert cli(["train", "--dataset", "digits", "--method", "TENT", "--rounds", "2", "--out", str(root / "run"),
                "--no-progress"]) == 0
    assert cli(["export", str(root / "run"), "--out", str(root / "bundle")]) == 0
    return root / "bundle"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    coord = start(tmp_path_factory.mktemp("publish") / "store", methods="",
                  env={"FL_SERVE_MAX_BUNDLE_BYTES": str(LIMIT)})
    yield coord
    coord.stop()


def _post(server: Coordinator, body: bytes, token: str = ADMIN) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/bundles", content=body, headers=auth(token), timeout=60)


def _device_runs(url: str, cache: Path, manifest: dict) -> None:
    """A device downloads the served bundle, checks the coordinator's signature and personalises."""
    key = httpx.get(f"{url}/v1/signing-key", timeout=10).json()["public_key"]
    x = load_dataset("digits").x[:64]
    with edge_sdk.EdgeClient(url, cache_dir=cache, public_key=key) as client:
        info = client.join("TENT")
        assert info.manifest["bundle_id"] == manifest["bundle_id"]
        device = edge_sdk.open_bundle(client.download(info.manifest, method="TENT"), client=client)
    assert device.bundle.signed_by == bytes.fromhex(key) and device.method == "TENT"
    assert device.personalize(x).steps >= 1 and device.predict(x).shape == (64, 10)


def test_published_bundle_is_served_signed_like_a_trained_one(server: Coordinator, bundle: Path,
                                                               tmp_path: Path) -> None:
    assert httpx.get(f"{server.url}/v1/manifest", params={"method": "TENT"}, timeout=10).status_code == 404
    r = _post(server, tar_bundle(bundle))
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["method"] == "TENT" and out["bundle_id"] == sha256_file(bundle / "manifest.json")
    served = httpx.get(f"{server.url}{out['manifest_url']}", timeout=10).json()
    local = json.loads((bundle / "manifest.json").read_text())
    assert [a["sha256"] for a in served["artifacts"]] == [a["sha256"] for a in local["artifacts"]]
    assert served["job_id"] == "published" and served["signature"]["public_key"] == out["signing_key"]
    _device_runs(server.url, tmp_path / "device", served)
    assert _post(server, tar_bundle(bundle)).status_code == 201  # publishing it again is harmless


def test_publish_needs_the_admin_token(server: Coordinator, bundle: Path) -> None:
    assert httpx.post(f"{server.url}/v1/bundles", content=tar_bundle(bundle), timeout=10).status_code == 401
    client = httpx.post(f"{server.url}/v1/clients", json={"method": "none"}, timeout=10)
    if client.status_code == 201:  # once a bundle is served a device can join: its token is not enough
        assert _post(server, tar_bundle(bundle), client.json()["token"]).status_code == 403


def _tar(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def _files(bundle: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(bundle.iterdir())}


def _replace(files: dict[str, bytes], artifact: str, data: bytes, **manifest_changes: object) -> dict[str, bytes]:
    """The bundle with one artifact's bytes replaced and the manifest made consistent with them (so only the
    deeper checks can catch it)."""
    import hashlib

    m = json.loads(files["manifest.json"])
    a = next(a for a in m["artifacts"] if a["name"] == artifact)
    a["sha256"], a["size"] = hashlib.sha256(data).hexdigest(), len(data)
    m.update(manifest_changes)
    return {**files, a["file"]: data, "manifest.json": json.dumps(m).encode()}


def _pickled_npz() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, w=np.array([{"a": 1}], dtype=object))
    return buf.getvalue()


BAD: list[tuple[str, Callable[[dict[str, bytes]], bytes], int, str]] = [
    ("not a tar", lambda f: b"hello, not an archive" * 10, 400, "not a tar archive"),
    ("tampered file", lambda f: _tar({**f, "params.npz": f["params.npz"][:-1] + b"x"}), 422, "sha256 does not match"),
    ("missing file", lambda f: _tar({k: v for k, v in f.items() if k != "params.npz"}), 422, "missing"),
    ("no manifest", lambda f: _tar({k: v for k, v in f.items() if k != "manifest.json"}), 422, "no manifest.json"),
    ("unlisted file", lambda f: _tar({**f, "extra.bin": b"x"}), 422, "not listed in the manifest: extra.bin"),
    ("path traversal", lambda f: _tar({**f, "../evil.onnx": b"x"}), 422, "one flat directory"),
    ("symlink", lambda f: _tar(f, {"forward.onnx.link": "/etc/passwd"}), 422, "not a regular file"),
    ("two directories", lambda f: _tar({"a/manifest.json": f["manifest.json"], "b/x.npz": b"x"}), 422,
     "more than one directory"),
    ("broken onnx", lambda f: _tar(_replace(f, "forward", b"\x08\x07garbage")), 422, "not an ONNX model"),
    ("pickled weights", lambda f: _tar(_replace(f, "params", _pickled_npz())), 422, "not a plain .npz"),
    ("odpfl-hn", lambda f: _tar(_replace(f, "params", f["params.npz"], method="ODPFL-HN")), 422,
     "hypernetwork stays on the coordinator"),
    ("missing step graph", lambda f: _tar({k: v for k, v in f.items() if k != "tent_step.onnx"}
                                          | {"manifest.json": _drop(f["manifest.json"], "tent_step")}), 422,
     "needs the artifacts tent_step"),
    ("malformed manifest", lambda f: _tar({**f, "manifest.json": b"{not json"}), 422, "malformed manifest"),
]


def _drop(manifest: bytes, name: str) -> bytes:
    m = json.loads(manifest)
    m["artifacts"] = [a for a in m["artifacts"] if a["name"] != name]
    return json.dumps(m).encode()


@pytest.mark.parametrize("case, make, status, message", BAD, ids=[b[0] for b in BAD])
def test_bad_bundles_are_refused(server: Coordinator, bundle: Path, case: str,
                                 make: Callable[[dict[str, bytes]], bytes], status: int, message: str) -> None:
    r = _post(server, make(_files(bundle)))
    assert r.status_code == status, r.text
    assert message in r.json()["detail"], r.json()["detail"]


def test_an_archive_over_the_limit_is_413(server: Coordinator) -> None:
    r = _post(server, b"\0" * (LIMIT + 1))
    assert r.status_code == 413 and "over" in r.json()["detail"]


def test_cli_publish_into_a_store(bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    assert cli(["publish", str(bundle), "--store", str(store)]) == 0
    assert "published TENT bundle" in capsys.readouterr().out
    broken = Path(shutil.copytree(bundle, tmp_path / "broken"))
    (broken / "params.npz").write_bytes(b"x")
    assert cli(["publish", str(broken), "--store", str(store)]) == 2
    assert "size 1 does not match the manifest" in capsys.readouterr().err
    coord = start(store, methods="")
    try:
        served = httpx.get(f"{coord.url}/v1/manifest", params={"method": "TENT"}, timeout=10).json()
        assert served["bundle_id"] == sha256_file(bundle / "manifest.json")
        _device_runs(coord.url, tmp_path / "device", served)
    finally:
        coord.stop()
