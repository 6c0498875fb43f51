"""Release versions against a real coordinator (issue #50, N2 N3 N4 N11): one version sequence per method that only
the coordinator assigns. An offline export (``fl-server export --signing-key``) signs a *candidate*, which a device
never accepts from the network; publishing it makes it a release numbered by the coordinator. Re-publishing an
earlier bundle issues a new, higher version (an operator's rollback). The device's ratchet spans key rotations,
and its cached bundle stays usable offline after its release expired (with a warning), never from the network."""
from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path

import httpx
import pytest

from coordinator_proc import ADMIN, Coordinator, auth, free_port, start
from edge_sdk import EdgeClient
from edge_sdk._bundle import load_bundle
from edge_sdk._client import StaleReleaseWarning
from edge_sdk._errors import BundleExpiredError, BundleRollbackError, BundleSignatureError
from edge_sdk.signing import SIGNATURE_FILE, verify_manifest
from fl_server.cli import main as cli
from fl_server.service.publish import tar_bundle
from fl_server.signing import ManifestSigner

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TENT run trained outside any coordinator (1 round on digits)."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert cli(["train", "--dataset", "digits", "--method", "TENT", "--rounds", "1", "--out", str(out),
                "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def bundle(run_dir: Path) -> Path:
    """The run exported without a signature (fl-server export)."""
    assert cli(["export", str(run_dir), "--out", str(run_dir.with_name("bundle"))]) == 0
    return run_dir.with_name("bundle")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    coord = start(tmp_path_factory.mktemp("versions") / "store", methods="")
    yield coord
    coord.stop()


def _key(coord: Coordinator) -> str:
    return httpx.get(f"{coord.url}/v1/signing-key", timeout=10).json()["public_key"]


def _publish(coord: Coordinator, root: Path) -> dict:
    r = httpx.post(f"{coord.url}/v1/bundles", content=tar_bundle(root), headers=auth(ADMIN), timeout=60)
    assert r.status_code == 201, r.text
    return r.json()


def _view(coord: Coordinator) -> dict:
    return httpx.get(f"{coord.url}/v1/manifest", params={"method": "TENT"}, timeout=10).json()


def _variant(bundle: Path, dest: Path, tag: str) -> Path:
    """Another bundle of the same model (as a later export is: only the manifest's ``created`` differs)."""
    shutil.copytree(bundle, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["created"] = tag
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (dest / SIGNATURE_FILE).unlink(missing_ok=True)
    return dest


def _version(view: dict) -> int:
    return int(json.loads(view["signature"]["release"])["version"])


def test_an_offline_export_is_a_candidate_only_the_coordinator_numbers(server: Coordinator, run_dir: Path,
                                                                       tmp_path: Path) -> None:
    """N2: `fl-server export --signing-key` with the coordinator's own key signs a candidate without a version.
    Served by a man in the middle it is refused (before, its version, the Unix time, moved the device's ratchet
    past every later release); published, the coordinator numbers it, and its later releases are accepted."""
    key = _key(server)
    offline = tmp_path / "offline"
    assert cli(["export", str(run_dir), "--out", str(offline), "--signing-key",
                str(server.store / "signing_key.pem")]) == 0
    candidate = json.loads((offline / SIGNATURE_FILE).read_text())
    out = _publish(server, offline)
    view = _view(server)
    assert view["bundle_id"] == out["bundle_id"]
    with EdgeClient(server.url, cache_dir=tmp_path / "device", public_key=key, backoff=0.05) as c:
        with pytest.raises(BundleSignatureError, match="an offline export's candidate, not a release"):
            c.download({**view, "signature": candidate}, method="TENT")  # the proxy serves the offline signature
        assert c.download(view, method="TENT").release.version == _version(view)  # type: ignore[union-attr]
        _publish(server, _variant(offline, tmp_path / "later", "later"))
        assert c.download(method="TENT").release.version == _version(view) + 1  # type: ignore[union-attr]
    assert out["version"] == _version(view)
    assert "version" not in json.loads(candidate["release"])
    with pytest.raises(BundleSignatureError, match="candidate, not a release"):
        verify_manifest((offline / "manifest.json").read_bytes(), candidate, bytes.fromhex(key), "mitm")
    sideloaded = load_bundle(offline, public_key=key)  # copied onto a device by hand: verified, no version
    assert sideloaded.release is not None and sideloaded.release.candidate


def test_a_signed_bundle_edited_after_signing_is_not_published(server: Coordinator, run_dir: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A candidate whose manifest was edited after signing (here its safeguard rule loosened) fails its own
    manifest.sig, whichever key signed it: publishing it is refused at both doors, rather than re-signed by the
    coordinator and trusted by every device."""
    signed = tmp_path / "signed"
    assert cli(["export", str(run_dir), "--out", str(signed), "--signing-key",
                str(server.store / "signing_key.pem")]) == 0
    manifest = json.loads((signed / "manifest.json").read_text())
    manifest["safeguard"] = {"rule": "off"}
    (signed / "manifest.json").write_text(json.dumps(manifest, indent=1))
    r = httpx.post(f"{server.url}/v1/bundles", content=tar_bundle(signed), headers=auth(ADMIN), timeout=60)
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == (
        "bundle: manifest.json does not match its signature (the signed release names bundle "
        f"{json.loads(json.loads((signed / SIGNATURE_FILE).read_text())['release'])['bundle_id'][:16]}...); it was "
        "modified after signing: export it again from its run (its manifest.sig fails, so it is not the bundle "
        "that was signed)")
    assert cli(["publish", str(signed), "--store", str(server.store)]) == 2  # the other door: one line, exit 2
    assert "modified after signing: export it again" in capsys.readouterr().err


def test_republishing_an_earlier_bundle_issues_a_new_version(server: Coordinator, bundle: Path,
                                                             tmp_path: Path) -> None:
    """N4: re-publishing an earlier bundle is an operator's rollback: it is served under a new, higher version
    (before, it was served under its old one and locked out every device that had a newer release)."""
    first = _publish(server, _variant(bundle, tmp_path / "first", "first"))
    v1 = _version(_view(server))
    _publish(server, _variant(bundle, tmp_path / "second", "second"))
    assert _version(_view(server)) == v1 + 1
    key = _key(server)
    with EdgeClient(server.url, cache_dir=tmp_path / "device", public_key=key, backoff=0.05) as c:
        assert c.download(method="TENT").manifest["created"] == "second"
        again = _publish(server, tmp_path / "first")  # roll back to the first bundle
        view = _view(server)
        assert view["bundle_id"] == again["bundle_id"] == first["bundle_id"] and _version(view) == v1 + 2
        got = c.download(method="TENT")  # the device that had the second release takes the rollback
        assert got.manifest["created"] == "first" and got.release.version == v1 + 2  # type: ignore[union-attr]
    assert again["version"] == v1 + 2  # publish says which version it issued
    assert _publish(server, tmp_path / "first")["version"] == v1 + 2  # the served one again: unchanged
    assert _version(_view(server)) == v1 + 2


def test_the_ratchet_spans_key_rotations(bundle: Path, tmp_path: Path) -> None:
    """N3: a device pinning [old, new] refuses an old-key release older than a new-key one it already has (one
    ratchet per method; before, one per key let a proxy replay any old-key release)."""
    port = free_port()
    coord = start(tmp_path / "store", methods="", port=port)
    try:
        old_key = _key(coord)
        _publish(coord, _variant(bundle, tmp_path / "v1", "v1"))
        old_view = _view(coord)  # what a proxy records: release 1, signed by the old key
    finally:
        coord.stop()
    new = ManifestSigner.generate()
    seed = new._key.private_bytes_raw().hex()
    coord = start(tmp_path / "store", methods="", port=port, env={"FL_SIGNING_KEY": seed})  # rotated
    try:
        assert _key(coord) == new.public_hex
        _publish(coord, _variant(bundle, tmp_path / "v2", "v2"))
        assert _version(_view(coord)) == 2 and _view(coord)["signature"]["public_key"] == new.public_hex
        with EdgeClient(coord.url, cache_dir=tmp_path / "device", public_key=[old_key, new.public_hex]) as c:
            assert c.download(method="TENT").release.version == 2  # type: ignore[union-attr]
            with pytest.raises(BundleRollbackError, match="release version 1 of 'TENT' is older than version 2"):
                c.download(old_view, method="TENT")
    finally:
        coord.stop()


def test_an_expired_cached_release_stays_usable_offline(bundle: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """N11: with the coordinator unreachable, the device keeps its cached bundle after the release expired, with a
    warning that states the expiry; the same expired release served over the network is refused."""
    coord = start(tmp_path / "store", methods="")
    try:
        _publish(coord, _variant(bundle, tmp_path / "b", "b"))
        key = _key(coord)
        with EdgeClient(coord.url, cache_dir=tmp_path / "device", public_key=key) as c:
            view = c.manifest("TENT")
            online = c.download(view, method="TENT")
            expires = online.release.expires  # type: ignore[union-attr]
            real = time.time
            monkeypatch.setattr(time, "time", lambda: real() + 8 * 86400)  # eight days later on the device
            with pytest.raises(BundleExpiredError, match=f"expired at {expires}"):
                c.download(view, method="TENT")  # a replayed expired release from the network
    finally:
        coord.stop()
    with EdgeClient(coord.url, cache_dir=tmp_path / "device", public_key=key, retries=1, backoff=0.01,
                    timeout=1) as c:
        m = c.manifest("TENT")  # unreachable: the cached manifest
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = c.download(m, method="TENT")
        assert got.root == online.root and got.release == online.release
        assert [str(w.message) for w in caught if w.category is StaleReleaseWarning] == [
            f"{coord.url} is unreachable: using the cached bundle {view['bundle_id']} (TENT, release "
            f"{online.release.version}), whose signed release expired at {expires}; "  # type: ignore[union-attr]
            "it is refused from the network until the coordinator signs it again"]
