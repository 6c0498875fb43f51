"""fl_server/service/accept.py: a burst of connections is accepted in one event-loop pass (libuv accepts one per
pass, which left the tail of a 200-device burst in the kernel's accept queue; docs/coordinator.md, "Load test")."""
from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from fl_server.service.accept import BatchAcceptServer, batch_accept

N = 64  # connections whose handshakes completed before the server's loop ran


class Recorder(asyncio.Protocol):
    made: list[Any] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)

    def data_received(self, data: bytes) -> None:
        self.made[-1].write(data)  # echo: the connection is usable


def _loop_classes() -> list[type[asyncio.AbstractEventLoop]]:
    classes: list[type[asyncio.AbstractEventLoop]] = [asyncio.SelectorEventLoop]
    try:
        import uvloop

        classes.append(uvloop.Loop)  # the coordinator's loop, and the one that accepts one per pass
    except ImportError:
        pass
    return classes


@pytest.mark.parametrize("base", _loop_classes(), ids=lambda c: c.__module__.split(".")[0])
def test_a_burst_of_connections_is_accepted_within_a_few_loop_passes(base: type[asyncio.AbstractEventLoop]) -> None:
    loop = batch_accept(base)()
    Recorder.made = []
    clients: list[socket.socket] = []
    try:
        server = loop.run_until_complete(loop.create_server(Recorder, "127.0.0.1", 0, backlog=256))
        assert isinstance(server, BatchAcceptServer)
        port = server.sockets[0].getsockname()[1]
        # the kernel completes these handshakes and queues them for accept() while the loop does not run
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(N)]

        async def passes(n: int) -> None:
            for _ in range(n):
                await asyncio.sleep(0)

        loop.run_until_complete(passes(10))  # one accept per pass would have made at most ~10
        assert len(Recorder.made) == N
        clients[-1].sendall(b"ping")
        clients[-1].settimeout(5)
        loop.run_until_complete(passes(10))
        assert clients[-1].recv(4) == b"ping"
        server.close()
        loop.run_until_complete(server.wait_closed())
        assert not server.is_serving() and not server.sockets
        with pytest.raises(OSError):  # the port no longer listens
            socket.create_connection(("127.0.0.1", port), timeout=5)
    finally:
        for c in clients:
            c.close()
        for t in Recorder.made:
            t.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
