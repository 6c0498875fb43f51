"""Bearer-token scopes: ``client`` tokens come from joining, the ``admin`` token from the operator."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(auto_error=False, description="token from POST /v1/clients (client) or the operator (admin)")


@dataclass(frozen=True)
class Principal:
    scope: str
    client_id: str | None


def _principal(request: Request, creds: HTTPAuthorizationCredentials | None) -> Principal:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)",
                            headers={"WWW-Authenticate": "Bearer"})
    found = request.app.state.service.store.lookup_token(creds.credentials[:512])
    if found is None:
        raise HTTPException(401, "unknown bearer token", headers={"WWW-Authenticate": "Bearer"})
    return Principal(*found)


async def require_client(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> Principal:
    p = _principal(request, creds)
    if p.scope != "client":
        raise HTTPException(403, "this endpoint needs a client token (join with POST /v1/clients)")
    return p


async def require_admin(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> Principal:
    p = _principal(request, creds)
    if p.scope != "admin":
        raise HTTPException(403, "this endpoint needs the admin token")
    return p
