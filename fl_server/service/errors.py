"""Error bodies of the coordinator API: their OpenAPI documentation (:func:`documented`) and the exception
handlers that produce them. Every error is JSON ``{"detail": ...}`` with a message that says what is wrong
and what to do, and never echoes the request's input."""
from __future__ import annotations

import errno
import logging
import sqlite3
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.routing import Match

_FASTAPI_BODY_ERROR = "There was an error parsing the body"  # FastAPI's 400 for a body that is not UTF-8 JSON


class FieldError(BaseModel):
    loc: list[str | int] = Field(description="where: body/query/header/path, then the field")
    msg: str
    type: str


class Error(BaseModel):
    detail: str | list[FieldError] = Field(description="what is wrong and what to do (validation errors: "
                                                       "one entry per field, at most 20)")


class PendingJob(BaseModel):
    id: str
    method: str | None = Field(description="null: a recipe job that keeps its recipe's method")
    status: str
    rounds_done: int
    rounds: int | None = Field(description="null: a recipe job that keeps its recipe's rounds")


class NotReadyDetail(BaseModel):
    message: str
    jobs: list[PendingJob] = Field(description="the training that will produce the bundle")


class NotReady(BaseModel):
    detail: NotReadyDetail


_DESCRIPTIONS = {
    400: "the body is not UTF-8 JSON",
    401: "missing or unknown bearer token",
    403: "the token's scope does not allow this endpoint",
    404: "not found",
    409: "conflict with the resource's state",
    413: "request body over the size limit (1 MiB)",
    507: "the coordinator's disk is full: nothing was stored (Retry-After)",
    416: "range not satisfiable",
    422: "invalid input: schema violations (one entry per field) or a semantic check (one message)",
    429: "rate limit of this token (or, for joining, this IP) exceeded; retry after Retry-After seconds",
    503: "no bundle yet: the coordinator is still training it (Retry-After, training progress)",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
_HEADERS = {401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
            429: _RETRY_AFTER, 503: _RETRY_AFTER, 507: _RETRY_AFTER}


def documented(*codes: int, **descriptions: str) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route: each status code with its model, description and headers;
    ``descriptions`` (keyed ``e404`` etc.) replace the generic description of a code."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        entry: dict[str, Any] = {"model": NotReady if code == 503 and "e503" not in descriptions else Error,
                                 "description": descriptions.get(f"e{code}", _DESCRIPTIONS[code])}
        if code in _HEADERS:
            entry["headers"] = _HEADERS[code]
        out[code] = entry
    return out


# every authenticated route can answer these; routes with a JSON body also 400, 413 and 422
AUTH = (401, 403, 429)
BODY = (400, 413, 422)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with location and message per error, without echoing the input (which may be NaN, not JSON,
    or large)."""
    errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
              for e in exc.errors()[:20]]
    return JSONResponse({"detail": errors}, status_code=422)


def _allowed_methods(request: Request) -> list[str]:
    """The methods some route answers at the request's path (each method tried against every route; HEAD
    wherever GET is: app.HeadAsGet)."""
    allowed = [m for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
               if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in request.app.router.routes)]
    return allowed[:1] + ["HEAD"] + allowed[1:] if "GET" in allowed else allowed


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """HTTPException as JSON (FastAPI's default), with a clearer message for a body that is not UTF-8 JSON,
    and a 405's ``Allow`` listing every method of the path (Starlette names only the first route's)."""
    detail, headers = exc.detail, dict(exc.headers or {})
    if exc.status_code == 400 and detail == _FASTAPI_BODY_ERROR:
        detail = ("request body is nested too deeply (JSON arrays and objects within each other); no request "
                  "of this API nests more than 3 levels" if isinstance(exc.__cause__, RecursionError)
                  else "request body is not valid UTF-8 JSON")
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(_allowed_methods(request))
        method = "HEAD" if request.scope.get("fl.head") else request.method
        detail = f"method {method} is not allowed here; allowed: {headers['Allow']}"
    return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=headers)


async def corrupt_object(request: Request, exc: Exception) -> JSONResponse:
    """503 for a request that needs a quarantined object (artifacts.Corrupt): its method is degraded."""
    svc = request.app.state.service
    return JSONResponse({"detail": f"{exc}; the coordinator's operator must retrain or restore it"},
                        status_code=503, headers={"Retry-After": str(svc.cfg.retry_after_s)})


DISK_FULL_RETRY_S = 60


def _out_of_space(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, sqlite3.OperationalError) and "disk is full" in str(exc)  # SQLITE_FULL


async def storage_error(request: Request, exc: Exception) -> JSONResponse:
    """507 Insufficient Storage (with Retry-After) when a write failed for want of space (ENOSPC, EDQUOT,
    SQLite's "database or disk is full"); /healthz reports the disk degraded while it is under
    FL_SERVE_MIN_FREE_BYTES free. Any other storage
    error is a 500 (:func:`server_error`)."""
    if not _out_of_space(exc):  # handled here, so not re-raised by Starlette: log it
        logging.getLogger("fl_server.service").error("error on %s %s", request.method, request.url.path,
                                                     exc_info=exc)
        return await server_error(request, exc)
    return JSONResponse({"detail": "the coordinator's disk is full: nothing was stored; retry later"},
                        status_code=507, headers={"Retry-After": str(DISK_FULL_RETRY_S)})


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: JSON 500 instead of a text page (Starlette re-raises it, so the server logs the traceback)."""
    return JSONResponse({"detail": "internal error; the coordinator's log has the details"}, status_code=500)
