"""Every EdgeClient network call ends by its total deadline, reply headers included (issue 50, N8's residual).

httpx's sync client times each read, not the reply, and returns a response only once its headers are complete:
a server that trickles its status line and headers a byte at a time, each byte well within the read timeout,
held a call as long as it liked. Real sockets, a real local server thread; no coordinator and no torch."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from edge_sdk import EdgeClient, EdgeClientError, _deadline


def _trickle_head(conn: socket.socket, gap_s: float) -> None:
    """Read the request head, then send a reply head one byte every ``gap_s`` (about 20 s of it)."""
    conn.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
        data += chunk
    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * int(20 / gap_s):
        conn.sendall(bytes([byte]))
        time.sleep(gap_s)


@contextmanager
def trickling_server(gap_s: float) -> Iterator[str]:
    """A local HTTP server whose every reply head arrives a byte every ``gap_s``; yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop, conns = threading.Event(), []

    def serve(conn: socket.socket) -> None:
        try:
            _trickle_head(conn, gap_s)
        except OSError:  # the client gave up: what the test wants
            pass
        finally:
            conn.close()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conns.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in conns:
            conn.close()
        listener.close()


CALLS = {
    "join": lambda c: c.join(),
    "health": lambda c: c.health(),
    "fetch": lambda c: c.fetch("ab" * 32, size=1000),
    "wait_ready": lambda c: c.wait_ready(timeout=1.5, poll=0.1),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_reply_headers_trickled_a_byte_at_a_time_end_at_the_deadline(tmp_path: Path, call: str) -> None:
    """Headers a byte every 0.25 s (each read gets its byte well within the 3 s read timeout) kept a call blocked
    for as long as the server kept trickling; now a 1.5 s deadline ends it with the SDK's error by about 1.5 s."""
    with trickling_server(gap_s=0.25) as url:
        with EdgeClient(url, cache_dir=tmp_path, timeout=3.0, retries=0, deadline=1.5) as c:
            t0 = time.monotonic()
            with pytest.raises(EdgeClientError, match=r"reply not complete after 1\.5s"):
                CALLS[call](c)
            took = time.monotonic() - t0
    assert took < 1.5 + 1.0, f"{call} took {took:.1f}s with a 1.5 s deadline"


def test_the_guard_reaches_the_network_backend_of_httpx_transports() -> None:
    """The deadline lives in httpcore's network backend, which httpx keeps in private attributes (the client's
    ``_transport`` and ``_mounts``, the transport's ``_pool``, the pool's ``_network_backend``): an httpx upgrade
    that renames them makes ``guard`` find nothing, and this test fail, instead of the deadline silently going."""
    with httpx.Client() as plain, httpx.Client(proxy="http://127.0.0.1:9") as proxied:
        assert _deadline.guard(plain) == 1
        assert _deadline.guard(plain) == 0  # once only: never a backend wrapped twice
        assert _deadline.guard(proxied) == 2  # the proxy's mount and the client's own transport
