"""The update channel against a real coordinator (issue #36): a replayed older signed bundle of the same
method is refused (rollback), so is an expired signed release (freeze), release versions rise per method and
survive restarts, and everything signed or served is strict JSON (the ODPFL-HN manifest had ``Infinity``)."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from coordinator_proc import ADMIN, Coordinator, auth, start_copy
from edge_sdk import EdgeClient
from edge_sdk._bundle import BundleError, load_bundle
from edge_sdk._errors import BundleExpiredError, BundleRollbackError, BundleSignatureError
from edge_sdk.signing import SIGNATURE_FILE
from fl_server.service.store import Store
from fl_server.signing import ManifestSigner
from reliability_log import record

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(trained_store: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    coord = start_copy(trained_store, tmp_path_factory.mktemp("channel") / "store")  # TENT and ODPFL-HN
    yield coord
    coord.stop()


def _signer(coord: Coordinator) -> ManifestSigner:
    """The coordinator's own key, as its operator holds it (the private half stays in the store)."""
    return ManifestSigner.from_pem(coord.store / "signing_key.pem")


def _refuse_constants(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")


def test_a_replayed_older_bundle_of_the_same_method_is_refused(server: Coordinator, tmp_path: Path) -> None:
    key = _signer(server).public_hex
    with EdgeClient(server.url, cache_dir=tmp_path, public_key=key, backoff=0.05) as c:
        old = c.manifest("TENT")  # what a proxy on the path records today
        first = c.download(old, method="TENT")
        assert first.release is not None and first.release.method == "TENT"
        # the operator publishes a newer TENT bundle
        r = httpx.post(f"{server.url}/v1/jobs", json={"method": "TENT", "rounds": 1, "seed": 1},
                       headers=auth(ADMIN), timeout=30)
        assert r.status_code == 201, r.text
        server.wait_bundles(3)
        new = c.manifest("TENT")
        assert new["bundle_id"] != old["bundle_id"]
        assert c.download(new, method="TENT").release.version == first.release.version + 1  # type: ignore[union-attr]
        # the proxy now answers with the older signed manifest: validly signed, unexpired, the right method
        with pytest.raises(BundleRollbackError, match=rf"^bundle {old['bundle_id']}: release version "
                                                      rf"{first.release.version} of 'TENT' is older than version "
                                                      rf"{first.release.version + 1} this device already accepted"):
            c.download(old, method="TENT")
    with EdgeClient(server.url, cache_dir=tmp_path, public_key=key) as c:  # the device restarted: still refused
        with pytest.raises(BundleRollbackError, match="older than version"):
            c.download(old)
        assert c.download(new).manifest["method"] == "TENT"  # the newest stays usable
    ledger = tmp_path / "accepted_versions.json"
    assert ledger.stat().st_mode & 0o077 == 0
    assert json.loads(ledger.read_text())[server.url]["TENT"][key[:16]]["version"] == 2
    record("signature", "older signed bundle of the same method replayed (proxy)",
           "refused by EdgeClient.download (BundleRollbackError), also after a device restart")


def test_an_expired_release_is_refused(server: Coordinator, tmp_path: Path) -> None:
    signer = _signer(server)
    with EdgeClient(server.url, cache_dir=tmp_path, public_key=signer.public_hex) as c:
        m = c.manifest("ODPFL-HN")
        release = json.loads(m["signature"]["release"])
        manifest_bytes = httpx.get(f"{server.url}/v1/artifacts/{m['bundle_id']}", timeout=30).content
        # the coordinator's own key signed this release, but it expired an hour ago (a frozen proxy)
        stale = signer.record(manifest_bytes, "ODPFL-HN", release["version"], time.time() - 3600)
        with pytest.raises(BundleExpiredError, match=rf"^bundle {m['bundle_id']}: its signed release expired "
                                                     r"at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"):
            c.download({**m, "signature": stale})
        # pushing the expiry forward without the key breaks the signature
        forged = {**m["signature"], "release": m["signature"]["release"].replace(release["expires"],
                                                                                 "2999-01-01T00:00:00Z")}
        with pytest.raises(BundleSignatureError, match="the release does not match its signature"):
            c.download({**m, "signature": forged})
        # a signature of an older coordinator (no release: no version, no expiry) cannot be replayed either
        legacy = {k: v for k, v in m["signature"].items() if k != "release"}
        with pytest.raises(BundleSignatureError, match="malformed signature record .*no release"):
            c.download({**m, "signature": legacy})
        assert c.download(m).release.expires == release["expires"]  # type: ignore[union-attr]
    assert release["expires"] > time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 6 * 86400))
    record("signature", "expired signed release (frozen proxy)", "refused by EdgeClient.download (BundleExpiredError)")


def test_key_rotation_pins_old_and_new_key(server: Coordinator, tmp_path: Path) -> None:
    """During a rotation a device pins both keys; a device pinned only to another key is refused."""
    key = _signer(server).public_hex
    other = ManifestSigner.generate().public_hex
    with EdgeClient(server.url, cache_dir=tmp_path / "both", public_key=[other, key]) as c:
        bundle = c.download(method="TENT")
        assert bundle.signed_by == bytes.fromhex(key) and bundle.release.key_id == key[:16]  # type: ignore[union-attr]
    with EdgeClient(server.url, cache_dir=tmp_path / "old", public_key=[other]) as c:
        with pytest.raises(BundleSignatureError, match=rf"signed by key {key[:16]}\.\.\., not by the trusted key "
                                                       rf"{other[:16]}"):
            c.download(method="TENT")


def test_release_versions_rise_per_method_and_survive_restarts(tmp_path: Path) -> None:
    manifest = {"method": "TENT", "artifacts": []}
    store = Store(tmp_path / "s.sqlite3")
    for i, method in enumerate(["TENT", "ODPFL-HN", "TENT"]):
        store.add_bundle(f"{i:064x}", "job", method, "digits", manifest, {})
    assert store.bundle_versions() == {f"{0:064x}": 1, f"{1:064x}": 1, f"{2:064x}": 2}
    assert store.add_bundle(f"{2:064x}", "job", "TENT", "digits", manifest, {}) == 2  # the served one again: kept
    store.close()
    store = Store(tmp_path / "s.sqlite3")  # a restart
    store.add_bundle(f"{3:064x}", "job", "TENT", "digits", manifest, {})
    assert store.bundle_versions()[f"{3:064x}"] == 3
    store._run("DROP TABLE bundle_versions")  # a store from before release versions
    store.close()
    store = Store(tmp_path / "s.sqlite3")
    assert store.bundle_versions() == {f"{0:064x}": 1, f"{1:064x}": 1, f"{2:064x}": 2, f"{3:064x}": 3}
    store.close()


def test_signed_manifests_are_strict_json(server: Coordinator, tmp_path: Path) -> None:
    """The ODPFL-HN manifest (dp_epsilon = inf) is RFC 8259 JSON as served and as signed; the device parses
    strictly; the coordinator still rebuilds the hypernetwork from it (null = no budget) and serves it."""
    m_raw = httpx.get(f"{server.url}/v1/manifest", params={"method": "ODPFL-HN"}, timeout=30).content
    view = json.loads(m_raw, parse_constant=_refuse_constants)
    signed = httpx.get(f"{server.url}/v1/artifacts/{view['bundle_id']}", timeout=30).content
    manifest = json.loads(signed, parse_constant=_refuse_constants)
    assert manifest["hyperparameters"]["dp_epsilon"] is None and view["hyperparameters"]["dp_epsilon"] is None
    json.loads(view["signature"]["release"], parse_constant=_refuse_constants)
    with EdgeClient(server.url, cache_dir=tmp_path, public_key=_signer(server).public_hex) as c:
        c.join("ODPFL-HN")
        bundle = c.download(method="ODPFL-HN")
        dim = int(bundle.hyperparameters["embed_dim"])
        weights = c.generate(np.random.default_rng(0).standard_normal(dim), bundle.id)
        assert weights and all(np.isfinite(w).all() for w in weights.values())
    # a manifest that is not strict JSON is refused on the device
    root = tmp_path / "nan-bundle"
    root.mkdir()
    bad = signed.replace(b'"dp_epsilon": null', b'"dp_epsilon": Infinity')
    assert bad != signed and hashlib.sha256(bad).hexdigest() != view["bundle_id"]
    (root / "manifest.json").write_bytes(bad)
    with pytest.raises(BundleError, match=r"malformed manifest \(not strict JSON: Infinity is not a JSON value\)"):
        load_bundle(root)
    assert not (root / SIGNATURE_FILE).exists()
