"""The coordinator's Ed25519 signing key (``cryptography``): it signs a release for every bundle (the
manifest's sha256, method, version, expiry; :mod:`edge_sdk.signing`); devices verify with
:mod:`edge_sdk.signing` against the public key they pin.

Where the private key comes from, first match wins:
1. ``$FL_SIGNING_KEY``: the 32-byte private seed as 64 hex characters;
2. ``$FL_SIGNING_KEY_FILE``: a PEM (PKCS#8) private key file;
3. ``<store>/signing_key.pem``: generated on first start (mode 0600) and reused after.

Rotation retires for good: when a key from the environment replaces the store's, the store's file is deleted and
its public key recorded in ``<store>/signing_key.retired``; a retired key is refused wherever it comes from, and a
store whose key was retired does not generate a new one when the variables are unset (devices pin the key that
replaced it): the coordinator stops with one line saying so.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Mapping

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_sdk.shared import strict_loads
from edge_sdk.signing import make_release, signature_record, write_signature
from fl_server.atomic import atomic_write_bytes

log = logging.getLogger("fl_server.service")
KEY_FILE = "signing_key.pem"
RETIRED_FILE = "signing_key.retired"  # public keys (hex), one a line, that must never sign again
OFFLINE_TTL_S = 365 * 86400  # the expiry a candidate (`fl-server export --signing-key`) states


class ManifestSigner:
    def __init__(self, private_key: Ed25519PrivateKey, source: str) -> None:
        self._key = private_key
        self.source = source
        self.public_key: bytes = private_key.public_key().public_bytes_raw()

    @property
    def public_hex(self) -> str:
        return self.public_key.hex()

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def record(self, manifest: bytes, method: str, version: int | None, expires_at: float) -> dict[str, str]:
        """The ``manifest.sig`` record for these exact manifest bytes: a signed release of ``method`` at
        ``version`` (>= 1, rising per method: the coordinator's store assigns it), valid until ``expires_at``
        (seconds since the epoch); ``version`` None: a candidate (:meth:`sign_bundle`).

        >>> signer = ManifestSigner.generate()
        >>> signer.record(b'{"method": "TENT"}', "TENT", 1, time.time() + 3600)["alg"]
        'Ed25519'
        """
        release = make_release(manifest, method, version, expires_at, self.public_key)
        return signature_record(self.public_key, release, self.sign(release))

    def sign_bundle(self, root: Path, ttl_s: float = OFFLINE_TTL_S) -> Path:
        """Write ``root/manifest.sig`` for ``root/manifest.json``, an offline export: a signed *candidate*
        without a version (:mod:`edge_sdk.signing`). ``load_bundle`` verifies it; a device's update channel never
        accepts it, since only the coordinator numbers releases: publishing the bundle makes it one."""
        manifest = (root / "manifest.json").read_bytes()
        method = str(strict_loads(manifest)["method"])
        return write_signature(root, self.record(manifest, method, None, time.time() + ttl_s))

    @classmethod
    def generate(cls) -> ManifestSigner:
        return cls(Ed25519PrivateKey.generate(), "generated")

    @classmethod
    def from_pem(cls, path: Path) -> ManifestSigner:
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: not an unencrypted PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: holds a {type(key).__name__}, not an Ed25519 private key")
        return cls(key, str(path))

    @classmethod
    def load_or_create(cls, store_dir: Path, env: Mapping[str, str] = os.environ) -> ManifestSigner:
        """The key per the precedence in the module docstring; generates ``<store>/signing_key.pem``; retires
        the store's key when the environment names another (module docstring)."""
        path = Path(store_dir) / KEY_FILE
        retired_path = path.with_name(RETIRED_FILE)
        retired = set(retired_path.read_text().split()) if retired_path.is_file() else set()
        signer = cls._from_environment(env)
        if signer is None and path.is_file():
            if path.stat().st_mode & 0o077:
                log.warning("%s is readable by others; chmod 600 it", path)
            signer = cls.from_pem(path)
        if signer is not None and signer.public_hex in retired:
            raise ValueError(f"the signing key {signer.public_hex[:16]}... ({signer.source}) was retired (listed in "
                             f"{retired_path}); use the key that replaced it")
        if signer is not None and signer.source != str(path) and path.is_file():
            stored = cls.from_pem(path)
            if stored.public_key != signer.public_key:  # rotated: the old key must not come back when env is unset
                fd = os.open(retired_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                with os.fdopen(fd, "a") as fh:
                    fh.write(stored.public_hex + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
                path.unlink()
                log.warning("signing key %s retired: %s replaced it; %s deleted", stored.public_hex, signer.source,
                            path)
        if signer is not None:
            return signer
        if retired:
            raise ValueError(f"this store's signing key was retired when FL_SIGNING_KEY or FL_SIGNING_KEY_FILE "
                             f"replaced it ({retired_path}): set that variable again (devices pin its key), or delete "
                             f"{retired_path.name} to generate a new key")
        return cls._create(path)

    @classmethod
    def _from_environment(cls, env: Mapping[str, str]) -> ManifestSigner | None:
        if env.get("FL_SIGNING_KEY"):
            try:
                seed = bytes.fromhex(env["FL_SIGNING_KEY"].strip())
                if len(seed) != 32:
                    raise ValueError(f"{len(seed)} bytes")
            except ValueError as exc:
                raise ValueError(f"FL_SIGNING_KEY must be a 32-byte seed as 64 hex characters ({exc})") from None
            return cls(Ed25519PrivateKey.from_private_bytes(seed), "$FL_SIGNING_KEY")
        if env.get("FL_SIGNING_KEY_FILE"):
            return cls.from_pem(Path(env["FL_SIGNING_KEY_FILE"]))
        return None

    @classmethod
    def _create(cls, path: Path) -> ManifestSigner:
        signer = cls.generate()
        pem = signer._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, pem, mode=0o600, fsync=True)
        signer.source = str(path)
        return signer
