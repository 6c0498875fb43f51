"""A total deadline under httpx's sync client: connect, TLS, request, reply headers and body together.

httpx's timeouts are per operation: a server that trickles its reply headers one byte a second never trips a
read timeout, and httpx returns the response only once the headers are complete, so a caller cannot check the
time in between. :func:`guard` wraps the network backend of an httpx transport's connection pool (httpcore,
which httpx is built on) so that every connect, TLS handshake, read and write waits at most until the end set
by :func:`attempt` for the calling thread, and fails with a timeout naming the deadline once it has passed.

    guard(client)                      # once, after building the httpx.Client
    with attempt(10.0):                # every network operation inside ends within 10 s in all
        client.get("/slow")
"""
from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpcore
import httpx

_END: contextvars.ContextVar[tuple[float, float]] = contextvars.ContextVar("edge_sdk_deadline",
                                                                           default=(math.inf, math.inf))
# the start of the message of a timeout the deadline caused, by the operation that was cut off
_WHAT = {httpcore.ReadTimeout: "reply not complete", httpcore.WriteTimeout: "request not sent",
         httpcore.ConnectTimeout: "not connected"}


@contextmanager
def attempt(seconds: float, end: float | None = None) -> Iterator[float]:
    """Network operations of this thread inside the block end by ``seconds`` from now (or ``end``, a
    ``time.monotonic()``, when sooner); yields that end."""
    now = time.monotonic()
    stop = min(now + seconds, end if end is not None else math.inf)
    token = _END.set((stop, round(stop - now, 2)))  # the seconds the message names
    try:
        yield stop
    finally:
        _END.reset(token)


def _budget(timeout: float | None) -> tuple[float | None, bool]:
    """(the timeout to use, whether the deadline shortened it); raises nothing: callers raise their own type."""
    end, _ = _END.get()
    if end == math.inf:
        return timeout, False
    left = end - time.monotonic()
    if timeout is not None and timeout <= left:
        return timeout, False
    return max(left, 0.0), True


def _passed(error: type[Exception]) -> str:
    return f"{_WHAT[error]} after {_END.get()[1]:g}s"


def caused(exc: Exception) -> bool:
    """Whether ``exc`` (an httpx timeout) is the deadline's, whose message says what was cut off and when."""
    return str(exc).startswith(tuple(_WHAT.values()))


def _bounded(call: Any, timeout: float | None, error: type[Exception], *args: Any) -> Any:
    t, capped = _budget(timeout)
    if capped and t <= 0:
        raise error(_passed(error))
    try:
        return call(*args, t)
    except error:
        if capped:
            raise error(_passed(error)) from None
        raise


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return _bounded(self._inner.read, timeout, httpcore.ReadTimeout, max_bytes)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        _bounded(self._inner.write, timeout, httpcore.WriteTimeout, buffer)

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        tls = _bounded(lambda t: self._inner.start_tls(ssl_context, server_hostname, t), timeout,
                       httpcore.ConnectTimeout)
        return _Stream(tls)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        return _Stream(_bounded(lambda t: self._inner.connect_tcp(host, port, t, local_address, socket_options),
                                timeout, httpcore.ConnectTimeout))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        return _Stream(_bounded(lambda t: self._inner.connect_unix_socket(path, t, socket_options), timeout,
                                httpcore.ConnectTimeout))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def guard(client: httpx.Client) -> int:
    """Put the deadline under every httpx-built transport of ``client`` (its own and its proxy mounts); returns
    how many it guarded. A transport of the caller's own kind (not an ``httpx.HTTPTransport``) is left as it
    is: the caller's checks between the chunks of a body still bound it."""
    transports = [getattr(client, "_transport", None), *getattr(client, "_mounts", {}).values()]
    guarded = 0
    for transport in transports:
        pool = getattr(transport, "_pool", None) if isinstance(transport, httpx.HTTPTransport) else None
        backend = getattr(pool, "_network_backend", None)
        if isinstance(backend, httpcore.NetworkBackend) and not isinstance(backend, _Backend):
            pool._network_backend = _Backend(backend)  # type: ignore[union-attr]
            guarded += 1
    return guarded
