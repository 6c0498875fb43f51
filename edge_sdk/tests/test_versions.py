"""The device's rollback and freeze ratchet (edge_sdk._versions) and strict JSON (edge_sdk._strictjson), on their
own: no coordinator, no torch."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from edge_sdk import _strictjson as strictjson
from edge_sdk._errors import BundleExpiredError, BundleRollbackError
from edge_sdk.signing import TIME_FORMAT, Release
from edge_sdk._versions import VersionLedger

LATER = time.strftime(TIME_FORMAT, time.gmtime(time.time() + 3600))


def _release(version: int, bundle: str = "a", method: str = "TENT", expires: str = LATER) -> Release:
    return Release(bundle * 64, method, version, expires, "0" * 16)


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


def test_expired_and_corrupt_state_are_refused(tmp_path: Path) -> None:
    ledger = VersionLedger(tmp_path / "v.json")
    past = time.strftime(TIME_FORMAT, time.gmtime(time.time() - 1))
    with pytest.raises(BundleExpiredError, match=f"^b: its signed release expired at {past}"):
        ledger.check("c", _release(1, expires=past), "b")
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
