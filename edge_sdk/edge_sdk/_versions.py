"""Rollback and freeze protection on the device (TUF's, for one signed release per bundle): the highest
release version accepted per update channel (EdgeClient: the coordinator's URL) and method, kept in one small
file.

    ledger = VersionLedger(cache_dir / "accepted_versions.json")
    ledger.check("https://coordinator", release, "bundle ...", keys=[...])  # BundleRollbackError / ...Expired...
    ...  # fetch and verify the bundle
    ledger.accept("https://coordinator", release)                           # remembered from now on

One ratchet per method, across key rotations: the coordinator numbers releases in its store, whatever key signs
them, so a device pinning [old, new] refuses an old-key release older than a new-key one it accepted. Each
accepted version is remembered under the key that signed it (the release's ``key_id``) and ``keys`` names the
keys the device still trusts: a key dropped from the pinned list (say, a compromised one that signed an inflated
version) no longer holds the ratchet up. A release older than the newest accepted, or of the same version but
another bundle, is refused; so is an expired one, unless ``expired_ok`` (the device's own cached bundle while
the coordinator is unreachable). The file is written atomically (temporary file, fsync, rename) and only this
user can read it: a crash leaves the old or the new state, never a torn one. A device whose file is deleted
accepts any unexpired release again (as on first use)."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Iterable

from edge_sdk import _strictjson as strictjson
from edge_sdk._atomic import atomic_write_text
from edge_sdk._errors import BundleExpiredError, BundleRollbackError, BundleSignatureError
from edge_sdk.signing import Release

__all__ = ["VersionLedger"]
_PER_KEY_CHANNEL = re.compile(r"(.+) key ([0-9a-f]{16})")  # an older SDK kept one ratchet per URL and key


class VersionLedger:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def _read(self) -> dict[str, dict[str, dict[str, dict[str, object]]]]:
        """channel -> method -> key id -> {"version", "bundle_id", "accepted"}."""
        if not self.path.is_file():
            return {}
        try:
            data = strictjson.loads(self.path.read_bytes())
            if not isinstance(data, dict) or not all(isinstance(m, dict) and all(isinstance(e, dict) for e in
                                                                                 m.values()) for m in data.values()):
                raise ValueError("not an object of objects")
        except (ValueError, RecursionError) as exc:
            # refusing beats forgetting: an empty ledger would accept any old release again
            raise BundleRollbackError(f"{self.path} is corrupt ({exc}); the versions this device accepted are "
                                      "unknown, so no bundle is accepted; delete the file to start over") from None
        out: dict[str, dict[str, dict[str, dict[str, object]]]] = {}
        for channel, methods in data.items():
            legacy = _PER_KEY_CHANNEL.fullmatch(channel)
            for method, entry in methods.items():
                if legacy:  # {"<url> key <id>": {method: entry}} -> {"<url>": {method: {id: entry}}}
                    out.setdefault(legacy[1], {}).setdefault(method, {})[legacy[2]] = entry
                else:
                    out.setdefault(channel, {}).setdefault(method, {}).update(entry)
        return out

    def highest(self, channel: str, method: str, keys: Iterable[str] | None = None) -> tuple[int, str] | None:
        """(version, bundle id) of the newest release accepted for ``method`` on ``channel`` under any of
        ``keys`` (key ids; None: any key); None if none."""
        wanted = None if keys is None else set(keys)
        best: tuple[int, str] | None = None
        for key, entry in self._read().get(channel, {}).get(method, {}).items():
            try:
                seen = int(entry["version"]), str(entry["bundle_id"])  # type: ignore[call-overload]
            except (KeyError, ValueError, TypeError) as exc:
                raise BundleRollbackError(f"{self.path} is corrupt (entry {method!r}: {exc}); delete the file to "
                                          "start over") from None
            if (wanted is None or key in wanted) and (best is None or seen[0] > best[0]):
                best = seen
        return best

    def check(self, channel: str, release: Release, where: str, keys: Iterable[str] | None = None,
              now: float | None = None, expired_ok: bool = False) -> None:
        """Raise unless ``release`` is a release (not a candidate), unexpired (or ``expired_ok``) and not older
        than what ``channel`` gave before under ``keys`` (the key ids still trusted; None: any)."""
        if release.candidate:
            raise BundleSignatureError(f"{where}: an offline export's candidate, not a release of the coordinator; "
                                       "refusing it")
        if release.expired(now) and not expired_ok:
            raise BundleExpiredError(f"{where}: its signed release expired at {release.expires} (a stale or "
                                     "replayed manifest); refusing it")
        seen = self.highest(channel, release.method, keys)
        if seen is None:
            return
        version, bundle_id = seen
        if release.version < version or (release.version == version and release.bundle_id != bundle_id):
            raise BundleRollbackError(f"{where}: release version {release.version} of {release.method!r} is "
                                      f"older than version {version} this device already accepted (a replayed "
                                      "older bundle); refusing it")

    def accept(self, channel: str, release: Release) -> None:
        """Remember ``release`` as the newest of its method on ``channel`` under its key (a lower version is
        ignored)."""
        seen = self.highest(channel, release.method, [release.key_id])
        if seen is not None and seen[0] >= release.version:
            return
        data = self._read()  # an older SDK's entries are rewritten in this form
        data.setdefault(channel, {}).setdefault(release.method, {})[release.key_id] = {
            "version": release.version, "bundle_id": release.bundle_id,
            "accepted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, strictjson.dumps(data, indent=1), mode=0o600, fsync=True)
