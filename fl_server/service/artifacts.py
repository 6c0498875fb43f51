"""Content-addressed artifact store: every file lives at ``objects/<sha256[:2]>/<sha256>``, written once,
atomically (temp file + fsync + rename), so an address always names the same, complete bytes."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from edge_sdk.bundle import sha256_file

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

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
        target = self.path(digest)
        if target.is_file():
            return digest
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
                shutil.copyfileobj(inp, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return digest

    def put_bytes(self, data: bytes) -> str:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".bytes-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            return self.put_file(Path(tmp))
        finally:
            Path(tmp).unlink(missing_ok=True)
