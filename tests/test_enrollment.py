"""Sybil resistance (issue 36, defect 8), against a real coordinator: joining needs an operator-issued
enrollment token (FL_SERVE_ENROLLMENT=token), one enrollment's weight in the global DLE is bounded, and tokens
minted by joining share their address's and their enrollment's rate limit."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from coordinator_proc import ADMIN, UNSERVED_BTFL, Coordinator, auth, start_copy
from edge_sdk._client import EdgeClient

pytestmark = pytest.mark.timeout(600)
ENV = {"FL_SERVE_ENROLLMENT": "token", "FL_SERVE_DLE_PER_SOURCE": "2", "FL_SERVE_TOKEN_RATE": "0.001",
       "FL_SERVE_TOKEN_BURST": "3", "FL_SERVE_ADDRESS_RATE": "0.001", "FL_SERVE_ADDRESS_BURST": "7"}


@pytest.fixture()
def server(trained_store: Path, tmp_path: Path) -> Iterator[Coordinator]:
    coord = start_copy(trained_store, tmp_path / "store", env=ENV)
    yield coord
    coord.stop()


def _join(url: str, token: str | None) -> httpx.Response:
    return httpx.post(f"{url}/v1/clients", json={"enrollment_token": token}, timeout=30)


def test_enrollment_bounds_sybils(server: Coordinator, tmp_path: Path) -> None:
    cache = tmp_path / "device"
    url = server.url
    r = _join(url, None)  # joining was open to anyone
    assert (r.status_code, r.json()["detail"]) == (401, "joining needs an enrollment token from the operator "
                                                        "(enrollment_token; FL_SERVE_ENROLLMENT=token)")
    r = _join(url, "fle_forged")
    assert (r.status_code, r.json()["detail"]) == (403, "unknown enrollment token")
    assert httpx.post(f"{url}/v1/enrollments", json={"uses": 4}, timeout=30).status_code == 401  # admin only
    assert httpx.post(f"{url}/v1/enrollments", json={"uses": "4"}, headers=auth(ADMIN), timeout=30).status_code == 422
    enrollment = httpx.post(f"{url}/v1/enrollments", json={"uses": 4}, headers=auth(ADMIN), timeout=30).json()
    tokens = []
    for _ in range(3):
        r = _join(url, enrollment["token"])
        assert r.status_code == 201, r.text
        tokens.append(r.json()["token"])
    key = httpx.get(f"{url}/v1/signing-key", timeout=30).json()["public_key"]
    device = EdgeClient(url, cache_dir=cache, public_key=key)  # the device SDK presents the token too
    tokens.append(device.join(enrollment_token=enrollment["token"]).token)
    r = _join(url, enrollment["token"])
    assert (r.status_code, r.json()["detail"]) == (
        403, "this enrollment token is used up, expired or revoked; ask the operator for another")

    dle_url = f"{url}/v1/btfl/dle"
    assert [httpx.get(dle_url, headers=auth(t), timeout=30).status_code for t in tokens] == [404] * 4
    body = {"freqs": [[0.5, 0.5], [0.25, 0.75]], "num_samples": 4, "bundle_id": UNSERVED_BTFL}
    codes = [httpx.post(dle_url, json=body, headers=auth(t), timeout=30) for t in tokens[:3]]
    assert [r.status_code for r in codes] == [200, 200, 403]  # one enrollment's weight is bounded
    assert codes[2].json()["detail"] == ("2 clients of this enrollment have a DLE in the aggregate already "
                                         "(FL_SERVE_DLE_PER_SOURCE): one source's weight is bounded")
    # 7 requests from this address so far: the fourth token still has 2 of its own 3, but the address has none
    r = httpx.get(dle_url, headers=auth(tokens[3]), timeout=30)
    assert r.status_code == 429 and r.json()["detail"].startswith(
        "rate limit exceeded for this address (0.001 requests/s, burst 7)")
