"""A minimal HTTP/1.1 keep-alive client on asyncio streams, the load generator's default device
(``coordinator_load.py --client raw``): one connection, one request at a time, Content-Length bodies only
(what the coordinator sends). It costs ~4x less CPU per request than httpx, so on a 2-core box the load
generator stops being what limits the measurement and the server's own capacity shows. Not a general client."""
from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


class RawConnection:
    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError("the raw client speaks plain http:// only")
        self.host, self.port = u.hostname, u.port or 80
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body) of one request on the kept-alive connection."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}",
                 *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self._writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        head = await self._reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        hdrs = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
        if "content-length" not in hdrs:
            raise ValueError("response without Content-Length (not supported by this client)")
        return status, hdrs, await self._reader.readexactly(int(hdrs["content-length"]))

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()
