"""The coordinator's HTTP server: uvicorn with explicit limits against slow and oversized requests.

uvicorn bounds neither how long a client may take to send a request head or body nor how large a head may be
(httptools buffers a header line whole), and it trusts ``X-Forwarded-For`` from 127.0.0.1 by default.
:class:`GuardedHttpTools` adds, per connection:

- a head deadline: a request's head (request line and headers) must be complete ``head_timeout_s`` after the
  connection opened or the request began, else 408 and the connection closes (slowloris; a connection that
  sends nothing at all is closed too, where uvicorn kept it for good);
- a body deadline: the body must be complete ``body_timeout_s`` after the head, else the connection closes;
- a head size limit: over ``max_head_bytes`` bytes before the end of the head, 431 and the connection closes
  (at most one read beyond the limit is ever buffered).

:func:`uvicorn_options` also raises the process's soft file-descriptor limit to its hard limit and caps the open
connections (``max_connections``, over which uvicorn answers 503), so holding connections open can no longer
exhaust descriptors and make every new connection reset.

Example::

    uvicorn.run(app, host="127.0.0.1", port=8000, **uvicorn_options(ServerLimits(head_timeout_s=10)))
"""
from __future__ import annotations

import asyncio
import os
import resource
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, str(default)))


@dataclass(frozen=True)
class ServerLimits:
    """HTTP limits of ``fl-server serve`` (environment ``FL_SERVE_*``)."""

    head_timeout_s: float = field(default_factory=lambda: _env_float("FL_SERVE_HEAD_TIMEOUT_S", 10.0))
    body_timeout_s: float = field(default_factory=lambda: _env_float("FL_SERVE_BODY_TIMEOUT_S", 30.0))
    max_head_bytes: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_MAX_HEAD_BYTES", str(64 << 10))))
    max_connections: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_MAX_CONNECTIONS", "2048")))
    keep_alive_s: float = field(default_factory=lambda: _env_float("FL_SERVE_KEEP_ALIVE_S", 5.0))
    # addresses (or "*") whose X-Forwarded-For / X-Forwarded-Proto are believed; none by default
    trusted_proxies: tuple[str, ...] = field(default_factory=lambda: tuple(
        p.strip() for p in os.environ.get("FL_SERVE_TRUSTED_PROXIES", "").split(",") if p.strip()))

    def __post_init__(self) -> None:
        if min(self.head_timeout_s, self.body_timeout_s, self.keep_alive_s) <= 0:
            raise ValueError("FL_SERVE_{HEAD,BODY}_TIMEOUT_S and FL_SERVE_KEEP_ALIVE_S must be > 0")
        if self.max_head_bytes < 1024 or self.max_connections < 1:
            raise ValueError("FL_SERVE_MAX_HEAD_BYTES must be >= 1024 and FL_SERVE_MAX_CONNECTIONS >= 1")


def _response(status: bytes, msg: str) -> bytes:
    body = ('{"detail": "%s"}' % msg).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head/body deadlines and the head size limit (module docstring)."""

    limits = ServerLimits()  # set by uvicorn_options() in a subclass attribute

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head = True  # bytes received now belong to a request head
        self._head_bytes = 0

    def _arm(self, seconds: float, in_head: bool) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, in_head)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, in_head: bool) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if in_head:
            self.transport.write(_response(b"408 Request Timeout", "request head not received within "
                                           f"{self.limits.head_timeout_s:g} s"))
        self.transport.close()  # a body cut off: the app's receive() reports the disconnect

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.head_timeout_s, True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.limits.max_head_bytes and not self.transport.is_closing():
            self._disarm()
            self.transport.write(_response(b"431 Request Header Fields Too Large", "request head over "
                                           f"{self.limits.max_head_bytes} bytes"))
            self.transport.close()
            self.parser = None  # type: ignore[assignment]  # drop what httptools buffered

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:
            self._arm(self.limits.head_timeout_s, True)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        self._arm(self.limits.body_timeout_s, False)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head = True
        super().on_message_complete()


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (connections beyond the default 1024 then queue for
    ``max_connections`` instead of failing accept()); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def uvicorn_options(limits: ServerLimits) -> dict[str, Any]:
    """uvicorn.run keyword arguments for ``limits`` (the protocol class, connection cap, proxy trust)."""
    protocol = type("GuardedHttpToolsConfigured", (GuardedHttpTools,), {"limits": limits})
    soft = raise_fd_limit()
    return {"http": protocol, "limit_concurrency": max(1, min(limits.max_connections, soft - 64)),
            "timeout_keep_alive": limits.keep_alive_s,
            "proxy_headers": bool(limits.trusted_proxies),
            "forwarded_allow_ips": list(limits.trusted_proxies) or None}
