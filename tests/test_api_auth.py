"""Auth of the coordinator API: tokens stored only as hashes, compared in constant time, scopes enforced,
and a client can neither read nor change another client's state."""
from __future__ import annotations

import hashlib
import hmac
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from coordinator_proc import ADMIN, UNSERVED_BTFL, Coordinator, auth, join, start_copy
from fl_server.service.store import Store

pytestmark = pytest.mark.timeout(600)  # the first test of a session trains the shared store


@pytest.fixture(scope="module")
def server(trained_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    coord = start_copy(trained_store, tmp_path_factory.mktemp("auth") / "store")
    yield coord
    coord.stop()


def test_tokens_are_stored_hashed(server: Coordinator) -> None:
    c = join(server.url)
    db = server.store / "coordinator.sqlite3"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("SELECT hash, scope, client_id FROM tokens").fetchall()
    by_hash = {h: (scope, cid) for h, scope, cid in rows}
    assert by_hash[hashlib.sha256(c["token"].encode()).hexdigest()] == ("client", c["client_id"])
    assert by_hash[hashlib.sha256(ADMIN.encode()).hexdigest()] == ("admin", None)
    # neither token appears anywhere in the database files (main file and write-ahead log)
    raw = b"".join(p.read_bytes() for p in server.store.glob("coordinator.sqlite3*"))
    assert c["token"].encode() not in raw and ADMIN.encode() not in raw
    assert (server.store / "admin_token").exists() is False  # FL_ADMIN_TOKEN set: no generated file


def test_token_lookup_compares_in_constant_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored hash is compared with hmac.compare_digest (spied on, the real one still decides)."""
    calls: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    store = Store(tmp_path / "s.sqlite3")
    try:
        token = store.add_token("client", "c1")
        digest = hashlib.sha256(token.encode()).hexdigest()
        assert store.lookup_token(token) == ("client", "c1")
        assert calls == [(digest, digest)]
        assert store.lookup_token(token + "x") is None and store.lookup_token(token[:-1]) is None
    finally:
        store.close()


def test_scopes(server: Coordinator) -> None:
    c = join(server.url)
    client_only = [("POST", "/v1/hypernetwork/generate", {"embedding": [0.0], "bundle_id": UNSERVED_BTFL}),
                   ("GET", "/v1/btfl/dle", None),
                   ("POST", "/v1/btfl/dle", {"freqs": [[0.5, 0.5]], "num_samples": 1, "bundle_id": UNSERVED_BTFL})]
    admin_only = [("GET", "/v1/jobs", None), ("GET", "/v1/jobs/x", None), ("POST", "/v1/jobs", {"rounds": 1})]
    missing = {"detail": "missing bearer token (Authorization: Bearer <token>)"}
    for method, path, body in client_only + admin_only:
        url = server.url + path
        r = httpx.request(method, url, json=body, timeout=30)
        assert (r.status_code, r.json(), r.headers["WWW-Authenticate"]) == (401, missing, "Bearer"), path
        r = httpx.request(method, url, json=body, headers={"Authorization": f"Basic {c['token']}"}, timeout=30)
        assert (r.status_code, r.json()) == (401, missing), path
        r = httpx.request(method, url, json=body, headers=auth("flc_" + "A" * 43), timeout=30)
        assert (r.status_code, r.json()) == (401, {"detail": "unknown bearer token"}), path
        r = httpx.request(method, url, json=body, headers=auth(c["token"] + "x" * 600), timeout=30)
        assert (r.status_code, r.json()) == (401, {"detail": "unknown bearer token (over 512 characters)"}), path
    for method, path, body in admin_only:
        r = httpx.request(method, server.url + path, json=body, headers=auth(c["token"]), timeout=30)
        assert (r.status_code, r.json()) == (403, {"detail": "this endpoint needs the admin token"}), path
    for method, path, body in client_only:
        r = httpx.request(method, server.url + path, json=body, headers=auth(ADMIN), timeout=30)
        assert (r.status_code, r.json()) == (403, {"detail": "this endpoint needs a client token (join with POST "
                                                             "/v1/clients)"}), path


def test_a_client_cannot_touch_another_clients_dle(server: Coordinator) -> None:
    """DLE uploads are keyed by the token's client: a client id in the body is rejected, and a client's
    upload replaces only its own DLE."""
    url = f"{server.url}/v1/btfl/dle"
    a, b = join(server.url), join(server.url)
    dle_a, dle_b = np.tile([0.25, 0.75], (8, 1)), np.tile([0.5, 0.5], (8, 1))
    named = {"bundle_id": UNSERVED_BTFL}
    r = httpx.post(url, json={"freqs": dle_a.tolist(), "num_samples": 10, "client_id": b["client_id"], **named},
                   headers=auth(a["token"]), timeout=30)
    assert (r.status_code, r.json()["detail"][0]["loc"], r.json()["detail"][0]["type"]) == (
        422, ["body", "client_id"], "extra_forbidden")
    assert httpx.post(url, json={"freqs": dle_a.tolist(), "num_samples": 10, **named}, headers=auth(a["token"]),
                      timeout=30).status_code == 200
    r = httpx.post(url, json={"freqs": dle_b.tolist(), "num_samples": 30, **named}, headers=auth(b["token"]), timeout=30)
    assert r.json()["clients"] == 2
    np.testing.assert_allclose(r.json()["others_dle"], dle_a)
    # a uploads again: its own DLE is replaced, b's stays, the count stays 2
    r = httpx.post(url, json={"freqs": dle_b.tolist(), "num_samples": 10, **named}, headers=auth(a["token"]), timeout=30)
    assert r.json()["clients"] == 2
    np.testing.assert_allclose(r.json()["others_dle"], dle_b)  # b's, untouched
    np.testing.assert_allclose(r.json()["global_dle"], dle_b)
    view_b = httpx.get(url, headers=auth(b["token"]), timeout=30).json()
    np.testing.assert_allclose(view_b["others_dle"], dle_b)  # a's latest, seen from b
    with sqlite3.connect(f"file:{server.store / 'coordinator.sqlite3'}?mode=ro", uri=True) as con:
        owners = {cid: n for cid, n in con.execute("SELECT client_id, num_samples FROM dles")}
    assert owners == {a["client_id"]: 10, b["client_id"]: 30}


def test_a_replaced_admin_token_stops_working(tmp_path: Path) -> None:
    """The operator's admin token is the only one: setting another revokes it; client tokens stay."""
    store = Store(tmp_path / "s.sqlite3")
    try:
        old, client = "old-operator-token-0123", store.add_token("client", "c1")
        generated = store.add_token("admin")
        store.set_admin_token(old)
        assert store.lookup_token(old) == ("admin", None) and store.lookup_token(generated) is None
        store.set_admin_token("new-operator-token-4567")
        assert store.lookup_token(old) is None and store.lookup_token("new-operator-token-4567") == ("admin", None)
        assert store.lookup_token(client) == ("client", "c1")
    finally:
        store.close()
