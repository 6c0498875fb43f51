"""Hostile HTTP traffic against a real coordinator process (issue 36, defects 3, 4, 7, 11, 12): slow and
idle connections, oversized request heads, forged X-Forwarded-For, strings and booleans where numbers
belong, conditional and HEAD requests, deeply nested bodies."""
from __future__ import annotations

import json

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from coordinator_proc import ADMIN, Coordinator, auth, join, start, start_copy
from fl_server.service.server import address_key, trusted_peers

pytestmark = pytest.mark.timeout(600)
LIMITS = {"FL_SERVE_HEAD_TIMEOUT_S": "1", "FL_SERVE_BODY_TIMEOUT_S": "1", "FL_SERVE_MAX_CONNECTIONS": "40",
          "FL_SERVE_MAX_HEAD_BYTES": str(64 << 10), "FL_SERVE_JOIN_RATE": "0.001", "FL_SERVE_JOIN_BURST": "3",
          "FL_SERVE_MAX_PENDING_PER_ADDRESS": "1000"}  # these tests fill the cap from one address on purpose


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """A coordinator that trains nothing, with short deadlines and a small connection cap."""
    coord = start(tmp_path_factory.mktemp("hostile") / "store", methods="", env=LIMITS)
    yield coord
    coord.stop()


@pytest.fixture(scope="module")
def served(trained_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    coord = start_copy(trained_store, tmp_path_factory.mktemp("hostile-served") / "store")
    yield coord
    coord.stop()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _rss_kib(pid: int) -> int:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS:"))
    return int(line.split()[1])


# ------------------------------------------------------------------------------------------- defect 3
def test_slow_head_gets_408_and_an_idle_connection_is_closed(bare: Coordinator) -> None:
    slow, idle = _connect(bare.url), _connect(bare.url)
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
    start = time.monotonic()
    reply = _read_all(slow)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"request head not received within 1 s" in reply
    assert time.monotonic() - start < 5
    assert _read_all(idle).startswith(b"HTTP/1.1 408 ")  # sent nothing at all: uvicorn kept it open for good
    slow.close(), idle.close()


def test_bytes_between_requests_do_not_hold_a_connection(bare: Coordinator) -> None:
    """A stray CRLF after a reply begins no request but cancelled uvicorn's keep-alive timer: the connection was
    held for good. Now it has the head deadline."""
    s = _connect(bare.url)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = b""
    while not reply.endswith(b"}"):  # the whole JSON reply
        reply += s.recv(65536)
    s.sendall(b"\r\n")
    start = time.monotonic()
    assert _read_all(s).startswith(b"HTTP/1.1 408 ")  # timed out after 10 s before
    assert time.monotonic() - start < 5
    s.close()


def test_a_request_the_parser_cannot_read_gets_a_json_400(bare: Coordinator) -> None:
    """A malformed request line (a raw space or control byte in the path) gets the API's error shape, not
    uvicorn's plain text."""
    for line in (b"GET /v1/jobs/a b HTTP/1.1", b"DELETE /v1/jobs/\x7f HTTP/1.1", b"\x00\x17 not http at all"):
        s = _connect(bare.url)
        s.sendall(line + b"\r\nHost: x\r\n\r\n")
        head, _, body = _read_all(s).partition(b"\r\n\r\n")
        s.close()
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, head
        assert json.loads(body)["detail"] == "Invalid HTTP request received."


def test_slow_body_is_cut_off(bare: Coordinator) -> None:
    s = _connect(bare.url)
    s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + ADMIN.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"rounds\"")
    start = time.monotonic()
    reply = _read_all(s)  # closed by the server after the body deadline
    assert time.monotonic() - start < 5 and b" 201 " not in reply
    s.close()


def test_held_connections_are_capped_and_reaped(bare: Coordinator) -> None:
    """Over FL_SERVE_MAX_CONNECTIONS open connections a request gets 503 (not a reset), and the idle ones are
    closed by the head deadline, after which requests are served again."""
    held = [_connect(bare.url) for _ in range(45)]
    try:
        r = httpx.get(f"{bare.url}/v1/signing-key", timeout=10)
        assert r.status_code == 503
        for s in held:
            assert _read_all(s).startswith(b"HTTP/1.1 408 ")
        assert httpx.get(f"{bare.url}/v1/signing-key", timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()


def test_half_sent_requests_do_not_starve_health_checks(bare: Coordinator) -> None:
    """Issue 50, D3/N5: 3,000 half-sent requests made 36 of 37 fresh health checks answer 503. /healthz is
    answered over the connection cap (it holds no connection of its own beyond the probe's); other routes get
    503 until the head deadline reaps the half-sent connections."""
    held = [_connect(bare.url) for _ in range(45)]
    try:
        for s in held:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
        codes = [httpx.get(f"{bare.url}/healthz", timeout=10).status_code for _ in range(5)]
        assert codes == [200] * 5
        assert httpx.get(f"{bare.url}/v1/signing-key", timeout=10).status_code == 503  # the cap still holds
    finally:
        for s in held:
            s.close()


@pytest.fixture(scope="module")
def small_cap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """A coordinator with a cap of 4 connections and a 4 s write timeout (longer than filling the cap takes on
    a loaded machine, so the first held connection is still held when the probe checks the cap is full)."""
    coord = start(tmp_path_factory.mktemp("write-timeout") / "store", methods="",
                  env={"FL_SERVE_MAX_CONNECTIONS": "4", "FL_SERVE_WRITE_TIMEOUT_S": "4"})
    yield coord
    coord.stop()


@pytest.fixture(scope="module")
def per_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """A cap of 20 connections, at most 8 of one address waiting for a request, a head deadline (5 s) longer
    than the test takes."""
    coord = start(tmp_path_factory.mktemp("per-address") / "store", methods="",
                  env={"FL_SERVE_MAX_CONNECTIONS": "20", "FL_SERVE_MAX_PENDING_PER_ADDRESS": "8",
                       "FL_SERVE_HEAD_TIMEOUT_S": "5"})
    yield coord
    coord.stop()


def _connect_from(url: str, source: str) -> socket.socket:
    """A connection from ``source`` (any 127.x.y.z reaches loopback on Linux: distinct client addresses)."""
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))


def test_one_address_cannot_fill_the_cap_with_half_sent_requests(per_address: Coordinator) -> None:
    """One address holding more half-sent requests than the connection cap made every other address's requests
    get 503 until the head deadline reaped them. Now at most FL_SERVE_MAX_PENDING_PER_ADDRESS connections of one
    address wait for a request; the others are closed at once, and other addresses are served."""
    held = []
    try:
        for _ in range(30):  # more than the cap (20)
            s = _connect_from(per_address.url, "127.0.0.2")
            try:
                s.sendall(b"GET /v1/signing-key HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
            except OSError:  # refused already
                pass
            held.append(s)
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"), timeout=10) as other:
            assert other.get(f"{per_address.url}/v1/signing-key").status_code == 200  # was 503: the cap was full
        waiting = 0
        for s in held:  # the refusals were written when the connections were accepted, before the probe's
            s.settimeout(0.3)
            try:
                reply = _read_all(s)
            except TimeoutError:
                waiting += 1
                continue
            assert reply == b"" or reply.startswith(b"HTTP/1.1 503 "), reply[:100]  # (a reset loses the reply)
        assert waiting == 8
        same = _connect_from(per_address.url, "127.0.0.2")  # sends nothing: reads its refusal whole
        reply = _read_all(same)
        same.close()
        assert reply.startswith(b"HTTP/1.1 503 ") and b"FL_SERVE_MAX_PENDING_PER_ADDRESS: 8" in reply, reply
    finally:
        for s in held:
            s.close()
    codes = []
    for _ in range(20):  # the closed ones no longer count: the address is served again
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=10) as again:
            codes.append(again.get(f"{per_address.url}/v1/signing-key").status_code)
        if codes[-1] == 200:
            break
        time.sleep(0.2)
    assert codes[-1] == 200, codes


def test_the_per_address_key() -> None:
    """IPv4 by address, IPv6 by /64 (one host's usual allotment), IPv4-mapped as IPv4, trusted proxies unbounded."""
    none = trusted_peers(())
    assert address_key("10.1.2.3", none) == address_key("::ffff:10.1.2.3", none) == "10.1.2.3"
    assert address_key("2001:db8:1:2:aaaa::1", none) == address_key("2001:db8:1:2:bbbb::9", none) == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1", none) == "2001:db8:1:3::/64"
    proxies = trusted_peers(("10.0.0.0/8", "192.168.1.7"))
    assert address_key("10.9.9.9", proxies) is None and address_key("192.168.1.7", proxies) is None
    assert address_key("192.168.1.8", proxies) == "192.168.1.8"
    assert address_key("10.9.9.9", trusted_peers(("*",))) is None


def _non_reader(url: str, requests: int) -> socket.socket:
    """A connection that pipelines ``requests`` requests for the API schema and reads nothing,
    with a small receive buffer, so the server's replies pile up in its send buffer."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(10)
    s.connect((host, int(port)))
    s.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * requests)
    return s


def test_a_connection_that_reads_no_reply_is_closed_after_the_write_timeout(small_cap: Coordinator) -> None:
    """Issue 50, D3/N5: connections that never read their replies were never closed (at a cap of 64, 110 of 110
    probes got 503). Now a reply that makes no progress for FL_SERVE_WRITE_TIMEOUT_S is dropped with its
    connection, which stops counting toward the cap."""
    requests = 200  # 8 MB of replies: more than loopback's socket buffers (~3 MB) hold
    time.sleep(0.5)  # the fixture's last probe is gone
    held: list[socket.socket] = []
    probe = f"{small_cap.url}/v1/signing-key"
    try:
        while len(held) < 8 and httpx.get(probe, timeout=10).status_code == 200:  # fill the cap
            held.append(_non_reader(small_cap.url, requests))
            time.sleep(0.3)
        assert httpx.get(probe, timeout=10).status_code == 503
        codes = []
        for _ in range(40):  # the write timeout (4 s) and a sweep: a few seconds
            time.sleep(0.5)
            codes.append(httpx.get(probe, timeout=10).status_code)
            if codes[-1] == 200:
                break
        assert codes[-1] == 200, codes  # it was 503 for good
        # the connection whose slot came free was reset: the server gave up before sending every reply (the
        # others may still be inside their write timeout, and reading them now lets their replies flow)
        assert min(_read_all(s).count(b"HTTP/1.1 200 ") for s in held) < requests
        log = small_cap.log.read_text()
        assert "Traceback" not in log, log[-3000:]  # the request it was writing ends quietly
    finally:
        for s in held:
            s.close()


# ------------------------------------------------------------------------------------------- defect 4
def _send_big_head(url: str, size: int, out: list[bytes]) -> None:
    s = _connect(url)
    try:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        block = b"a" * (1 << 20)
        for _ in range(size >> 20):
            s.sendall(block)
        s.sendall(b"\r\n\r\n")
    except OSError:  # the server closed the connection while we were still sending: refused
        pass
    out.append(_read_all(s))
    s.close()


def test_huge_header_line_is_refused_without_memory_growth(bare: Coordinator) -> None:
    before = _rss_kib(bare.proc.pid)
    replies: list[bytes] = []
    threads = [threading.Thread(target=_send_big_head, args=(bare.url, 64 << 20, replies)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(replies) == 4
    for reply in replies:  # 431, or the connection closed before the client could read it
        assert reply == b"" or reply.startswith(b"HTTP/1.1 431 "), reply[:100]
    assert _rss_kib(bare.proc.pid) - before < 64 << 10  # was +360 MB for eight such requests
    ok = httpx.get(f"{bare.url}/healthz", headers={"X-Small": "a" * 8000}, timeout=10)
    assert ok.status_code == 200


# ------------------------------------------------------------------------------------------- defect 7
def test_forwarded_for_is_ignored_without_trusted_proxies(bare: Coordinator) -> None:
    """Join burst 3 per address: distinct forged X-Forwarded-For values no longer make distinct addresses."""
    codes = [httpx.post(f"{bare.url}/v1/clients", json={}, headers={"X-Forwarded-For": f"10.0.0.{i}"},
                        timeout=10).status_code for i in range(5)]
    assert codes[3:] == [429, 429]


# ------------------------------------------------------------------------------------------ defect 12
def test_head_is_answered_where_get_is(bare: Coordinator) -> None:
    get = httpx.get(f"{bare.url}/v1/signing-key", timeout=10)
    head = httpx.head(f"{bare.url}/v1/signing-key", timeout=10)
    assert (head.status_code, head.content) == (200, b"")
    assert head.headers["content-length"] == str(len(get.content))
    r = httpx.head(f"{bare.url}/v1/jobs", timeout=10)  # GET needs a token: so does HEAD
    assert r.status_code == 401
    r = httpx.request("HEAD", f"{bare.url}/v1/hypernetwork/generate", timeout=10)  # POST only
    assert (r.status_code, r.headers["allow"]) == (405, "POST")


def test_deeply_nested_body_gets_a_clear_400(bare: Coordinator) -> None:
    r = httpx.post(f"{bare.url}/v1/jobs", content=b"[" * 100_000, timeout=10,
                   headers={**auth(ADMIN), "Content-Type": "application/json"})
    assert (r.status_code, r.json()["detail"]) == (
        400, "request body is nested too deeply (JSON arrays and objects within each other); no request of this "
             "API nests more than 3 levels")


# ------------------------------------------------------------------------------------------ defect 11
@pytest.mark.parametrize("field,value,type_", [("seed", False, "int_type"), ("rounds", "10", "int_type"),
                                                ("alpha", "1.0", "float_type"), ("rounds", 10.0, "int_type")])
def test_job_numbers_are_strict(bare: Coordinator, field: str, value: object, type_: str) -> None:
    body = {"method": "TENT", "partition": "dirichlet", "alpha": 1.0, field: value}
    r = httpx.post(f"{bare.url}/v1/jobs", json=body, headers=auth(ADMIN), timeout=10)
    assert r.status_code == 422, r.text
    assert [(e["loc"], e["type"]) for e in r.json()["detail"]] == [(["body", field], type_)]


def test_alpha_for_a_partition_it_does_not_shape_is_refused(bare: Coordinator) -> None:
    body = {"method": "TENT", "partition": "iid", "alpha": 0.5}
    r = httpx.post(f"{bare.url}/v1/jobs", json=body, headers=auth(ADMIN), timeout=10)
    assert (r.status_code, r.json()["detail"]) == (422, "alpha shapes the dirichlet partition only, not 'iid'")


def test_embedding_and_dle_numbers_are_strict(served: Coordinator) -> None:
    client = join(served.url, "ODPFL-HN")
    dim, own = int(client["manifest"]["hyperparameters"]["embed_dim"]), {"bundle_id": client["manifest"]["bundle_id"]}
    url, headers = f"{served.url}/v1/hypernetwork/generate", auth(client["token"])
    for bad, type_ in (("1.0", "float_type"), (True, "float_type")):
        r = httpx.post(url, json={"embedding": [bad] + [0.0] * (dim - 1), **own}, headers=headers, timeout=30)
        assert r.status_code == 422, r.text
        assert [(e["loc"], e["type"]) for e in r.json()["detail"]] == [(["body", "embedding", 0], type_)]
    assert httpx.post(url, json={"embedding": [1] + [0.0] * (dim - 1), **own}, headers=headers,
                      timeout=30).status_code == 200  # a JSON integer is a number
    r = httpx.post(f"{served.url}/v1/btfl/dle", json={"freqs": [[0.5, 0.5]], "num_samples": "10", "bundle_id": "b" * 64},
                   headers=headers, timeout=30)
    assert [(e["loc"], e["type"]) for e in r.json()["detail"]] == [(["body", "num_samples"], "int_type")]


# ------------------------------------------------------------------------------------------ defect 12
def test_manifest_if_none_match_and_head(served: Coordinator) -> None:
    r = httpx.get(f"{served.url}/v1/manifest", params={"method": "TENT"}, timeout=30)
    etag, bundle = r.headers["etag"], r.json()
    for tag in ("*", etag, f'"nope", {etag}'):
        r = httpx.get(f"{served.url}/v1/manifest", params={"method": "TENT"}, headers={"If-None-Match": tag},
                      timeout=30)
        assert (r.status_code, r.content, r.headers["etag"]) == (304, b"", etag)
    r = httpx.get(f"{served.url}/v1/manifest", params={"method": "TENT"}, headers={"If-None-Match": '"x"'},
                  timeout=30)
    assert r.status_code == 200
    art = bundle["artifacts"][0]
    r = httpx.head(f"{served.url}{art['url']}", timeout=30)
    assert (r.status_code, r.content, r.headers["content-length"]) == (200, b"", str(art["size"]))


def test_repeated_log_lines_are_collapsed_and_admin_guesses_limited(tmp_path: Path) -> None:
    """Issue 50, N14: under attack the log grew by one warning per bad request, 2,000 wrong admin tokens were
    answered at full speed. Now the same line is collapsed
    (a burst, then a summary "suppressed N similar lines"), an address that keeps presenting wrong admin tokens
    gets 429 before any token is looked at."""
    coord = start(tmp_path / "store", methods="", env={"FL_SERVE_LOG_BURST": "5", "FL_SERVE_LOG_RATE": "2"})
    try:
        def garbage() -> None:
            s = _connect(coord.url)
            s.sendall(b"\x00\x17 not http at all\r\n\r\n")
            _read_all(s)
            s.close()

        for _ in range(100):
            garbage()
        time.sleep(1.0)  # the bucket refills: the next line says how many were dropped
        garbage()
        time.sleep(0.5)
        lines = [ln for ln in coord.log.read_text().splitlines() if "Invalid HTTP request" in ln]
        assert 5 <= len(lines) <= 12, lines  # was 101
        assert any("suppressed" in ln and "similar lines)" in ln for ln in lines), lines

        jobs = f"{coord.url}/v1/jobs"
        codes = [httpx.get(jobs, headers=auth(f"wrong-admin-token-{i:04d}"), timeout=10).status_code for i in range(40)]
        assert codes[:30] == [401] * 30 and set(codes[30:]) == {429}, codes  # FL_SERVE_ADMIN_FAIL_BURST: 30
        r = httpx.get(jobs, headers=auth(ADMIN), timeout=10)  # guesses get no answer either, even a right one
        assert r.status_code == 429 and "failed admin authentications from this address" in r.json()["detail"]
    finally:
        coord.stop()


def test_the_public_dashboard_lists_no_client_id(served: Coordinator) -> None:
    """Issue 50, N14: the dashboard (public, no token) listed the first 12 characters of every client id."""
    client_id = join(served.url)["client_id"]
    page = httpx.get(f"{served.url}/", timeout=10).text
    assert "Clients (latest 50)" in page and client_id[:8] not in page
