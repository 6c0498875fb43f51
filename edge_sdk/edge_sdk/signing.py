"""Bundle signatures on the device: the detached ``manifest.sig`` next to ``manifest.json`` and its check
against a trusted Ed25519 public key (:mod:`edge_sdk._ed25519`, RFC 8032).

What is signed is a *release*: a small strict-JSON object that names the manifest by its sha256 (the bundle
id) and adds what the manifest file itself cannot say, the update channel's freshness (TUF's targets
metadata plays this role)::

    {"type": "fl-edge/release", "bundle_id": "<sha256 of manifest.json>", "method": "TENT",
     "version": 3, "expires": "2026-12-03T07:44:38Z", "key_id": "<first 16 hex of the key>"}

``version`` rises with every bundle the coordinator publishes for a method and ``expires`` bounds how long a
signed release may be presented; :class:`edge_sdk._client.EdgeClient` refuses a release older than the newest
it accepted for that method (rollback) and an expired one (freeze). The manifest lists every artifact's
sha256 and size, so the one signature covers the whole bundle: signature first (authenticity of the release),
then the manifest's hash, then each file's hash.

Only the coordinator numbers releases (one version sequence per method, kept in its store). An offline export
(``fl-server export --signing-key``) signs a *candidate* instead, ``{"type": "fl-edge/candidate", ...}`` without a
version: another role in the signed payload, as TUF separates the roles a key may sign for. ``load_bundle``
accepts a candidate (a bundle copied onto a device by hand); the update channel (``verify_manifest`` by default,
``EdgeClient.download``) never does, so an export served by a man in the middle cannot move a device's ratchet.
Publishing the export makes the coordinator sign it as a release with its own next version.

``manifest.sig`` (and the ``signature`` field of the coordinator's manifest view) is strict JSON:
``{"alg": "Ed25519", "key_id": ..., "public_key": "<64 hex>", "release": "<the release's exact JSON text>",
"signature": "<128 hex over the release text>"}``. ``public_key`` and ``key_id`` only name the signer for
error messages and key rotation; trust comes from the key the caller pins, never from the file.
"""
from __future__ import annotations

import calendar
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_sdk import _strictjson as strictjson
from edge_sdk._atomic import atomic_write_text
from edge_sdk._ed25519 import SignatureError, public_key, verify
from edge_sdk._errors import BundleSignatureError

SIGNATURE_FILE = "manifest.sig"
ALG = "Ed25519"
RELEASE_TYPE = "fl-edge/release"
CANDIDATE_TYPE = "fl-edge/candidate"  # an offline export's signature: no version, never a served release
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # UTC, whole seconds (RFC 3339)
PublicKey = bytes | str
_SHA = re.compile(r"[0-9a-f]{64}")


def parse_public_key(key: PublicKey) -> bytes:
    """A pinned key as 32 raw bytes, from raw bytes or 64 hex characters (``ed25519:`` prefix allowed);
    refuses anything that is not a valid, full-order Ed25519 point."""
    if isinstance(key, str):
        text = key.strip().removeprefix("ed25519:")
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raise BundleSignatureError(f"public key must be 64 hex characters, got {text[:80]!r}") from None
    elif isinstance(key, (bytes, bytearray)):
        raw = bytes(key)
    else:
        raise BundleSignatureError(f"public key must be hex text or 32 bytes, got {type(key).__name__}")
    try:
        public_key(raw)
    except SignatureError as exc:
        raise BundleSignatureError(f"invalid pinned public key: {exc}") from None
    return raw


def key_id(key: bytes) -> str:
    """Short, printable name of a key: its hex, abbreviated (the ``key_id`` of a release)."""
    return key.hex()[:16]


@dataclass(frozen=True)
class Release:
    """The signed statement about one bundle (see the module docstring)."""

    bundle_id: str
    method: str
    version: int  # 0 for a candidate (an offline export: the coordinator numbers it when it is published)
    expires: str  # UTC, TIME_FORMAT
    key_id: str
    candidate: bool = False

    @property
    def expires_at(self) -> float:
        """``expires`` as seconds since the epoch."""
        return float(calendar.timegm(time.strptime(self.expires, TIME_FORMAT)))

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at


def make_release(manifest: bytes, method: str, version: int | None, expires_at: float, signer_key: bytes) -> bytes:
    """The exact release bytes to sign for ``manifest`` (strict JSON, sorted keys); ``version`` None: a
    candidate (an offline export, numbered by the coordinator when it is published)."""
    if version is not None and (not isinstance(version, int) or version < 1):
        raise ValueError(f"a release version is an integer >= 1, got {version!r}")
    fields = {"bundle_id": hashlib.sha256(manifest).hexdigest(), "method": method,
              "expires": time.strftime(TIME_FORMAT, time.gmtime(expires_at)), "key_id": key_id(signer_key)}
    fields.update({"type": CANDIDATE_TYPE} if version is None else {"type": RELEASE_TYPE, "version": version})
    return strictjson.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def signature_record(signer_key: bytes, release: bytes, signature: bytes) -> dict[str, str]:
    """The ``manifest.sig`` record of a signed release."""
    return {"alg": ALG, "key_id": key_id(signer_key), "public_key": signer_key.hex(), "release": release.decode(),
            "signature": signature.hex()}


def parse_signature(record: Any, where: str) -> tuple[bytes, bytes, bytes]:
    """(signer key, 64-byte signature, release bytes) from a ``manifest.sig`` record (dict or JSON bytes)."""
    try:
        if isinstance(record, (bytes, str)):
            record = strictjson.loads(record)
        if record.get("alg") != ALG:
            raise ValueError(f"alg {record.get('alg')!r} is not {ALG}")
        signer, sig = bytes.fromhex(record["public_key"]), bytes.fromhex(record["signature"])
        release = record.get("release")
        if not isinstance(release, str):
            raise ValueError("no release (version and expiry): a signature of an older coordinator")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise BundleSignatureError(f"{where}: malformed signature record ({exc})") from None
    if len(sig) != 64 or len(signer) != 32:
        raise BundleSignatureError(f"{where}: malformed signature record (signature {len(sig)} bytes, key "
                                   f"{len(signer)} bytes; expected 64 and 32)")
    return signer, sig, release.encode()


def parse_release(release: bytes, where: str, candidate_ok: bool = False) -> Release:
    """A signed release's fields, each checked for type and form; a candidate (an offline export) only with
    ``candidate_ok``."""
    try:
        r = strictjson.loads(release)
        kind = r.get("type") if isinstance(r, dict) else None
        if kind not in (RELEASE_TYPE, CANDIDATE_TYPE):
            raise ValueError(f"not a {RELEASE_TYPE} object")
        if kind == CANDIDATE_TYPE and "version" in r:
            raise ValueError("a candidate has no version")
        out = Release(r["bundle_id"], r["method"], r["version"] if kind == RELEASE_TYPE else 0, r["expires"],
                      r["key_id"], candidate=kind == CANDIDATE_TYPE)
        if not (isinstance(out.bundle_id, str) and _SHA.fullmatch(out.bundle_id) and isinstance(out.method, str)
                and isinstance(out.key_id, str)):
            raise ValueError("bundle_id, method and key_id must be a sha256 and strings")
        if not out.candidate and (type(out.version) is not int or out.version < 1):
            raise ValueError(f"version must be an integer >= 1, got {out.version!r}")
        out.expires_at  # noqa: B018 - parses the time
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise BundleSignatureError(f"{where}: malformed signed release ({exc})") from None
    if out.candidate and not candidate_ok:
        raise BundleSignatureError(f"{where}: signed as an offline export's candidate, not a release of the "
                                   "coordinator (only the coordinator numbers releases); publish the bundle "
                                   "(fl-server publish) and download it from there")
    return out


def verify_manifest(manifest: bytes, record: Any, trusted: bytes, where: str, candidate_ok: bool = False) -> Release:
    """Check ``manifest`` (exact bytes) against its signature ``record`` under the ``trusted`` key and return
    the signed :class:`Release`; raises :class:`BundleSignatureError` saying which of missing / malformed /
    other key / altered / a candidate (unless ``candidate_ok``: a bundle on disk) it is. Freshness (version,
    expiry) is the caller's to judge."""
    if record is None:
        raise BundleSignatureError(f"{where}: the bundle is not signed (no {SIGNATURE_FILE}) but a public key "
                                   f"is pinned ({key_id(trusted)}...); refusing an unsigned bundle")
    signer, sig, release_bytes = parse_signature(record, where)
    if signer != trusted:
        raise BundleSignatureError(f"{where}: signed by key {key_id(signer)}..., not by the trusted key "
                                   f"{key_id(trusted)}...; refusing it")
    try:
        verify(trusted, release_bytes, sig)
    except SignatureError as exc:
        raise BundleSignatureError(f"{where}: the release does not match its signature ({exc}); it was "
                                   "modified after signing") from None
    release = parse_release(release_bytes, where, candidate_ok)
    if release.key_id != key_id(trusted):  # the device's ratchet is kept per key id: it must name its signer
        raise BundleSignatureError(f"{where}: the signed release names key {release.key_id[:16]!r}, not its signer "
                                   f"{key_id(trusted)}; refusing it")
    if hashlib.sha256(manifest).hexdigest() != release.bundle_id:
        raise BundleSignatureError(f"{where}: manifest.json does not match its signature (the signed release "
                                   f"names bundle {release.bundle_id[:16]}...); it was modified after signing")
    try:
        method = strictjson.loads(manifest).get("method")
    except (ValueError, AttributeError, RecursionError):
        method = None  # not a JSON object: the caller reports the malformed manifest
    if method is not None and method != release.method:
        raise BundleSignatureError(f"{where}: the signed release is for method {release.method!r}, the manifest "
                                   f"says {method!r}")
    return release


def write_signature(root: Path, record: dict[str, str]) -> Path:
    """``root/manifest.sig``, written atomically."""
    target = root / SIGNATURE_FILE
    atomic_write_text(target, strictjson.dumps(record))
    return target
