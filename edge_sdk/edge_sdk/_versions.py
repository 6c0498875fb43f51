"""Rollback and freeze protection on the device (TUF's, for one signed release per bundle): the highest
release version accepted per update channel (EdgeClient: the coordinator's URL and signing key) and method,
kept in one small file.

    ledger = VersionLedger(cache_dir / "accepted_versions.json")
    ledger.check("https://coordinator", release, "bundle ...")   # BundleRollbackError / BundleExpiredError
    ...  # fetch and verify the bundle
    ledger.accept("https://coordinator", release)                # remembered from now on

A release older than the newest accepted, or of the same version but another bundle, is refused; so is an
expired one. The file is written atomically (temporary file, fsync, rename) and only this user can read it: a
crash leaves the old or the new state, never a torn one. A device whose file is deleted accepts any
unexpired release again (as on first use)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from edge_sdk import _strictjson as strictjson
from edge_sdk._errors import BundleExpiredError, BundleRollbackError
from edge_sdk.signing import Release

__all__ = ["VersionLedger"]


class VersionLedger:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def _read(self) -> dict[str, dict[str, dict[str, object]]]:
        if not self.path.is_file():
            return {}
        try:
            data = strictjson.loads(self.path.read_bytes())
            if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
                raise ValueError("not an object of objects")
        except (ValueError, RecursionError) as exc:
            # refusing beats forgetting: an empty ledger would accept any old release again
            raise BundleRollbackError(f"{self.path} is corrupt ({exc}); the versions this device accepted are "
                                      "unknown, so no bundle is accepted; delete the file to start over") from None
        return data

    def highest(self, channel: str, method: str) -> tuple[int, str] | None:
        """(version, bundle id) of the newest release accepted for ``method`` on ``channel``; None if none."""
        entry = self._read().get(channel, {}).get(method)
        if entry is None:
            return None
        try:
            return int(entry["version"]), str(entry["bundle_id"])
        except (KeyError, ValueError, TypeError) as exc:
            raise BundleRollbackError(f"{self.path} is corrupt (entry {method!r}: {exc}); delete the file to "
                                      "start over") from None

    def check(self, channel: str, release: Release, where: str, now: float | None = None) -> None:
        """Raise unless ``release`` is unexpired and not older than what ``channel`` gave before."""
        if release.expired(now):
            raise BundleExpiredError(f"{where}: its signed release expired at {release.expires} (a stale or "
                                     "replayed manifest); refusing it")
        seen = self.highest(channel, release.method)
        if seen is None:
            return
        version, bundle_id = seen
        if release.version < version or (release.version == version and release.bundle_id != bundle_id):
            raise BundleRollbackError(f"{where}: release version {release.version} of {release.method!r} is "
                                      f"older than version {version} this device already accepted (a replayed "
                                      "older bundle); refusing it")

    def accept(self, channel: str, release: Release) -> None:
        """Remember ``release`` as the newest of its method on ``channel`` (a lower version is ignored)."""
        seen = self.highest(channel, release.method)
        if seen is not None and seen[0] >= release.version:
            return
        data = self._read()
        data.setdefault(channel, {})
        data[channel][release.method] = {"version": release.version, "bundle_id": release.bundle_id,
                                         "accepted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(strictjson.dumps(data, indent=1))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
