"""Content-addressed artifact store: every file lives at ``objects/<sha256[:2]>/<sha256>``, written once,
atomically (temp file + fsync + rename), so an address always names the same, complete bytes.

The disk may still change them (bit rot, an operator's mistake, an attacker with file access), so nothing is
served or signed unchecked: :meth:`ArtifactStore.read` and :meth:`ArtifactStore.verify` hash the bytes against
their address, and an object that fails is moved to ``objects/quarantine/`` and remembered in
:attr:`ArtifactStore.quarantined` (the service then reports the methods that need it as degraded). A verified
file is re-hashed only when its (size, mtime, inode) changes, or by :meth:`ArtifactStore.recheck`."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from edge_sdk.shared import sha256_file
from fl_server.atomic import atomic_path, move

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
log = logging.getLogger("fl_server.service")


class Corrupt(Exception):
    """An object whose bytes no longer hash to its address (or that is missing): it is quarantined."""

    def __init__(self, sha256: str) -> None:
        super().__init__(f"object {sha256} failed its integrity check (its bytes do not hash to its address) "
                         "and is quarantined")
        self.sha256 = sha256


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.quarantined: set[str] = set()
        self._verified: dict[str, tuple[int, int, int]] = {}  # sha256 -> stat signature when it last hashed right
        self._lock = threading.Lock()

    def _quarantine(self, sha256: str) -> None:
        path = self.path(sha256)
        if path.is_file():
            (self.root / "quarantine").mkdir(exist_ok=True)
            move(path, self.root / "quarantine" / sha256)
        with self._lock:
            self._verified.pop(sha256, None)
            self.quarantined.add(sha256)
        log.error("object %s failed its integrity check: quarantined in %s", sha256, self.root / "quarantine")

    def read(self, sha256: str) -> bytes:
        """The object's bytes, checked against their address; raises :class:`Corrupt` (and quarantines it).

        Example: ``store.read(store.put_bytes(b"x")) == b"x"``"""
        if sha256 in self.quarantined:
            raise Corrupt(sha256)
        try:
            with open(self.path(sha256), "rb") as fh:
                st, data = os.fstat(fh.fileno()), fh.read()
        except FileNotFoundError:
            self._quarantine(sha256)
            raise Corrupt(sha256) from None
        if hashlib.sha256(data).hexdigest() != sha256:
            self._quarantine(sha256)
            raise Corrupt(sha256)
        with self._lock:
            self._verified[sha256] = _signature(st)
        return data

    def verify(self, sha256: str, force: bool = False) -> None:
        """Check the file on disk (hashed only if it changed since its last check, or ``force``); raises
        :class:`Corrupt` (and quarantines it)."""
        if sha256 in self.quarantined:
            raise Corrupt(sha256)
        try:
            st = os.stat(self.path(sha256))
        except FileNotFoundError:
            self._quarantine(sha256)
            raise Corrupt(sha256) from None
        if not force and self._verified.get(sha256) == _signature(st):
            return
        if sha256_file(self.path(sha256)) != sha256:
            self._quarantine(sha256)
            raise Corrupt(sha256)
        with self._lock:
            self._verified[sha256] = _signature(st)

    def recheck(self, shas: set[str]) -> set[str]:
        """Re-hash every object of ``shas`` (a periodic scrub); a quarantined object whose good bytes were
        restored at its address is released. Returns the objects quarantined now."""
        for sha256 in sorted(shas):
            if sha256 in self.quarantined and self.path(sha256).is_file() and sha256_file(self.path(sha256)) == sha256:
                with self._lock:
                    self.quarantined.discard(sha256)
                log.warning("object %s restored: released from quarantine", sha256)
            try:
                self.verify(sha256, force=True)
            except Corrupt:
                pass
        return set(self.quarantined)

    def path(self, sha256: str) -> Path:
        if not SHA256_RE.match(sha256):
            raise ValueError("an artifact address is 64 lowercase hex characters (a sha256)")
        return self.root / sha256[:2] / sha256

    def has(self, sha256: str) -> bool:
        return SHA256_RE.match(sha256) is not None and self.path(sha256).is_file()

    def put_file(self, src: Path, expected: str | None = None) -> str:
        """Copy ``src`` in under its sha256 (checked against ``expected`` when given); returns the hash."""
        digest = sha256_file(src)
        if expected is not None and digest != expected:
            raise ValueError(f"{src}: sha256 {digest} does not match the manifest's {expected}")
        return self._put(digest, lambda tmp: shutil.copyfile(src, tmp))

    def put_bytes(self, data: bytes) -> str:
        return self._put(hashlib.sha256(data).hexdigest(), lambda tmp: tmp.write_bytes(data))

    def _put(self, digest: str, write: Callable[[Path], object]) -> str:
        """The object ``digest``, which ``write`` puts into a temporary file, written (fsynced) unless its good
        bytes are already at its address; returns ``digest``."""
        target = self.path(digest)
        if target.is_file() and sha256_file(target) == digest:
            return digest
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target, mode=0o600, fsync=True) as tmp:
            write(tmp)
        with self._lock:
            self.quarantined.discard(digest)  # good bytes are back at the address
        return digest
