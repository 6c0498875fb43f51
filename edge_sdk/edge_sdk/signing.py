"""Bundle signatures on the device: the detached ``manifest.sig`` next to ``manifest.json`` and the check of
a manifest's exact bytes against a trusted Ed25519 public key (:mod:`edge_sdk.ed25519`, RFC 8032).

The manifest lists every artifact's sha256 and size, so one signature over its bytes covers the whole
bundle: signature first (authenticity of the manifest), then the hashes (integrity of each file).

``manifest.sig`` (and the ``signature`` field of the coordinator's manifest view) is JSON:
``{"alg": "Ed25519", "public_key": "<64 hex>", "signature": "<128 hex>"}``. ``public_key`` there only
names the signer for error messages; trust comes from the key the caller pins, never from the file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from edge_sdk.ed25519 import SignatureError, public_key, verify
from edge_sdk.errors import BundleSignatureError

SIGNATURE_FILE = "manifest.sig"
ALG = "Ed25519"
PublicKey = bytes | str


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
    """Short, printable name of a key: its hex, abbreviated."""
    return key.hex()[:16]


def signature_record(signer_key: bytes, signature: bytes) -> dict[str, str]:
    return {"alg": ALG, "public_key": signer_key.hex(), "signature": signature.hex()}


def parse_signature(record: Any, where: str) -> tuple[bytes, bytes]:
    """(signer key, 64-byte signature) from a ``manifest.sig`` record (dict or JSON bytes)."""
    try:
        if isinstance(record, (bytes, str)):
            record = json.loads(record)
        if record.get("alg") != ALG:
            raise ValueError(f"alg {record.get('alg')!r} is not {ALG}")
        signer, sig = bytes.fromhex(record["public_key"]), bytes.fromhex(record["signature"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BundleSignatureError(f"{where}: malformed signature record ({exc})") from None
    if len(sig) != 64 or len(signer) != 32:
        raise BundleSignatureError(f"{where}: malformed signature record (signature {len(sig)} bytes, key "
                                   f"{len(signer)} bytes; expected 64 and 32)")
    return signer, sig


def verify_manifest(manifest: bytes, record: Any, trusted: bytes, where: str) -> None:
    """Check ``manifest`` (exact bytes) against its signature ``record`` under the ``trusted`` key; raises
    :class:`BundleSignatureError` saying which of missing / malformed / other key / altered it is."""
    if record is None:
        raise BundleSignatureError(f"{where}: the bundle is not signed (no {SIGNATURE_FILE}) but a public key "
                                   f"is pinned ({key_id(trusted)}...); refusing an unsigned bundle")
    signer, sig = parse_signature(record, where)
    if signer != trusted:
        raise BundleSignatureError(f"{where}: signed by key {key_id(signer)}..., not by the trusted key "
                                   f"{key_id(trusted)}...; refusing it")
    try:
        verify(trusted, manifest, sig)
    except SignatureError as exc:
        raise BundleSignatureError(f"{where}: manifest.json does not match its signature ({exc}); it was "
                                   "modified after signing") from None


def write_signature(root: Path, record: dict[str, str]) -> Path:
    """``root/manifest.sig``, written atomically."""
    target = root / SIGNATURE_FILE
    tmp = target.with_name(f".{SIGNATURE_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, target)
    return target
