"""The device's rollback and freeze ratchet (edge_sdk._versions) and strict JSON (edge_sdk._strictjson), on their
own: no coordinator, no torch."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from edge_sdk import _strictjson as strictjson
from edge_sdk._errors import BundleExpiredError, BundleRollbackError, BundleSignatureError
from edge_sdk.signing import TIME_FORMAT, Release
from edge_sdk._versions import VersionLedger

LATER = time.strftime(TIME_FORMAT, time.gmtime(time.time() + 3600))


def _release(version: int, bundle: str = "a", method: str = "TENT", expires: str = LATER, key: str = "0") -> Release:
    return Release(bundle * 64, method, version, expires, key * 16)


def test_the_ratchet_only_moves_forward_per_channel_and_method(tmp_path: Path) -> None:
    ledger = VersionLedger(tmp_path / "v.json")
    ledger.check("c", _release(2), "b")  # nothing accepted yet
    ledger.accept("c", _release(2))
    ledger.check("c", _release(2), "b")  # the same release again
    ledger.check("c", _release(3, "b"), "b")
    with pytest.raises(BundleRollbackError, match="^b: release version 1 of 'TENT' is older than version 2"):
        ledger.check("c", _release(1, "c"), "b")
    with pytest.raises(BundleRollbackError, match="version 2 of 'TENT' is older than version 2"):
        ledger.check("c", _release(2, "d"), "b")  # another bundle under a version already taken
    ledger.check("c", _release(1, method="BTFL"), "b")  # other methods and channels have their own ratchets
    ledger.check("other", _release(1), "b")
    ledger.accept("c", _release(1))  # a lower version never lowers the ratchet
    assert VersionLedger(tmp_path / "v.json").highest("c", "TENT") == (2, "a" * 64)
    assert (tmp_path / "v.json").stat().st_mode & 0o077 == 0


def test_one_ratchet_per_method_across_key_rotations(tmp_path: Path) -> None:
    """A device pinning [old, new] refuses an old-key release older than a new-key one it accepted; a key the
    device no longer pins (a compromised one that signed an inflated version) does not hold the ratchet up."""
    ledger = VersionLedger(tmp_path / "v.json")
    ledger.accept("c", _release(3, key="a"))
    ledger.accept("c", _release(7, "b", key="b"))  # after the rotation: the new key, the next versions
    with pytest.raises(BundleRollbackError, match="version 5 of 'TENT' is older than version 7"):
        ledger.check("c", _release(5, "c", key="a"), "b", keys=["a" * 16, "b" * 16])
    ledger.check("c", _release(7, "b", key="a"), "b", keys=["a" * 16, "b" * 16])  # the same release, re-signed
    ledger.accept("c", _release(10**12, "d", key="a"))  # the old key, compromised, signed a huge version
    with pytest.raises(BundleRollbackError, match="older than version 1000000000000"):
        ledger.check("c", _release(8, "e", key="b"), "b", keys=["a" * 16, "b" * 16])
    ledger.check("c", _release(8, "e", key="b"), "b", keys=["b" * 16])  # dropped from the pins: unlocked
    with pytest.raises(BundleRollbackError, match="older than version 7"):
        ledger.check("c", _release(6, "f", key="b"), "b", keys=["b" * 16])
    assert ledger.highest("c", "TENT", ["b" * 16]) == (7, "b" * 64)


def test_an_older_sdks_per_key_ratchet_carries_over(tmp_path: Path) -> None:
    """The ledger of an SDK that kept one ratchet per URL and key: its versions still count, under that key."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps({f"https://c key {'a' * 16}": {"TENT": {"version": 4, "bundle_id": "a" * 64}}}))
    ledger = VersionLedger(path)
    with pytest.raises(BundleRollbackError, match="version 3 of 'TENT' is older than version 4"):
        ledger.check("https://c", _release(3, "b", key="b"), "b", keys=["a" * 16, "b" * 16])
    ledger.accept("https://c", _release(5, "c", key="b"))
    assert json.loads(path.read_text())["https://c"]["TENT"]["a" * 16]["version"] == 4
    assert ledger.highest("https://c", "TENT") == (5, "c" * 64)


def test_a_candidate_is_never_a_release(tmp_path: Path) -> None:
    candidate = Release("a" * 64, "TENT", 0, LATER, "0" * 16, candidate=True)
    with pytest.raises(BundleSignatureError, match="^b: an offline export's candidate, not a release"):
        VersionLedger(tmp_path / "v.json").check("c", candidate, "b")


def test_expired_and_corrupt_state_are_refused(tmp_path: Path) -> None:
    ledger = VersionLedger(tmp_path / "v.json")
    past = time.strftime(TIME_FORMAT, time.gmtime(time.time() - 1))
    with pytest.raises(BundleExpiredError, match=f"^b: its signed release expired at {past}"):
        ledger.check("c", _release(1, expires=past), "b")
    ledger.check("c", _release(1, expires=past), "b", expired_ok=True)  # the device's own cache, offline
    (tmp_path / "v.json").write_text('{"c": [')
    with pytest.raises(BundleRollbackError, match="is corrupt .*no bundle is accepted; delete the file"):
        ledger.check("c", _release(5), "b")
    (tmp_path / "v.json").write_text('{"c": {"TENT": {"version": "x"}}}')
    with pytest.raises(BundleRollbackError, match="is corrupt \\(entry 'TENT'"):
        ledger.check("c", _release(5), "b")


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": Infinity}', '[-Infinity]'])
def test_strict_json_refuses_non_finite_numbers(text: str) -> None:
    with pytest.raises(ValueError, match="not strict JSON"):
        strictjson.loads(text)
    with pytest.raises(ValueError):
        strictjson.dumps({"a": float("inf")})
    assert strictjson.dumps(strictjson.finite({"e": [float("inf"), 1.5]})) == '{"e": [null, 1.5]}'
