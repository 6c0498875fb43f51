"""Signed bundles on the device (no torch, no cryptography here): the fixture's bundles carry manifest.sig by
the key in signing_key.pub. Every way of breaking the chain is refused with its own message, before
onnxruntime is even imported."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from edge_sdk._bundle import BundleError, BundleSignatureError, UnverifiedSignatureWarning, load_bundle
from reliability_log import record

OTHER_KEY = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"  # RFC 8032 TEST 1's


@pytest.fixture(scope="module")
def key(sdk_fixture: Path) -> str:
    return (sdk_fixture / "signing_key.pub").read_text().strip()


@pytest.fixture()
def bundle(sdk_fixture: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(sdk_fixture / "tent", tmp_path / "tent"))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_signed_bundles_load_with_the_pinned_key(sdk_fixture: Path, key: str) -> None:
    for name in ("tent", "fedtta_pp", "odpfl_hn"):
        b = load_bundle(sdk_fixture / name, public_key=key)
        assert b.signed_by == bytes.fromhex(key)
    assert load_bundle(sdk_fixture / "tent", public_key=bytes.fromhex(key)).method == "TENT"
    with pytest.warns(UnverifiedSignatureWarning, match=r"is signed, but no public key was given"):
        assert load_bundle(sdk_fixture / "tent").signed_by is None  # no key: hashes only, and a warning


def test_a_bundle_loaded_without_a_key_warns_even_with_its_signature_deleted(sdk_fixture: Path, key: str,
                                                                              bundle: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_bundle(sdk_fixture / "tent", public_key=key)  # verified: no warning
    (bundle / "manifest.sig").unlink()
    _edit_manifest(bundle)  # what deleting the signature would otherwise let through without a word
    with pytest.warns(UnverifiedSignatureWarning, match=r"is not signed and no public key was given; only its "
                                                        r"sha256 hashes are"):
        assert load_bundle(bundle).manifest["hyperparameters"]["lr"] == 10.0


def _edit_manifest(root: Path) -> None:
    m = json.loads((root / "manifest.json").read_text())
    m["hyperparameters"]["lr"] = 10.0  # valid JSON, every sha256 still right: only the signature can tell
    (root / "manifest.json").write_text(json.dumps(m, indent=1))


def _swap_artifact_and_hash(root: Path) -> None:
    """An attacker replaces a graph and updates its sha256 and size in the manifest."""
    import hashlib

    target = root / "tent_step.onnx"
    target.write_bytes(b"not the graph that was signed")
    m = json.loads((root / "manifest.json").read_text())
    for a in m["artifacts"]:
        if a["file"] == target.name:
            a["sha256"], a["size"] = hashlib.sha256(target.read_bytes()).hexdigest(), target.stat().st_size
    (root / "manifest.json").write_text(json.dumps(m, indent=1))


def _claim_trusted_key(root: Path) -> None:
    """The signature record names the trusted key, but the signature bytes are not its signature."""
    rec = json.loads((root / "manifest.sig").read_text())
    rec["signature"] = rec["signature"][:-2] + ("00" if rec["signature"][-2:] != "00" else "01")
    (root / "manifest.sig").write_text(json.dumps(rec))


CASES = {
    "tampered manifest": (_edit_manifest, BundleSignatureError, "manifest.json does not match its signature"),
    "artifact swapped, hash updated": (_swap_artifact_and_hash, BundleSignatureError, "does not match its signature"),
    "tampered artifact": (lambda r: _flip(r / "tent_step.onnx"), BundleError, "sha256 does not match the manifest"),
    "missing signature": (lambda r: (r / "manifest.sig").unlink(), BundleSignatureError, "not signed"),
    "malformed signature": (lambda r: (r / "manifest.sig").write_text("{]"), BundleSignatureError,
                            "malformed signature record"),
    "forged signature bytes": (_claim_trusted_key, BundleSignatureError, "does not match its signature"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_chain_is_refused(bundle: Path, key: str, case: str) -> None:
    damage, error, message = CASES[case]
    damage(bundle)
    with pytest.raises(error, match=message) as info:
        load_bundle(bundle, public_key=key)
    record("signature", f"bundle on disk: {case}", f"refused on load ({type(info.value).__name__}: {message})")


def test_wrong_key_is_refused(bundle: Path) -> None:
    with pytest.raises(BundleSignatureError, match=r"signed by key [0-9a-f]{16}\.\.\., not by the trusted key d75a980182b10ab7"):
        load_bundle(bundle, public_key=OTHER_KEY)
    record("signature", "bundle on disk, pinned key is another key", "refused on load (BundleSignatureError)")


@pytest.mark.parametrize("bad, message", [("xyz", "64 hex characters"), ("00" * 32, "small order"),
                                          (b"\x01" * 5, "32 bytes, got 5 bytes"), (123, "hex text or 32 bytes")])
def test_bad_pinned_keys_are_refused(bundle: Path, bad: object, message: str) -> None:
    with pytest.raises(BundleSignatureError, match=message):
        load_bundle(bundle, public_key=bad)  # type: ignore[arg-type]


def test_refused_before_onnxruntime_is_loaded(bundle: Path, key: str) -> None:
    """A fresh interpreter refuses each broken bundle without ever importing onnxruntime."""
    _edit_manifest(bundle)
    code = ("import sys; from edge_sdk._bundle import load_bundle, BundleSignatureError\n"
            f"try:\n    load_bundle({str(bundle)!r}, public_key={key!r})\nexcept BundleSignatureError as e:\n"
            "    print('refused:', e)\nprint('onnxruntime loaded:', 'onnxruntime' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "refused:" in out and "onnxruntime loaded: False" in out, out
    record("signature", "tampered manifest loaded in a fresh interpreter", "refused; onnxruntime never imported")


@pytest.mark.parametrize("name", ["..", ".", "manifest.json", "../x", "/etc/passwd"])
def test_an_artifact_file_name_that_is_not_a_plain_file_is_refused(tmp_path: Path, name: str) -> None:
    manifest = {"method": "TENT", "device_step": "tent_step", "artifacts": [{"name": "forward", "file": name, "size": 1, "sha256": "0" * 64}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="invalid file name"):
        load_bundle(tmp_path)
