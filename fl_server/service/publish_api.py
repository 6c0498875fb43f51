"""``POST /v1/bundles`` (admin): publish a bundle exported elsewhere, sent as a tar archive of its directory
(:mod:`fl_server.service.publish` checks it). The body is spooled to disk as it arrives, bounded by
``ServiceConfig.max_bundle_bytes`` (the API's usual 1 MiB body limit does not apply to this path)."""
from __future__ import annotations

import tempfile
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from fl_server.service.auth import Principal, require_admin
from fl_server.service.errors import AUTH, documented
from fl_server.service.publish import PublishError

router = APIRouter()
PATH = "/v1/bundles"


class Published(BaseModel):
    bundle_id: str
    method: str
    dataset: str
    version: int  # the release version the coordinator assigned (rising per method)
    manifest_url: str
    signing_key: str


@router.post(PATH, response_model=Published, status_code=201, tags=["jobs"],
             responses=documented(*AUTH, 400, 413, 422, e400="the body is not a tar archive",
                                  e413="the archive is over FL_SERVE_MAX_BUNDLE_BYTES",
                                  e422="not a valid bundle: the message says what is wrong"),
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def publish(request: Request, _: Principal = Depends(require_admin)) -> dict[str, Any]:
    """Publish a bundle directory exported elsewhere (``fl-server export``), sent as a tar archive (plain or
    gzip): it is verified (names, sizes, sha256s, ONNX graphs load, weights without pickle), stored, and served
    to devices like a bundle the coordinator trained, its manifest signed with the coordinator's key as a
    release with the method's next version (a publisher's own signature is ignored); it becomes the bundle
    served for its method. Publishing an earlier bundle again serves it under a new version (a rollback)."""
    svc = request.app.state.service
    with tempfile.SpooledTemporaryFile(max_size=8 << 20) as body:
        async for chunk in request.stream():
            body.write(chunk)
        if body.tell() == 0:
            raise HTTPException(400, "empty body: send the bundle directory as a tar archive")
        body.seek(0)
        try:
            out = await run_in_threadpool(svc.publish, body)
        except PublishError as exc:
            status = 400 if str(exc).startswith("the body is not a tar") else 422
            raise HTTPException(status, str(exc)) from None
    return {**out, "manifest_url": f"/v1/manifest?method={out['method']}", "signing_key": svc.signer.public_hex}
