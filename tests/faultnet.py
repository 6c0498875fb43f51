"""Real sockets that misbehave, for the SDK's fault-injection tests: a proxy in front of a real coordinator
that cuts or stalls responses partway, and tiny servers that answer garbage or nothing."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head up to the blank line, bytes read past it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _header(head: bytes, name: str) -> str | None:
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        if k.strip().lower() == name:
            return v.strip()
    return None


class _Listener:
    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(32)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._handle, self._stop = handle, threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for c in self._conns:
            c.close()
        self.sock.close()

    def __enter__(self) -> _Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Cut:
    """Responses to paths starting with ``prefix``: the i-th is cut (``mode="cut"``: connection closed) or
    stalled (``"stall"``: no more bytes for ``stall_s``) after ``after[i]`` body bytes; later ones pass."""

    prefix: str
    after: list[int]
    mode: str = "cut"
    stall_s: float = 5.0
    done: int = 0
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)


class CuttingProxy(_Listener):
    """A proxy to ``upstream`` that forwards one request per connection (``Connection: close``) and applies
    :class:`Cut` to matching responses."""

    def __init__(self, upstream: str, cut: Cut) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream, self.cut = (host, int(port)), cut
        self._lock = threading.Lock()
        super().__init__(self._proxy)

    def _proxy(self, client: socket.socket) -> None:
        head, rest = _read_head(client)
        if not head:
            return
        path = head.split(b" ")[1].decode()
        length = int(_header(head, "content-length") or 0)
        while len(rest) < length:
            rest += client.recv(65536)
        lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"connection:")]
        with self._lock:
            match = path.startswith(self.cut.prefix)
            limit = self.cut.after[self.cut.done] if match and self.cut.done < len(self.cut.after) else None
            if match:
                self.cut.requests.append((path, _header(head, "range")))
                self.cut.done += limit is not None
        with socket.create_connection(self.upstream) as up:
            up.sendall(b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + rest)
            rhead, body = _read_head(up)
            client.sendall(rhead + b"\r\n\r\n")
            sent = 0
            while True:
                if limit is not None and sent + len(body) >= limit:
                    client.sendall(body[:limit - sent])
                    if self.cut.mode == "stall":
                        time.sleep(self.cut.stall_s)
                    return  # closes both: the response is cut partway
                client.sendall(body)
                sent += len(body)
                body = up.recv(65536)
                if not body:
                    return


def serve(respond: Callable[[socket.socket, bytes], None]) -> _Listener:
    """A tiny server: each connection's request head goes to ``respond(conn, head)``."""

    def handle(conn: socket.socket) -> None:
        head, _ = _read_head(conn)
        respond(conn, head)

    return _Listener(handle)


def http_reply(body: bytes, status: str = "200 OK", content_type: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body
