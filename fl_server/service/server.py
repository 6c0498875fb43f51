"""The coordinator's HTTP server: uvicorn with explicit limits against slow and oversized requests.

uvicorn bounds neither how long a client may take to send a request head or body nor how large a head may be
(httptools buffers a header line whole), and it trusts ``X-Forwarded-For`` from 127.0.0.1 by default.
:class:`GuardedHttpTools` adds, per connection:

- a head deadline: a request's head (request line and headers) must be complete ``head_timeout_s`` after the
  connection opened or the request (or any byte after the last reply) began, else 408 and the connection
  closes (slowloris; a connection that sends nothing at all, or only a stray CRLF after a reply, is closed too,
  where uvicorn kept it for good);
- a body deadline: the body must be complete ``body_timeout_s`` after the head, else the connection closes;
- a head size limit: over ``max_head_bytes`` bytes before the end of the head, 431 and the connection closes
  (at most one read beyond the limit is ever buffered);
- a write timeout: a reply that stays queued without a byte going out for ``write_timeout_s`` (the client
  stopped reading) is dropped and the connection aborted, so it stops counting toward the cap (uvicorn waited
  for the client for good);
- TLS: a connection counts toward the cap from the moment it is accepted, before its handshake, and a handshake
  not complete within ``head_timeout_s`` closes it (asyncio's default: 60 s, outside the cap);
- ``GET /healthz`` is answered over the connection cap (still within the cap on running requests), so
  connections held half-sent cannot make a load balancer's health checks fail;
- a per-address bound on waiting connections: at most ``max_pending_per_address`` connections of one source
  address may wait for a request, i.e. be open without having sent a complete request (head and body) that is
  being answered: from the moment they are accepted (after the TLS handshake), and again from the first byte
  of each later request on a kept-alive connection. One over it is answered 503 and closed at once (holding no
  slot), so one address holding many half-sent requests cannot fill the connection cap and starve everyone
  else's requests until the head deadline. IPv6 addresses count by their /64 (one host's usual allotment); a
  peer in ``trusted_proxies`` is not bounded (a proxy carries many clients; bound them at the proxy).

:func:`uvicorn_options` also raises the process's soft file-descriptor limit to its hard limit and caps the open
connections (``max_connections``, over which uvicorn answers 503), so holding connections open can no longer
exhaust descriptors and make every new connection reset, and runs the event loop with the TLS handshake
deadline.

Example::

    uvicorn.run(app, host="127.0.0.1", port=8000, **uvicorn_options(ServerLimits(head_timeout_s=10)))
"""
from __future__ import annotations

import asyncio
import ipaddress
import os
import resource
from collections.abc import Callable
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
    write_timeout_s: float = field(default_factory=lambda: _env_float("FL_SERVE_WRITE_TIMEOUT_S", 30.0))
    # connections of one address that may wait for a request at once; 0: an eighth of max_connections (>= 16)
    max_pending_per_address: int = field(default_factory=lambda: int(os.environ.get(
        "FL_SERVE_MAX_PENDING_PER_ADDRESS", "0")))
    # addresses (or "*") whose X-Forwarded-For / X-Forwarded-Proto are believed; none by default
    trusted_proxies: tuple[str, ...] = field(default_factory=lambda: tuple(
        p.strip() for p in os.environ.get("FL_SERVE_TRUSTED_PROXIES", "").split(",") if p.strip()))

    def __post_init__(self) -> None:
        if min(self.head_timeout_s, self.body_timeout_s, self.keep_alive_s, self.write_timeout_s) <= 0:
            raise ValueError("FL_SERVE_{HEAD,BODY,WRITE}_TIMEOUT_S and FL_SERVE_KEEP_ALIVE_S must be > 0")
        if self.max_head_bytes < 1024 or self.max_connections < 1:
            raise ValueError("FL_SERVE_MAX_HEAD_BYTES must be >= 1024 and FL_SERVE_MAX_CONNECTIONS >= 1")
        if self.max_pending_per_address < 0:
            raise ValueError("FL_SERVE_MAX_PENDING_PER_ADDRESS must be >= 0 (0: an eighth of the connection cap)")

    @property
    def pending_per_address(self) -> int:
        """The per-address bound in force (``max_pending_per_address``, or its default)."""
        return self.max_pending_per_address or max(16, self.max_connections // 8)


Trusted = tuple[list[ipaddress.IPv4Network | ipaddress.IPv6Network], set[str]] | None


def trusted_peers(proxies: tuple[str, ...]) -> Trusted:
    """FL_SERVE_TRUSTED_PROXIES as (networks, other literal entries) as uvicorn reads them; None: "*", every peer."""
    if "*" in proxies:
        return None
    networks, literals = [], set()
    for entry in proxies:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            literals.add(entry)
    return networks, literals


def address_key(host: str, trusted: Trusted) -> str | None:
    """The per-address bound's key for a peer: the IPv4 address, the /64 of an IPv6 one (an IPv4-mapped one as
    IPv4); None for a trusted proxy (not bounded) or with every peer trusted."""
    if trusted is None or host in trusted[1]:
        return None
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host  # not an IP address (e.g. a Unix socket's peer): counted as it is
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in net for net in trusted[0]):
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _response(status: bytes, msg: str) -> bytes:
    body = ('{"detail": "%s"}' % msg).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines, the head size limit, the write timeout, TLS handshakes
    within the cap and /healthz over it (module docstring)."""

    limits = ServerLimits()  # set by uvicorn_options() in a subclass attribute
    trusted: Trusted = ([], set())  # FL_SERVE_TRUSTED_PROXIES, set with limits

    def send_400_response(self, msg: str) -> None:
        """A request the HTTP parser cannot read gets the API's error shape (JSON ``{"detail": ...}``), not
        uvicorn's plain text."""
        self.transport.write(_response(b"400 Bad Request", msg.replace("\\", "/").replace('"', "'")))
        self.transport.close()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head = True  # bytes received now belong to a request head
        self._head_bytes = 0
        self._connected = False
        self._stall: tuple[int, float] | None = None  # (bytes queued, since when) while a reply is queued
        self._handshake: asyncio.TimerHandle | None = None
        self._running: Any = None  # the request cycle whose ASGI task runs (pipelined ones wait behind it)
        self._address: str | None = None  # the per-address bound's key (None: not bounded)
        self._waiting = False  # counted toward the address's waiting connections
        if self.config.is_ssl:
            # built when the TCP connection is accepted, before the TLS handshake: it counts toward the cap until
            # the handshake completes or the loop's handshake deadline (the same head_timeout_s, armed just after
            # this one) closes it; one that fails its handshake earlier counts until then too
            self.connections.add(self)
            self._handshake = self.loop.call_later(self.limits.head_timeout_s, self._handshake_expired)

    def _handshake_expired(self) -> None:
        self._handshake = None
        if not self._connected:
            self.connections.discard(self)

    def shutdown(self) -> None:
        if self._connected:
            super().shutdown()
        else:  # still in its TLS handshake: nothing to close here
            self._handshake_expired()

    def check_write(self, now: float) -> None:
        """Abort the connection if its queued reply has not changed for ``write_timeout_s`` (the sweep of
        :func:`_sweep_writes` calls this a few times per timeout)."""
        if not self._connected:
            return
        queued = self.transport.get_write_buffer_size()
        if queued == 0:
            self._stall = None
        elif self._stall is None or self._stall[0] != queued:
            self._stall = (queued, now)
        elif now - self._stall[1] >= self.limits.write_timeout_s:
            self.transport.abort()  # close() would wait for the client to read it

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

    def _wait(self) -> bool:
        """Count this connection toward its address's waiting connections; False: the address is at its bound."""
        if self._address is None or self._waiting:
            return True
        counts: dict[str, int] = self.server_state.waiting_by_address
        if counts.get(self._address, 0) >= self.limits.pending_per_address:
            return False
        counts[self._address] = counts.get(self._address, 0) + 1
        self._waiting = True
        return True

    def _done_waiting(self) -> None:
        if self._waiting:
            counts: dict[str, int] = self.server_state.waiting_by_address
            counts[self._address] -= 1  # type: ignore[index]
            if not counts[self._address]:  # type: ignore[index]
                del counts[self._address]  # type: ignore[arg-type]
            self._waiting = False

    def _refuse(self, answer: bool) -> None:
        """Close a connection over its address's bound (with a 503 unless a reply is under way on it)."""
        self._disarm()
        if answer:
            self.transport.write(_response(b"503 Service Unavailable", "too many connections from this address "
                                           "are waiting to send a request (FL_SERVE_MAX_PENDING_PER_ADDRESS: "
                                           f"{self.limits.pending_per_address}); retry later"))
        self.transport.close()
        self.parser = None  # type: ignore[assignment]  # nothing more is parsed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._connected = True
        if self._handshake is not None:
            self._handshake.cancel()
            self._handshake = None
        if not hasattr(self.server_state, "waiting_by_address"):
            self.server_state.waiting_by_address = {}
        self._address = None if self.client is None else address_key(self.client[0], self.trusted)
        if not self._wait():
            return self._refuse(answer=True)
        self._arm(self.limits.head_timeout_s, True)
        if not hasattr(self.server_state, "write_sweep"):  # one sweep of every connection per server
            self.server_state.write_sweep = self.loop.call_soon(_sweep_writes, self.loop, self.server_state,
                                                                self.limits.write_timeout_s / 4)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._done_waiting()
        running = self._running
        if running is not None and not running.response_complete:
            # uvicorn marks only the latest cycle disconnected, which is a queued one when requests were
            # pipelined: the running one would write to the closed transport (a traceback per connection)
            running.disconnected = True
            running.message_event.set()
        super().connection_lost(exc)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # refused or closed for its head size: nothing more is parsed
            return
        if data and not self._wait():  # a kept-alive connection starts another request
            cycle = self.cycle
            return self._refuse(answer=cycle is None or cycle.response_complete)
        if data and self._in_head and self._deadline is None:
            # bytes before a request begins (a stray CRLF after a reply starts none) cancel uvicorn's keep-alive
            # timer: without this deadline such a connection was held for good
            self._arm(self.limits.head_timeout_s, True)
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
        self._wait()  # a request pipelined behind one completed in this read: its slot was just given back
        super().on_message_begin()
        if self._deadline is None:
            self._arm(self.limits.head_timeout_s, True)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        self._arm(self.limits.body_timeout_s, False)
        cap = self.limit_concurrency
        if (cap is not None and self.url.split(b"?", 1)[0] == b"/healthz" and len(self.tasks) < cap
                and self.parser.get_method() in (b"GET", b"HEAD")):
            self.limit_concurrency = None  # over the connection cap: uvicorn checks it in this call
            try:
                super().on_headers_complete()
            finally:
                self.limit_concurrency = cap
        else:
            super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._done_waiting()
        self._in_head = True
        super().on_message_complete()


def _sweep_writes(loop: asyncio.AbstractEventLoop, state: Any, interval: float) -> None:
    """Check every connection's queued reply (:meth:`GuardedHttpTools.check_write`), then again in ``interval``."""
    now = loop.time()
    for conn in list(state.connections):
        if isinstance(conn, GuardedHttpTools):
            conn.check_write(now)
    state.write_sweep = loop.call_later(interval, _sweep_writes, loop, state, interval)


def loop_factory(handshake_timeout_s: float) -> Callable[[], asyncio.AbstractEventLoop]:
    """uvicorn's ``loop`` setting (a custom one is the loop's constructor): uvloop where installed, else asyncio,
    whose TLS servers close a connection whose handshake is not complete within ``handshake_timeout_s``
    (asyncio's and uvloop's default is 60 s, and uvicorn has no setting for it)."""
    try:
        import uvloop

        base: type[asyncio.AbstractEventLoop] = uvloop.Loop
    except ImportError:
        base = asyncio.SelectorEventLoop

    class GuardedLoop(base):  # type: ignore[valid-type,misc]
        async def create_server(self, *args: Any, **kwargs: Any) -> asyncio.AbstractServer:
            if kwargs.get("ssl") is not None:
                kwargs.setdefault("ssl_handshake_timeout", handshake_timeout_s)
            return await super().create_server(*args, **kwargs)

    return GuardedLoop


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
    """uvicorn.run keyword arguments for ``limits`` (the protocol class, event loop, connection cap, proxy
    trust)."""
    protocol = type("GuardedHttpToolsConfigured", (GuardedHttpTools,),
                    {"limits": limits, "trusted": trusted_peers(limits.trusted_proxies)})
    soft = raise_fd_limit()
    return {"http": protocol, "limit_concurrency": max(1, min(limits.max_connections, soft - 64)),
            "timeout_keep_alive": limits.keep_alive_s, "loop": loop_factory(limits.head_timeout_s),
            "proxy_headers": bool(limits.trusted_proxies),
            "forwarded_allow_ips": list(limits.trusted_proxies) or None}
