"""App factory: ``create_app(store_dir)`` builds the coordinator (FastAPI) around a :class:`Service`."""
from __future__ import annotations

import gc
import logging
import sqlite3
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fl_server.service import apidocs, dashboard, publish_api, routes
from fl_server.service.fastpath import ArtifactFastPath
from fl_server.service.artifacts import Corrupt
from fl_server.service.errors import corrupt_object, http_error, server_error, storage_error, validation_error
from fl_server.service.config import ServiceConfig, load_plugins
from fl_server.service.metrics import Metrics
from fl_server.service.state import Service


class GuardMiddleware:
    """Pure ASGI middleware: rejects bodies over ``max_body`` bytes with 413 (by Content-Length, and by
    counting a streamed body) and records every request in :class:`Metrics`.

    A streamed body that grows too large makes ``receive`` raise; FastAPI turns any error while reading a
    body into its own 400, so once the limit is crossed the app's response is replaced by the 413."""

    def __init__(self, app: ASGIApp, metrics: Metrics, max_body: int,
                 path_limits: dict[str, int] | None = None) -> None:
        self.app, self.metrics, self.max_body = app, metrics, max_body
        self.path_limits = path_limits or {}  # paths with their own limit (bundle uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]
        max_body = self.path_limits.get(scope["path"], self.max_body)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            await _reject(send, f"request body over {max_body} bytes")
            self.metrics.observe(scope["method"], scope["path"], 413, time.perf_counter() - start)
            return
        seen, over, rejected = [0], [False], [False]

        async def reject() -> None:
            if not rejected[0]:
                rejected[0], status[0] = True, 413
                await _reject(send, f"request body over {max_body} bytes")

        async def counted() -> Message:
            msg = await receive()
            seen[0] += len(msg.get("body", b""))
            if seen[0] > max_body:
                over[0] = True
                raise _TooLarge
            return msg

        async def tap(msg: Message) -> None:
            if over[0]:  # whatever the app answers to a cut-off body
                return await reject()
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, counted, tap)
        except _TooLarge:
            await reject()
        finally:
            self.metrics.observe(scope["method"], scope["path"], status[0], time.perf_counter() - start)


class _TooLarge(Exception):
    pass


class HeadAsGet:
    """Pure ASGI middleware: HEAD is answered wherever GET is (RFC 9110 9.3.2): the request is routed as a GET
    (``scope["fl.head"]`` marks it) and the response's body is dropped, its headers (Content-Length included)
    kept."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(msg: Message) -> None:
            if msg["type"] == "http.response.body":
                if msg.get("more_body", False):
                    return
                msg = {"type": "http.response.body", "body": b""}
            await send(msg)

        await self.app({**scope, "method": "GET", "fl.head": True}, receive, headers_only)


async def _reject(send: Send, message: str) -> None:
    body = ('{"detail": "%s"}' % message).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(store_dir: str | Path, **overrides: Any) -> FastAPI:
    """The coordinator app on ``store_dir`` (SQLite + content-addressed artifacts + job runs); keyword
    arguments override :class:`ServiceConfig` fields. Training starts when the app starts (lifespan). The
    operator's plugins (``FL_SERVE_PLUGINS``) are imported first, so the methods they register are served."""
    load_plugins()
    svc = Service(ServiceConfig(store_dir=Path(store_dir), **overrides))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logging.getLogger("fl_server.service").setLevel(logging.INFO)
        svc.start()
        # Everything loaded so far (torch, the app, the served bundles) lives as long as the process: move it
        # out of the collector's reach, so a full collection during a burst of requests scans only request
        # garbage (benchmarks/profile_burst.py showed a gen-2 pass of ~90 ms mid-burst before; docs/coordinator.md).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            svc.stop()

    app = FastAPI(title="fl-edge coordinator", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Federated test-time adaptation: join, manifests, content-addressed artifacts, "
                              "ODPFL-HN weight generation, BTFL DLE aggregation, training jobs.")
    app.state.service = svc
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Corrupt, corrupt_object)
    app.add_exception_handler(OSError, storage_error)
    app.add_exception_handler(sqlite3.Error, storage_error)
    app.add_exception_handler(Exception, server_error)
    app.include_router(routes.router)
    app.include_router(publish_api.router)
    app.include_router(dashboard.router)
    apidocs.install(app)  # /docs and /redoc from vendored assets (no CDN)
    app.add_middleware(ArtifactFastPath, service=svc)  # inside GuardMiddleware: limits and metrics apply
    app.add_middleware(HeadAsGet)
    app.add_middleware(GuardMiddleware, metrics=svc.metrics, max_body=svc.cfg.max_body_bytes,
                       path_limits={publish_api.PATH: svc.cfg.max_bundle_bytes})
    return app
