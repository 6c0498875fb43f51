"""The API routers. Endpoint names are a contract (issue 8); shapes are in :mod:`schemas`."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from edge_sdk import btfl, tensors
from fl_server.recipes.errors import RecipeError
from fl_server.recipes.loader import resolve_in_dir
from fl_server.service import schemas as S
from fl_server.service.auth import Principal, require_admin, require_client
from fl_server.service.dle import ShapeMismatch, view_json
from fl_server.service.errors import AUTH, BODY, documented
from fl_server.service.fastpath import artifact_headers
from fl_server.service.ratelimit import limit_join
from fl_server.service.ranges import Unsatisfiable, parse_range
from fl_server.service.state import NONE_METHOD, Service
from fl_server.service.store import JOB_STATES, RegistryFull

router = APIRouter()


async def service(request: Request) -> Service:
    return request.app.state.service


def _not_ready(svc: Service, what: str) -> HTTPException:
    detail = {"message": f"{what} is not ready yet: the coordinator is still training it; retry later",
              **svc.pending_default()}
    return HTTPException(503, detail, headers={"Retry-After": str(svc.cfg.retry_after_s)})


def _bundle_or_503(svc: Service, method: str | None) -> dict[str, Any]:
    bundle = svc.bundle_for(method)
    if bundle is not None:
        return bundle
    if method not in (None, NONE_METHOD) and not any(
            j["spec"]["method"] == method and j["status"] in ("queued", "running") for j in svc.store.jobs()):
        have = ", ".join(svc.methods()) or "none yet"
        raise HTTPException(404, f"no bundle and no job for method {method!r}; available: {have}")
    raise _not_ready(svc, f"a bundle for {method or 'the default method'}")


# ----------------------------------------------------------------- public
@router.get("/healthz", response_model=S.Health, tags=["ops"])
async def healthz(svc: Service = Depends(service)) -> dict[str, Any]:
    counts = {s: 0 for s in JOB_STATES}
    for j in svc.store.jobs():
        counts[j["status"]] += 1
    return {"status": "ok", "bundles": svc.store.count("bundles"), "jobs": counts,
            "signing_key": svc.signer.public_hex}


@router.get("/v1/signing-key", response_model=S.SigningKey, tags=["devices"])
async def signing_key(svc: Service = Depends(service)) -> dict[str, str]:
    """The public key that signs every bundle manifest (Ed25519). Pin it on the device out of band
    (``EdgeClient(url, public_key=...)``); fetching it over the same connection is trust on first use."""
    return {"alg": "Ed25519", "public_key": svc.signer.public_hex}


@router.post("/v1/clients", response_model=S.JoinResponse, status_code=201, tags=["devices"],
             responses=documented(*BODY, 404, 429, 503, e404="no bundle and no job for this method"),
             dependencies=[Depends(limit_join)])
async def join(body: S.JoinRequest, request: Request, svc: Service = Depends(service)) -> Response:
    """Join as a new client: a client id, a bearer token, the methods served now and the bundle's manifest."""
    bundle = _bundle_or_503(svc, body.method)
    try:
        client_id, token = svc.store.add_client(body.method or bundle["method"], bundle["id"],
                                                request.headers.get("user-agent", ""), svc.cfg.max_clients,
                                                svc.cfg.unused_client_ttl_s)
    except RegistryFull as exc:
        raise HTTPException(503, str(exc)) from None
    head = json.dumps({"client_id": client_id, "token": token, "methods": svc.methods()})
    return Response(head[:-1].encode() + b', "manifest": ' + svc.manifest_json(bundle) + b"}", status_code=201,
                    media_type="application/json")


@router.get("/v1/manifest", response_model=S.Manifest, tags=["devices"],
            responses=documented(404, 422, 503, e404="no bundle and no job for this method"))
async def manifest(method: str | None = Query(None, max_length=S.MAX_METHOD_CHARS),
                   svc: Service = Depends(service)) -> Response:
    """The newest bundle's manifest for ``method`` (default: the default bundle)."""
    bundle = _bundle_or_503(svc, method)
    return Response(svc.manifest_json(bundle), media_type="application/json",
                    headers={"ETag": f'"{bundle["id"]}"', "Cache-Control": "no-cache"})


@router.get("/v1/artifacts/{sha256}", tags=["devices"], response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}}},
                       206: {"description": "partial content", "content": {"application/octet-stream": {}}},
                       304: {"description": "If-None-Match matched"},
                       **documented(404, 416, 422, e404="no such artifact (addresses come from a manifest)")})
async def artifact(sha256: str, range_: str | None = Header(None, alias="range"),
             if_none_match: str | None = Header(None), if_range: str | None = Header(None),
             svc: Service = Depends(service)) -> Response:
    """Artifact bytes by content address. ETag is the sha256; single byte ranges are honoured."""
    if not svc.is_public(sha256):
        raise HTTPException(404, f"no artifact {sha256[:80]!r} (addresses come from a manifest)")
    etag = f'"{sha256}"'
    headers = artifact_headers(svc, sha256)  # plain GETs are answered by fastpath.ArtifactFastPath
    if if_none_match is not None and etag in [t.strip() for t in if_none_match.split(",")] + ['"*"', "*"]:
        return Response(status_code=304, headers=headers)
    data = svc.cached_artifact(sha256)
    path = svc.artifacts.path(sha256)
    size = len(data) if data is not None else path.stat().st_size
    try:
        span = parse_range(range_, size) if if_range in (None, etag) else None
    except Unsatisfiable:
        return JSONResponse({"detail": f"range {range_[:80]!r} is outside the artifact's {size} bytes"},
                            status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
    status, (first, last) = (200, (0, size - 1)) if span is None else (206, span)
    if span is not None:
        headers["Content-Range"] = f"bytes {first}-{last}/{size}"
    if data is not None:
        return Response(data[first:last + 1], status_code=status, media_type="application/octet-stream",
                        headers=headers)
    # content-addressed files are written once, atomically: reading by path gives the addressed bytes
    return StreamingResponse(_file_chunks(path, first, last), status_code=status,
                             media_type="application/octet-stream",
                             headers={**headers, "Content-Length": str(last - first + 1)})


def _file_chunks(path: Path, first: int, last: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Bytes first..last (inclusive) of a file, 1 MiB at a time (run in a worker thread by Starlette)."""
    with open(path, "rb") as fh:
        fh.seek(first)
        left = last - first + 1
        while left > 0 and (block := fh.read(min(chunk, left))):
            left -= len(block)
            yield block


# ----------------------------------------------------------------- methods
@router.post("/v1/hypernetwork/generate", response_model=S.GenerateResponse, tags=["methods"],
             responses={**documented(*AUTH, *BODY, 404, 503, e404="no ODPFL-HN bundle with this bundle_id",
                                     e422="wrong embedding dimension, values outside [-1e6, 1e6] or not finite"),
                        200: {"description": "the weights: JSON (default) or, when the request's Accept names "
                                             f"{tensors.MEDIA_TYPE}, that binary format (safetensors layout: u64 "
                                             "LE header length, JSON header, raw little-endian float32; "
                                             "edge_sdk.tensors)",
                              "content": {tensors.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}})
async def generate(body: S.GenerateRequest, request: Request, _: Principal = Depends(require_client),
                   svc: Service = Depends(service)) -> Response:
    """ODPFL-HN: personalised weights w = f_theta(e) from the client's embedding e (nothing else is accepted).
    ``Accept: application/vnd.fl-edge.weights`` selects the binary reply (what edge_sdk asks for)."""
    if body.bundle_id is not None:
        bundle = svc.bundle_by_id(body.bundle_id)
        if bundle is None or "hn" not in bundle["server"]:
            raise HTTPException(404, f"no ODPFL-HN bundle {body.bundle_id}")
    else:
        bundle = _bundle_or_503(svc, "ODPFL-HN")
    dim = svc.hypernets.embed_dim(bundle)
    if len(body.embedding) != dim:
        raise HTTPException(422, f"embedding must have {dim} values (the bundle's encoder output), "
                                 f"got {len(body.embedding)}")
    binary = tensors.MEDIA_TYPE in request.headers.get("accept", "")
    body_bytes = await svc.generator.generate(bundle, np.asarray(body.embedding, dtype=np.float32), binary)
    return Response(body_bytes, media_type=tensors.MEDIA_TYPE if binary else "application/json",
                    headers={"Vary": "Accept"})


def _dle_view(svc: Service, client_id: str) -> dict[str, Any]:
    """Global DLE = per-client average of the BTFL bundle's training-time DLE (when a BTFL bundle is served;
    it counts as its training clients) and every client's latest upload of that shape; ``others_dle`` leaves
    the caller's own upload out."""
    base = svc.btfl_base()
    view = svc.dles.view(client_id, base)
    if view is None:
        raise HTTPException(404, "no DLE yet: no BTFL bundle is served and no client has uploaded one")
    return view_json(view, base)


@router.post("/v1/btfl/dle", response_model=S.DLEResponse, tags=["methods"],
             responses=documented(*AUTH, *BODY, e422="not a [D, levels] frequency table, or its shape differs "
                                                     "from the other clients' DLEs"))
def upload_dle(body: S.DLEUpload, who: Principal = Depends(require_client),
               svc: Service = Depends(service)) -> dict[str, Any]:
    """BTFL: a participating client uploads its local DLE (replacing its previous one); the global DLE is
    re-aggregated as the average of every client's latest DLE and, when a BTFL bundle is served, its
    training clients' DLE (BTFL Sec. 4.1; every client weighs the same, whatever its num_samples)."""
    assert who.client_id is not None
    if len({len(row) for row in body.freqs}) != 1:
        raise HTTPException(422, "invalid DLE: every row of freqs must have the same number of levels")
    try:
        freqs = btfl.average_dles([np.asarray(body.freqs, dtype=np.float64)])  # validates the rows
    except ValueError as exc:
        raise HTTPException(422, f"invalid DLE: {exc}") from None
    if freqs.shape[1] > S.MAX_DLE_LEVELS:
        raise HTTPException(422, f"a DLE has at most {S.MAX_DLE_LEVELS} levels, got {freqs.shape[1]}")
    try:
        svc.dles.put(who.client_id, body.freqs, body.num_samples, svc.btfl_base())
    except ShapeMismatch as exc:
        raise HTTPException(422, str(exc)) from None
    return _dle_view(svc, who.client_id)


@router.get("/v1/btfl/dle", response_model=S.DLEResponse, tags=["methods"],
            responses=documented(*AUTH, 404, e404="no DLE has been uploaded yet"))
def global_dle(who: Principal = Depends(require_client), svc: Service = Depends(service)) -> dict[str, Any]:
    """The current global DLE."""
    assert who.client_id is not None
    return _dle_view(svc, who.client_id)


# -------------------------------------------------------------------- jobs
def _job_view(svc: Service, job: dict[str, Any], with_rounds: bool) -> dict[str, Any]:
    rounds = svc.store.rounds(job["id"])
    return {**job, "rounds_done": len(rounds), "rounds": rounds if with_rounds else None}


@router.post("/v1/jobs", response_model=S.Job, status_code=201, tags=["jobs"],
             responses=documented(*AUTH, *BODY, 404, e404="no such recipe file in the recipe directory"))
def create_job(body: S.JobRequest, _: Principal = Depends(require_admin), svc: Service = Depends(service)) -> dict:
    """Start a training recipe on a data set and partition; it is exported and served when done."""
    if body.partition == "dirichlet" and body.alpha is None:
        raise HTTPException(422, "partition 'dirichlet' needs alpha")
    spec = body.model_dump(exclude_none=body.recipe is None)  # jobs without a recipe keep their former spec
    if body.recipe is not None:
        try:
            resolve_in_dir(svc.cfg.recipes_dir, body.recipe)  # the file must exist now; the worker loads it
        except RecipeError as exc:
            raise HTTPException(404 if svc.cfg.recipes_dir else 422, str(exc)) from None
    job_id = svc.runner.submit(spec)
    job = svc.store.job(job_id)
    assert job is not None
    return _job_view(svc, job, True)


@router.get("/v1/jobs", response_model=list[S.Job], tags=["jobs"], responses=documented(*AUTH))
def list_jobs(_: Principal = Depends(require_admin), svc: Service = Depends(service)) -> list[dict]:
    return [_job_view(svc, j, False) for j in svc.store.jobs()]


@router.get("/v1/jobs/{job_id}", response_model=S.Job, tags=["jobs"],
            responses=documented(*AUTH, 404, 422, e404="no such job"))
def get_job(job_id: str, _: Principal = Depends(require_admin), svc: Service = Depends(service)) -> dict:
    """One job with its round curve (validation / new-client accuracy per round)."""
    job = svc.store.job(job_id[:64])
    if job is None:
        raise HTTPException(404, f"no job {job_id[:64]!r}")
    return _job_view(svc, job, True)


# ------------------------------------------------------------------ metrics
@router.get("/metrics", response_class=PlainTextResponse, tags=["ops"])
def metrics(svc: Service = Depends(service)) -> PlainTextResponse:
    """Prometheus text format: request counters and latencies, clients, jobs by status, bundles, DLEs."""
    counts = {s: 0 for s in JOB_STATES}
    for j in svc.store.jobs():
        counts[j["status"]] += 1
    gauges = {
        "fl_clients": ("Joined clients.", {(): float(svc.store.count("clients"))}),
        "fl_bundles": ("Bundles served.", {(): float(svc.store.count("bundles"))}),
        "fl_btfl_dles": ("Clients with an uploaded DLE.", {(): float(svc.store.count("dles"))}),
        "fl_jobs": ("Training jobs by status.", {(("status", s),): float(n) for s, n in counts.items()}),
    }
    return PlainTextResponse(svc.metrics.render(gauges), media_type="text/plain; version=0.0.4")
