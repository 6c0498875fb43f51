"""Bearer-token scopes: ``client`` tokens come from joining, the ``admin`` token from the operator.
Every authenticated request also takes one request from its token's rate-limit bucket (429 when empty)."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from fl_server.service.ratelimit import client_address
from fl_server.service.store import hash_token

_bearer = HTTPBearer(auto_error=False, description="token from POST /v1/clients (client) or the operator (admin)")
MAX_TOKEN_CHARS = 512  # issued tokens are 47 characters


@dataclass(frozen=True)
class Principal:
    scope: str
    client_id: str | None
    source: str | None = None  # where the client joined from: "enr:<enrollment id>" or "ip:<address>"


def _principal(request: Request, creds: HTTPAuthorizationCredentials | None, scope: str, hint: str) -> Principal:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)",
                            headers={"WWW-Authenticate": "Bearer"})
    if len(creds.credentials) > MAX_TOKEN_CHARS:
        raise HTTPException(401, f"unknown bearer token (over {MAX_TOKEN_CHARS} characters)",
                            headers={"WWW-Authenticate": "Bearer"})
    svc = request.app.state.service
    found = svc.principal(creds.credentials)
    if found is None:
        raise HTTPException(401, "unknown bearer token", headers={"WWW-Authenticate": "Bearer"})
    if found[0] != scope:
        raise HTTPException(403, hint)
    svc.token_limits.check(hash_token(creds.credentials), "this token")
    if scope == "client":  # many minted tokens share their address's and their enrollment's limit
        svc.address_limits.check(f"ip:{client_address(request)}", "this address")
        if found[2] and found[2].startswith("enr:"):
            svc.address_limits.check(found[2], "this enrollment")
    return Principal(found[0], found[1], found[2])


async def require_client(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> Principal:
    return _principal(request, creds, "client", "this endpoint needs a client token (join with POST /v1/clients)")


async def require_admin(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> Principal:
    """The admin token; every refused attempt (401, 403) takes one from its address's failure bucket, and an
    address whose bucket is empty gets 429 before any token is looked at (no guessing at full speed)."""
    failures, key = request.app.state.service.admin_failures, f"ip:{client_address(request)}"
    failures.check(key, "failed admin authentications from this address", consume=False)
    try:
        return _principal(request, creds, "admin", "this endpoint needs the admin token")
    except HTTPException as exc:
        if exc.status_code in (401, 403):
            failures.take(key)
        raise
