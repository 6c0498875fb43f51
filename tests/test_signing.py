"""Manifest signing: the device's pure-Python Ed25519 (edge_sdk._ed25519) against ``cryptography`` on the
RFC 8032 vectors and on random keys and messages; the coordinator's key management (fl_server.signing)."""
from __future__ import annotations

import os
import random
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edge_sdk._ed25519 import BACKEND, BACKENDS, L, SignatureError, is_valid, verify
from fl_server.signing import KEY_FILE, ManifestSigner

from test_ed25519 import VECTORS  # edge_sdk/tests (on the path via conftest.py)

SECRETS = {  # RFC 8032 section 7.1 secret keys of the vectors in edge_sdk/tests/test_ed25519.py
    "TEST 1": "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
    "TEST 2": "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
    "TEST 3": "c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
    "TEST 1024": "f5e5767cf153319517630f226876b86c8160cc583bc013744c6bf255f5cc0ee5",
    "TEST SHA(abc)": "833fe62409237b9d62ec77587520911e9a759cec1d19755b7da901b96dca3d42",
}


@pytest.mark.parametrize("name", list(SECRETS))
def test_cryptography_reproduces_the_rfc_vectors(name: str) -> None:
    """The transcribed vectors are the RFC's: OpenSSL derives the same key and the same (deterministic)
    signature from the secret."""
    key, msg, sig = VECTORS[name]
    sk = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(SECRETS[name]))
    assert sk.public_key().public_bytes_raw() == key
    assert sk.sign(msg) == sig


def test_fast_paths_are_installed_and_preferred() -> None:
    """The coordinator's venv has both libraries, so edge_sdk/tests' per-backend RFC 8032 test covers the
    fast paths here (the SDK-only venv covers the pure fallback alone)."""
    assert list(BACKENDS) == ["cryptography", "pynacl", "pure"] and BACKEND == "cryptography"


def test_backends_agree_on_random_signatures() -> None:
    rng = random.Random(3)
    for i in range(40):
        sk = Ed25519PrivateKey.generate()
        pk, msg = sk.public_key().public_bytes_raw(), rng.randbytes(rng.choice([0, 1, 64, 1000]))
        sig = bytearray(sk.sign(msg))
        if i % 2:
            sig[rng.randrange(64)] ^= 1 << rng.randrange(8)
        verdicts = {b: is_valid(pk, msg, bytes(sig), backend=b) for b in BACKENDS}
        assert set(verdicts.values()) == {i % 2 == 0}, (i, verdicts)


def test_random_signatures_agree_with_cryptography() -> None:
    rng = random.Random(9)
    for i in range(60):
        sk = Ed25519PrivateKey.generate()
        pk = sk.public_key().public_bytes_raw()
        msg = rng.randbytes(rng.choice([0, 1, 31, 64, 1000, 5000]))
        sig = sk.sign(msg)
        verify(pk, msg, sig)
        bad = bytearray(sig)
        bad[rng.randrange(64)] ^= 1 << rng.randrange(8)
        theirs = _cryptography_accepts(pk, msg, bytes(bad))
        assert is_valid(pk, msg, bytes(bad)) is theirs is False, i
        other = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
        assert not is_valid(other, msg, sig)
        if msg:
            assert not is_valid(pk, msg[:-1], sig)
        s = int.from_bytes(sig[32:], "little")  # S + L: the same group element, refused by both
        malleated = sig[:32] + (s + L).to_bytes(32, "little")
        assert not _cryptography_accepts(pk, msg, malleated)
        with pytest.raises(SignatureError, match="S >= L"):
            verify(pk, msg, malleated)


def _cryptography_accepts(pk: bytes, msg: bytes, sig: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        Ed25519PublicKey.from_public_bytes(pk).verify(sig, msg)
    except InvalidSignature:
        return False
    return True


def test_key_generated_once_private_and_reused(tmp_path: Path) -> None:
    first = ManifestSigner.load_or_create(tmp_path, env={})
    path = tmp_path / KEY_FILE
    assert first.source == str(path) and stat.S_IMODE(path.stat().st_mode) == 0o600
    again = ManifestSigner.load_or_create(tmp_path, env={})
    assert again.public_key == first.public_key
    verify(first.public_key, b"manifest bytes", again.sign(b"manifest bytes"))


def test_key_from_environment(tmp_path: Path) -> None:
    seed = bytes(range(32))
    s = ManifestSigner.load_or_create(tmp_path, env={"FL_SIGNING_KEY": seed.hex()})
    assert s.public_key == Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()
    assert not (tmp_path / KEY_FILE).exists()  # nothing generated when a key is given
    pem = tmp_path / "k.pem"
    pem.write_bytes(Ed25519PrivateKey.from_private_bytes(seed).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    assert ManifestSigner.load_or_create(tmp_path, env={"FL_SIGNING_KEY_FILE": str(pem)}).public_key == s.public_key
    with pytest.raises(ValueError, match="64 hex characters"):
        ManifestSigner.load_or_create(tmp_path, env={"FL_SIGNING_KEY": "abcd"})
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(ValueError, match="not an unencrypted PEM private key"):
        ManifestSigner.load_or_create(tmp_path, env={"FL_SIGNING_KEY_FILE": str(tmp_path / "junk.pem")})
    from cryptography.hazmat.primitives.asymmetric import ec

    (tmp_path / "ec.pem").write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(ValueError, match="not an Ed25519 private key"):
        ManifestSigner.load_or_create(tmp_path, env={"FL_SIGNING_KEY_FILE": str(tmp_path / "ec.pem")})


def test_signed_export_roundtrip(tmp_path: Path) -> None:
    """write_bundle(signer=...) writes manifest.sig; the SDK verifies it with the public key only."""
    import numpy as np

    from edge_sdk._bundle import BundleSignatureError, load_bundle
    from fl_server.export.bundle import write_bundle

    signer = ManifestSigner.generate()
    dest = write_bundle(tmp_path / "b", {}, {"params": {"w": np.ones((2, 2), np.float32)}}, "FedAvg", {},
                        signer=signer)
    assert load_bundle(dest, public_key=signer.public_hex).signed_by == signer.public_key
    unsigned = write_bundle(tmp_path / "u", {}, {"params": {"w": np.ones(2, np.float32)}}, "FedAvg", {})
    with pytest.raises(BundleSignatureError, match="not signed"):
        load_bundle(unsigned, public_key=signer.public_key)
    assert not [p for p in os.listdir(tmp_path) if p.startswith('.')]  # no staging left
