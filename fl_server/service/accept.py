"""Accept every pending connection each time a listening socket is readable, not one per event-loop pass.

libuv 1.45+ (so uvloop, which ``fl-server serve`` runs on) accepts one connection per event-loop iteration
(libuv commit 6c692ad, "unix: don't accept() connections in a loop"). Under a burst each iteration also runs
the requests of every connection already open, so the rest of the burst waits in the kernel's accept queue
after its TCP handshake has completed: with 200 devices connecting at once, 10-35% of the connections were
accepted 0.4-1.2 s after the first (``benchmarks/coordinator_load.py``; docs/coordinator.md, "Load test").

:func:`batch_accept` wraps a loop class: its ``create_server`` binds as before, then serves each listening
socket itself, accepting up to ``backlog`` connections per readiness (what asyncio's own loop does) and
handing each to the loop's ``connect_accepted_socket`` (the same protocol factory; TLS with the same handshake
deadline). A failed accept for want of descriptors pauses accepting for a second, as asyncio does.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import ssl as ssl_module
from typing import Any, Callable

log = logging.getLogger("fl_server.service")
RETRY_S = 1.0  # pause after accept() ran out of descriptors (asyncio's ACCEPT_RETRY_DELAY)
_TRANSIENT = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM}  # this connection is gone: go on accepting


class BatchAcceptServer(asyncio.AbstractServer):
    """Listening sockets served with batched accepts (module docstring); what ``create_server`` returns."""

    def __init__(self, loop: asyncio.AbstractEventLoop, socks: list[socket.socket], factory: Callable[[], Any],
                 backlog: int, tls: dict[str, Any]) -> None:
        self._loop, self._socks, self._factory = loop, socks, factory
        self._backlog, self._tls = backlog, tls
        self._serving = False
        self._pending: set[asyncio.Task[Any]] = set()  # connections whose transport (or TLS handshake) is being set up

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._socks)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        if not self._serving and self._socks:
            self._serving = True
            for sock in self._socks:
                sock.listen(self._backlog)
                self._loop.add_reader(sock.fileno(), self._accept, sock)

    def close(self) -> None:
        if self._socks:
            for sock in self._socks:
                self._loop.remove_reader(sock.fileno())
                sock.close()
            self._socks, self._serving = [], False

    async def wait_closed(self) -> None:
        if self._pending:  # connections accepted just before close(): their set-up ends or fails
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def serve_forever(self) -> None:
        await self.start_serving()
        await asyncio.Event().wait()

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(self._backlog):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _TRANSIENT:
                    continue
                log.warning("accept() on %s failed (%s): accepting again in %g s", sock.getsockname(), exc, RETRY_S)
                self._loop.remove_reader(sock.fileno())
                self._loop.call_later(RETRY_S, self._resume, sock)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._loop.connect_accepted_socket(self._factory, conn, **self._tls))
            self._pending.add(task)
            task.add_done_callback(self._connected)

    def _resume(self, sock: socket.socket) -> None:
        if self._serving and sock in self._socks:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _connected(self, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:  # e.g. a failed TLS handshake: the client's
            log.debug("connection set-up failed: %r", task.exception())  # problem, already closed


def batch_accept(loop_class: type[asyncio.AbstractEventLoop],
                 handshake_timeout_s: float | None = None) -> type[asyncio.AbstractEventLoop]:
    """``loop_class`` whose TCP servers accept in batches (module docstring). ``handshake_timeout_s``: the TLS
    handshake deadline of an accepted connection when ``create_server`` is given none."""

    class BatchAcceptLoop(loop_class):  # type: ignore[valid-type,misc]
        async def create_server(self, protocol_factory: Callable[[], Any], host: Any = None, port: Any = None,
                                **kwargs: Any) -> asyncio.AbstractServer:
            backlog = kwargs.get("backlog", 100)
            start = kwargs.pop("start_serving", True)
            ssl: ssl_module.SSLContext | None = kwargs.get("ssl")
            tls: dict[str, Any] = {}
            if ssl is not None:
                tls = {"ssl": ssl, "ssl_handshake_timeout": kwargs.get("ssl_handshake_timeout", handshake_timeout_s)}
            # the loop binds (host lists, dual stack, reuse_address: its own semantics) but does not listen
            inner = await super().create_server(protocol_factory, host, port, start_serving=False, **kwargs)
            socks = [socket.socket(fileno=os.dup(s.fileno())) for s in inner.sockets]
            inner.close()  # its descriptors; the sockets stay bound through the duplicates
            for sock in socks:
                sock.setblocking(False)
            server = BatchAcceptServer(self, socks, protocol_factory, backlog, tls)
            if start:
                await server.start_serving()
            return server

    BatchAcceptLoop.__name__ = BatchAcceptLoop.__qualname__ = f"BatchAccept{loop_class.__name__}"
    return BatchAcceptLoop
