"""Rate limiting: the token bucket itself (with an explicit clock), the defaults against the load benchmark,
and a real server driven past its limits (429 with Retry-After, then recovery)."""
from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import httpx
import pytest
from fastapi import HTTPException

from coordinator_proc import ADMIN, UNSERVED_BTFL, Coordinator, auth, join, start, start_copy
from fl_server.service.config import ServiceConfig
from fl_server.service.ratelimit import Buckets, Limit
from fl_server.service.store import RECLAIM_BATCH, RegistryFull, Store

pytestmark = pytest.mark.timeout(600)  # the first test of a session trains the shared store


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_bucket_burst_refill_and_retry_after() -> None:
    clock = Clock()
    b = Buckets(Limit(rate=2.0, burst=3), clock=clock)
    assert [b.take("k") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take("k") == pytest.approx(0.5)  # empty: one request refills in 1/rate s
    assert b.take("other") == 0.0  # buckets are per key
    clock.t += 0.5
    assert b.take("k") == 0.0 and b.take("k") == pytest.approx(0.5)
    clock.t += 60  # refills to the burst, not beyond
    assert [b.take("k") for _ in range(4)][-1] > 0
    with pytest.raises(HTTPException) as exc:
        b.check("k", "this token")
    assert (exc.value.status_code, exc.value.headers, exc.value.detail) == (
        429, {"Retry-After": "1"}, "rate limit exceeded for this token (2 requests/s, burst 3); retry after 1 s")


def test_bucket_disabled_and_bounded() -> None:
    clock = Clock()
    assert all(Buckets(Limit(0, 5), clock=clock).take("k") == 0.0 for _ in range(100))
    b = Buckets(Limit(1.0, 1), max_keys=2, clock=clock)
    b.take("a"), b.take("b"), b.take("c")  # "a" (least recently used) is dropped: its bucket is full again
    assert b.take("a") == 0.0 and b.take("c") > 0


def test_client_cap_setting(tmp_path: Path) -> None:
    assert ServiceConfig(store_dir=tmp_path, default_methods=()).max_clients == 1_000_000
    with pytest.raises(ValueError, match=r"^FL_SERVE_MAX_CLIENTS must be >= 0 \(0: no cap\)$"):
        ServiceConfig(store_dir=tmp_path, default_methods=(), max_clients=-1)
    assert ServiceConfig(store_dir=tmp_path, default_methods=()).unused_client_ttl_s == 86400
    with pytest.raises(ValueError, match=r"^FL_SERVE_UNUSED_CLIENT_TTL_S must be >= 0 \(0: never reclaim unused "
                                         r"clients\)$"):
        ServiceConfig(store_dir=tmp_path, default_methods=(), unused_client_ttl_s=float("nan"))


def test_a_full_registry_reclaims_only_old_unused_clients(tmp_path: Path) -> None:
    """At the cap a join deletes the clients (and tokens) that never authenticated and joined over the TTL ago;
    one that used its token stays; a store of the previous version counts its clients as used (no column)."""
    path = tmp_path / "old.sqlite3"
    with closing(sqlite3.connect(path)) as db:  # the previous version's clients table: no first_used
        db.execute("CREATE TABLE clients (id TEXT PRIMARY KEY, created REAL NOT NULL, method TEXT, bundle_id TEXT, "
                   "user_agent TEXT)")
        db.execute("INSERT INTO clients VALUES ('old', 1.0, 'TENT', 'b', '')")
        db.commit()
    store = Store(path)
    try:
        used, used_token = store.add_client("TENT", "b", max_clients=3)
        unused, unused_token = store.add_client("TENT", "b", max_clients=3)
        assert store.lookup_token(used_token, record_use=True) == ("client", used)
        time.sleep(0.3)
        with pytest.raises(RegistryFull):  # all three joined under 1 s ago: nothing to reclaim
            store.add_client("TENT", "b", max_clients=3, unused_ttl_s=1.0)
        time.sleep(1.0)  # past the TTL and past the one-pass-per-min(ttl, 60) s guard
        store.add_client("TENT", "b", max_clients=3, unused_ttl_s=1.0)
        ids = {c["id"] for c in store.clients()}
        assert "old" in ids and used in ids and unused not in ids and len(ids) == 3
        assert store.lookup_token(unused_token) is None and store.lookup_token(used_token) == ("client", used)
        with pytest.raises(RegistryFull):
            store.add_client("TENT", "b", max_clients=3, unused_ttl_s=1.0)
    finally:
        store.close()


def test_defaults_do_not_throttle_the_load_benchmark(tmp_path: Path) -> None:
    """benchmarks/coordinator_load.py: 200 devices join at once from one IP, each then uses its own token."""
    cfg = ServiceConfig(store_dir=tmp_path, default_methods=())
    clock = Clock()
    joins = Buckets(Limit(cfg.join_rate, cfg.join_burst), clock=clock)
    assert all(joins.take("ip:127.0.0.1") == 0.0 for _ in range(200))
    tokens = Buckets(Limit(cfg.token_rate, cfg.token_burst), clock=clock)
    assert all(tokens.take(f"device-{i}") == 0.0 for i in range(200) for _ in range(5))
    address = Buckets(Limit(cfg.address_rate, cfg.address_burst), clock=clock)  # all 200 share one address
    assert all(address.take("ip:127.0.0.1") == 0.0 for _ in range(200 * 5))


@pytest.fixture(scope="module")
def server(trained_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    env = {"FL_SERVE_TOKEN_RATE": "1", "FL_SERVE_TOKEN_BURST": "4", "FL_SERVE_JOIN_RATE": "1",
           "FL_SERVE_JOIN_BURST": "3"}
    coord = start_copy(trained_store, tmp_path_factory.mktemp("rate") / "store", env=env)
    yield coord
    coord.stop()


def until_limited(send: Callable[[], httpx.Response], tries: int = 20) -> httpx.Response:
    for _ in range(tries):
        r = send()
        if r.status_code == 429:
            return r
        assert r.status_code < 300, r.text
    raise AssertionError(f"no 429 after {tries} requests")


def test_join_is_limited_per_ip_then_recovers(server: Coordinator) -> None:
    def attempt() -> httpx.Response:
        return httpx.post(f"{server.url}/v1/clients", json={}, timeout=30)

    r = until_limited(attempt)
    retry = int(r.headers["Retry-After"])
    assert r.json() == {"detail": f"rate limit exceeded for joins from this IP (1 requests/s, burst 3); "
                                  f"retry after {retry} s"}
    assert 1 <= retry <= 2
    time.sleep(retry)
    assert attempt().status_code == 201


def test_token_is_limited_per_token_then_recovers(server: Coordinator) -> None:
    time.sleep(3)  # the joins of the previous test refill
    a, b = join(server.url)["token"], join(server.url)["token"]
    url = f"{server.url}/v1/btfl/dle"
    body = {"freqs": [[0.5, 0.5]], "num_samples": 1, "bundle_id": UNSERVED_BTFL}
    assert httpx.post(url, json=body, headers=auth(a), timeout=30).status_code == 200
    r = until_limited(lambda: httpx.get(url, headers=auth(a), timeout=30))
    retry = int(r.headers["Retry-After"])
    assert r.json()["detail"].startswith("rate limit exceeded for this token (1 requests/s, burst 4)")
    # another token is not affected, neither is the admin's
    assert httpx.get(url, headers=auth(b), timeout=30).status_code == 200
    admin = httpx.get(f"{server.url}/v1/jobs", headers=auth(ADMIN), timeout=30)
    assert admin.status_code == 200
    time.sleep(retry)
    assert httpx.get(url, headers=auth(a), timeout=30).status_code == 200
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert 'route="/v1/btfl/dle",status="429"' in metrics


def test_edge_client_waits_out_a_429(server: Coordinator, tmp_path: Path) -> None:
    """The device SDK retries a 429 after its Retry-After, as it does a 503."""
    from edge_sdk import EdgeClient

    time.sleep(4)  # refill the join bucket
    until_limited(lambda: httpx.post(f"{server.url}/v1/clients", json={}, timeout=30))
    seen: list[int] = []
    with EdgeClient(server.url, cache_dir=tmp_path, retries=3, backoff=0.1,
                    event_hooks={"response": [lambda r: seen.append(r.status_code)]}) as c:
        info = c.join()
    assert seen[0] == 429 and seen[-1] == 201 and info.token.startswith("flc_")


def test_joins_stop_at_the_client_cap_and_survive_a_restart(trained_store: Path,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """FL_SERVE_MAX_CLIENTS bounds the registry (joining needs no credential); the count is the store's, so a
    restarted coordinator keeps refusing."""
    store = tmp_path_factory.mktemp("cap") / "store"
    with closing(sqlite3.connect(f"file:{trained_store / 'coordinator.sqlite3'}?mode=ro", uri=True)) as db:
        existing = db.execute("SELECT COUNT(*) FROM clients").fetchone()[0]
    env = {"FL_SERVE_MAX_CLIENTS": str(existing + 2)}
    coord = start_copy(trained_store, store, env=env)
    try:
        joined = [join(coord.url) for _ in range(2)]
        r = httpx.post(f"{coord.url}/v1/clients", json={}, timeout=30)
        assert r.status_code == 503
        assert r.json() == {"detail": f"the coordinator has registered its maximum of {existing + 2} clients "
                                      "(FL_SERVE_MAX_CLIENTS)"}
        url = f"{coord.url}/v1/btfl/dle"  # the registered clients keep working (no DLE on this store: 404)
        assert httpx.get(url, headers=auth(joined[0]["token"]), timeout=30).status_code == 404
    finally:
        coord.stop()
    again = start(store, env=env)
    try:
        assert httpx.post(f"{again.url}/v1/clients", json={}, timeout=30).status_code == 503
    finally:
        again.stop()


def test_a_reclaim_pass_removes_the_oldest_batch_only(tmp_path: Path) -> None:
    """One pass reclaims at most RECLAIM_BATCH clients, the oldest first, and their tokens with them."""
    store = Store(tmp_path / "s.sqlite3")
    try:
        n = RECLAIM_BATCH + 5
        with closing(sqlite3.connect(tmp_path / "s.sqlite3")) as db:
            db.executemany("INSERT INTO clients (id, created, method, bundle_id, user_agent) VALUES (?, ?, 'TENT', "
                           "'b', '')", [(f"c{i}", 1.0 + i) for i in range(n)])
            db.executemany("INSERT INTO tokens VALUES (?, 'client', ?, 1.0)", [(f"h{i}", f"c{i}") for i in range(n)])
            db.commit()
        store._num_clients = n  # the rows came in behind the store's back
        store.add_client("TENT", "b", max_clients=n, unused_ttl_s=1.0)
        assert store.count("clients") == 6
        assert {c["id"] for c in store.clients()} >= {f"c{i}" for i in range(RECLAIM_BATCH, n)}
        rows = store._run("SELECT COUNT(*) AS n FROM tokens WHERE scope = 'client'")
        assert rows[0]["n"] == 6
    finally:
        store.close()


def test_a_full_coordinator_reclaims_clients_that_never_used_their_token(
        trained_store: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """FL_SERVE_UNUSED_CLIENT_TTL_S: at the cap, a join reclaims the clients that never made an authenticated
    request and joined over the TTL ago; a client that did keeps its token."""
    store = tmp_path_factory.mktemp("reclaim") / "store"
    with closing(sqlite3.connect(f"file:{trained_store / 'coordinator.sqlite3'}?mode=ro", uri=True)) as db:
        existing = db.execute("SELECT COUNT(*) FROM clients").fetchone()[0]
    coord = start_copy(trained_store, store, env={"FL_SERVE_MAX_CLIENTS": str(existing + 2),
                                                  "FL_SERVE_UNUSED_CLIENT_TTL_S": "2"})
    try:
        with closing(sqlite3.connect(store / "coordinator.sqlite3")) as db:  # other tests' joins: not reclaimable
            db.execute("UPDATE clients SET first_used = created WHERE first_used IS NULL")
            db.commit()
        active, idle = join(coord.url), join(coord.url)
        dle = f"{coord.url}/v1/btfl/dle"
        assert httpx.get(dle, headers=auth(active["token"]), timeout=30).status_code == 404  # authenticated
        assert httpx.post(f"{coord.url}/v1/clients", json={}, timeout=30).status_code == 503  # both too young
        time.sleep(2.5)
        assert httpx.post(f"{coord.url}/v1/clients", json={}, timeout=30).status_code == 201
        r = httpx.get(dle, headers=auth(idle["token"]), timeout=30)
        assert (r.status_code, r.json()) == (401, {"detail": "unknown bearer token"})
        assert httpx.get(dle, headers=auth(active["token"]), timeout=30).status_code == 404
    finally:
        coord.stop()
