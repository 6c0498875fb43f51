"""The artifact fast path: plain ``GET /v1/artifacts/{sha256}`` answered below FastAPI's routing.

Artifacts are content-addressed and immutable, and a joining device fetches every one of its bundle (4 of the
7 requests of an ODPFL-HN join), so under a burst of devices they are most of the coordinator's requests.
Through FastAPI (routing, dependency injection, header parameters, Response) one took ~0.4 ms in the server;
here ~0.09 ms (server-side means, docs/benchmarks/coordinator-load-series.json). Only the plain case is taken:
a GET of a lower-case hex address the service publishes, with no Range, If-Range or If-None-Match header, of an
artifact held in memory. Everything else (ranges, conditional requests, HEAD, files streamed from disk, unknown
addresses, errors) goes to the documented route in ``routes.py``, which uses the same :func:`artifact_headers`;
a test checks both paths answer the same bytes and headers. It sits inside :class:`GuardMiddleware`, so body
limits and the /metrics histograms cover it like any other request."""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from fl_server.service.artifacts import Corrupt
from fl_server.service.state import Service

PREFIX = "/v1/artifacts/"
_CONDITIONAL = {b"range", b"if-range", b"if-none-match"}


def artifact_headers(svc: Service, sha256: str) -> dict[str, str]:
    """The headers of every answer about a served artifact (200, 206, 304, 416)."""
    headers = {"ETag": f'"{sha256}"', "Accept-Ranges": "bytes", "Cache-Control": "public, max-age=31536000, immutable"}
    if svc.is_bundle(sha256):  # a manifest: its detached signature travels in a header too
        headers["X-Manifest-Signature"] = json.dumps(svc.signature(sha256), separators=(",", ":"))
    return headers


class ArtifactFastPath:
    """Pure ASGI: answers the plain artifact GET itself, hands every other request to ``app``."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app, self.svc = app, service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "GET" or not scope["path"].startswith(PREFIX)
                or scope.get("query_string")):
            return await self.app(scope, receive, send)
        sha256 = scope["path"][len(PREFIX):]
        # published addresses are lower-case sha256 hex, so the set lookup is the whole address check
        if not self.svc.is_public(sha256) or any(name in _CONDITIONAL for name, _ in scope["headers"]):
            return await self.app(scope, receive, send)
        try:
            data = self.svc.cached_artifact(sha256)
        except Corrupt:  # quarantined: the route answers 503
            data = None
        if data is None:  # too large to keep in memory: the route streams it from disk
            return await self.app(scope, receive, send)
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                   for k, v in artifact_headers(self.svc, sha256).items()]
        headers += [(b"content-length", str(len(data)).encode()), (b"content-type", b"application/octet-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data})
