"""The API routers. Endpoint names are a contract (clients depend on them); shapes are in :mod:`schemas`."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from edge_sdk.shared import WEIGHTS_MEDIA_TYPE, average_dles
from fl_server.recipes.errors import RecipeError
from fl_server.recipes.loader import resolve_in_dir
from fl_server.service import schemas as S
from fl_server.service.auth import Principal, require_admin, require_client
from fl_server.service.dle import ShapeMismatch, SourceFull, view_json
from fl_server.service.errors import AUTH, BODY, documented
from fl_server.service.fastpath import artifact_headers
from fl_server.service.jobs import QueueFull
from fl_server.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from fl_server.service.ratelimit import client_address, limit_join
from fl_server.service.ranges import Unsatisfiable, parse_range
from fl_server.service.state import NONE_METHOD, Service
from fl_server.service.store import EnrollmentRefused, RegistryFull

router = APIRouter()


async def service(request: Request) -> Service:
    return request.app.state.service


def _not_ready(svc: Service, what: str) -> HTTPException:
    detail = {"message": f"{what} is not ready yet: the coordinator is still training it; retry later",
              **svc.pending_default()}
    return HTTPException(503, detail, headers={"Retry-After": str(svc.cfg.retry_after_s)})


def _bundle_or_503(svc: Service, method: str | None) -> dict[str, Any]:
    """The bundle for ``method``; 503 + Retry-After while a job will produce it; 404 naming the methods that
    are served or training when none will (a device should not wait out its deadline for nothing)."""
    bundle = svc.bundle_for(method)
    if bundle is not None:
        reason = svc.degraded_reason(bundle)
        if reason is not None:
            raise HTTPException(503, f"method {bundle['method']} is degraded: {reason}",
                                headers={"Retry-After": str(svc.cfg.retry_after_s)})
        return bundle
    training = sorted({j["spec"]["method"] for j in svc.active_jobs()})
    if (method in (None, NONE_METHOD) and not training) or method not in (None, NONE_METHOD, *training):
        served = ", ".join(svc.methods()) or "none"
        raise HTTPException(404, f"no bundle and no job for method {method or 'default'!r}, so none will come; "
                                 f"available now: {served}; in training: {', '.join(training) or 'none'}")
    raise _not_ready(svc, f"a bundle for {method or 'the default method'}")


# ----------------------------------------------------------------- public
@router.get("/healthz", response_model=S.Health, tags=["ops"])
async def healthz(svc: Service = Depends(service)) -> dict[str, Any]:
    degraded = svc.degraded()
    return {"status": "degraded" if degraded else "ok", "bundles": svc.totals()["bundles"], "jobs": svc.job_counts(),
            "signing_key": svc.signer.public_hex, "degraded": degraded,
            "quarantined": svc.quarantined()}


@router.get("/v1/signing-key", response_model=S.SigningKey, tags=["devices"])
async def signing_key(svc: Service = Depends(service)) -> dict[str, str]:
    """The public key that signs every bundle manifest (Ed25519). Pin it on the device out of band
    (``EdgeClient(url, public_key=...)``); fetching it over the same connection is trust on first use."""
    return {"alg": "Ed25519", "public_key": svc.signer.public_hex}


@router.post("/v1/clients", response_model=S.JoinResponse, status_code=201, tags=["devices"],
             responses=documented(*BODY, 401, 403, 404, 429, 503, 507, e404="no bundle and no job for this method",
                                  e401="FL_SERVE_ENROLLMENT=token and no enrollment_token",
                                  e403="unknown, used-up or expired enrollment token"),
             dependencies=[Depends(limit_join)])
async def join(body: S.JoinRequest, request: Request, svc: Service = Depends(service)) -> Response:
    """Join as a new client: a client id, a bearer token, the methods served now and the bundle's manifest."""
    bundle = _bundle_or_503(svc, body.method)
    try:
        client_id, token = svc.add_client(body.method or bundle["method"], bundle["id"],
                                          request.headers.get("user-agent", ""), f"ip:{client_address(request)}",
                                          body.enrollment_token)
    except RegistryFull as exc:
        raise HTTPException(503, str(exc)) from None
    except EnrollmentRefused as exc:
        raise HTTPException(401 if body.enrollment_token is None else 403, str(exc)) from None
    head = json.dumps({"client_id": client_id, "token": token, "methods": svc.methods()})
    return Response(head[:-1].encode() + b', "manifest": ' + svc.manifest_json(bundle) + b"}", status_code=201,
                    media_type="application/json")


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an ``If-None-Match`` header matches ``etag`` (RFC 9110 13.1.2: a list of tags, or ``*``)."""
    return if_none_match is not None and any(t.strip() in (etag, f"W/{etag}", "*")
                                             for t in if_none_match.split(","))


@router.post("/v1/enrollments", response_model=S.Enrollment, status_code=201, tags=["admin"],
             responses=documented(*AUTH, *BODY, 507))
def create_enrollment(body: S.EnrollmentRequest, _: Principal = Depends(require_admin),
                      svc: Service = Depends(service)) -> dict[str, Any]:
    """An enrollment token (admin): what a device presents to join (``enrollment_token``) when the coordinator
    runs with ``FL_SERVE_ENROLLMENT=token``; good for ``uses`` joins, until ``ttl_s`` seconds from now."""
    enrollment_id, token, expires = svc.add_enrollment(body.uses, body.ttl_s)
    return {"id": enrollment_id, "token": token, "uses": body.uses, "expires": expires}


@router.delete("/v1/enrollments/{enrollment_id}", response_model=S.Revoked, tags=["admin"],
               responses=documented(*AUTH, 404, 422, e404="no such enrollment"))
def revoke_enrollment(enrollment_id: str, clients: bool = Query(True, description="also revoke the clients that "
                                                                "joined with it and remove their DLEs"),
                      _: Principal = Depends(require_admin), svc: Service = Depends(service)) -> dict[str, Any]:
    """Revoke an enrollment token (admin): no further join spends it; by default the clients that joined with
    it are revoked too (their bearer tokens stop working) and their DLEs leave the global DLE."""
    ids = svc.revoke_enrollment(enrollment_id[:64])
    if ids is None:
        raise HTTPException(404, f"no enrollment {enrollment_id[:64]!r}")
    revoked, removed = svc.revoke_clients(ids if clients else [])
    return {"id": enrollment_id, "clients_revoked": revoked, "dles_removed": removed}


@router.delete("/v1/clients/{client_id}", response_model=S.Revoked, tags=["admin"],
               responses=documented(*AUTH, 404, 422, e404="no such client"))
def revoke_client(client_id: str, _: Principal = Depends(require_admin),
                  svc: Service = Depends(service)) -> dict[str, Any]:
    """Revoke a client (admin): its bearer token stops working and its uploaded DLE leaves the global DLE."""
    revoked, removed = svc.revoke_clients([client_id[:64]])
    if not revoked:
        raise HTTPException(404, f"no client {client_id[:64]!r}")
    return {"id": client_id, "clients_revoked": revoked, "dles_removed": removed}


@router.get("/v1/manifest", response_model=S.Manifest, tags=["devices"],
            responses={304: {"description": "If-None-Match matched (the newest bundle is the one the device has)"},
                       **documented(404, 422, 503, e404="no bundle and no job for this method")})
async def manifest(method: str | None = Query(None, max_length=S.MAX_METHOD_CHARS),
                   if_none_match: str | None = Header(None), svc: Service = Depends(service)) -> Response:
    """The newest bundle's manifest for ``method`` (default: the default bundle)."""
    bundle = _bundle_or_503(svc, method)
    headers = {"ETag": f'"{bundle["id"]}"', "Cache-Control": "no-cache"}
    if etag_matches(if_none_match, headers["ETag"]):
        return Response(status_code=304, headers=headers)
    return Response(svc.manifest_json(bundle), media_type="application/json", headers=headers)


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
    if etag_matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    data = svc.cached_artifact(sha256)
    if data is None:  # streamed from disk: hashed first (again only if the file changed since)
        path = await run_in_threadpool(svc.artifact_file, sha256)
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
             responses={**documented(*AUTH, *BODY, 404, 503, e404="no ODPFL-HN bundle with this bundle_id is served",
                                     e422="wrong embedding dimension, values outside [-1e6, 1e6] or not finite"),
                        200: {"description": "the weights: JSON (default) or, when the request's Accept names "
                                             f"{WEIGHTS_MEDIA_TYPE}, that binary format (safetensors layout: u64 "
                                             "LE header length, JSON header, raw little-endian float32; "
                                             "edge_sdk._tensors)",
                              "content": {WEIGHTS_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}})
async def generate(body: S.GenerateRequest, request: Request, _: Principal = Depends(require_client),
                   svc: Service = Depends(service)) -> Response:
    """ODPFL-HN: personalised weights w = f_theta(e) from the client's embedding e (nothing else is accepted).
    ``Accept: application/vnd.fl-edge.weights`` selects the binary reply (what edge_sdk asks for)."""
    bundle = svc.bundle_by_id(body.bundle_id)
    if bundle is None or "hn" not in bundle["server"]:
        raise HTTPException(404, f"no ODPFL-HN bundle {body.bundle_id} is served here")
    dim = svc.hypernets.embed_dim(bundle)
    if len(body.embedding) != dim:
        raise HTTPException(422, f"embedding must have {dim} values (the bundle's encoder output), "
                                 f"got {len(body.embedding)}")
    binary = WEIGHTS_MEDIA_TYPE in request.headers.get("accept", "")
    body_bytes = await svc.generator.generate(bundle, np.asarray(body.embedding, dtype=np.float32), binary)
    return Response(body_bytes, media_type=WEIGHTS_MEDIA_TYPE if binary else "application/json",
                    headers={"Vary": "Accept"})


def _dle_view(svc: Service, who: Principal) -> dict[str, Any]:
    """Global DLE = weighted average of the BTFL bundle's training-time DLE (when a BTFL bundle is served;
    it counts as its training clients) and every client's latest upload of that shape (one source weighs at
    most FL_SERVE_DLE_SOURCE_SHARE of the bundle: fl_server.service.dle); ``others_dle`` leaves the caller's
    own upload out."""
    assert who.client_id is not None
    seen = svc.global_dle(who.client_id, who.source)
    if seen is None:
        raise HTTPException(404, "no DLE yet: no BTFL bundle is served and no client has uploaded one")
    return view_json(*seen)


@router.post("/v1/btfl/dle", response_model=S.DLEResponse, tags=["methods"],
             responses=documented(*AUTH, *BODY, 409, 507, e422="not a [D, levels] frequency table, or its shape "
                                                          "differs from the other clients' DLEs",
                                  e409="the DLE names another BTFL bundle than the one served",
                                  e403="not a client token, or FL_SERVE_DLE_PER_SOURCE clients of this client's "
                                       "enrollment (or join address) have a DLE already"))
def upload_dle(body: S.DLEUpload, who: Principal = Depends(require_client),
               svc: Service = Depends(service)) -> dict[str, Any]:
    """BTFL: a participating client uploads its local DLE (replacing its previous one); the global DLE is
    re-aggregated as the weighted average of every client's latest DLE and, when a BTFL bundle is served, its
    training clients' DLE (BTFL Sec. 4.1; num_samples is no weight; one source, an enrollment or a join address,
    weighs at most FL_SERVE_DLE_SOURCE_SHARE of the bundle's training clients)."""
    assert who.client_id is not None
    if len({len(row) for row in body.freqs}) != 1:
        raise HTTPException(422, "invalid DLE: every row of freqs must have the same number of levels")
    try:
        freqs = average_dles([np.asarray(body.freqs, dtype=np.float64)])  # validates the rows
    except ValueError as exc:
        raise HTTPException(422, f"invalid DLE: {exc}") from None
    if freqs.shape[1] > S.MAX_DLE_LEVELS:
        raise HTTPException(422, f"a DLE has at most {S.MAX_DLE_LEVELS} levels, got {freqs.shape[1]}")
    base = svc.btfl_base()
    if base is not None and base[0] != body.bundle_id:  # fitted on another bundle's features: it would mix
        raise HTTPException(409, f"this coordinator serves BTFL bundle {base[0]}; a DLE fitted on bundle "
                                 f"{body.bundle_id}'s features would be averaged with its clients': download the "
                                 f"served bundle and personalise again")
    try:
        svc.upload_dle(who.client_id, body.freqs, body.num_samples, who.source)
    except ShapeMismatch as exc:
        raise HTTPException(422, str(exc)) from None
    except SourceFull as exc:
        raise HTTPException(403, str(exc)) from None
    return _dle_view(svc, who)


@router.get("/v1/btfl/dle", response_model=S.DLEResponse, tags=["methods"],
            responses=documented(*AUTH, 404, e404="no DLE has been uploaded yet"))
def global_dle(who: Principal = Depends(require_client), svc: Service = Depends(service)) -> dict[str, Any]:
    """The current global DLE."""
    return _dle_view(svc, who)


# -------------------------------------------------------------------- jobs
def _job_view(svc: Service, job: dict[str, Any], with_rounds: bool) -> dict[str, Any]:
    rounds = svc.job_rounds(job["id"])
    return {**job, "rounds_done": len(rounds), "rounds": rounds if with_rounds else None,
            **svc.job_outcome(job)}


@router.post("/v1/jobs", response_model=S.Job, status_code=201, tags=["jobs"],
             responses=documented(*AUTH, *BODY, 404, 503, 507, e404="no such recipe file in the recipe directory",
                                  e503="the job queue is full (FL_SERVE_MAX_QUEUED_JOBS)"))
def create_job(body: S.JobRequest, _: Principal = Depends(require_admin), svc: Service = Depends(service)) -> dict:
    """Start a training recipe on a data set and partition; it is exported and served when done."""
    spec = body.job_spec()  # a recipe job that names no method trains the recipe's own (the worker checks it)
    if "method" in spec and spec["method"] not in svc.cfg.methods:
        raise HTTPException(422, f"method {body.method!r} is not served here; this coordinator serves "
                                 f"{', '.join(svc.cfg.methods)} (FL_SERVE_METHODS)")
    if body.partition == "dirichlet" and body.alpha is None:
        raise HTTPException(422, "partition 'dirichlet' needs alpha")
    if body.alpha is not None and body.partition not in (None, "dirichlet"):
        raise HTTPException(422, f"alpha shapes the dirichlet partition only, not {body.partition!r}")
    if body.recipe is not None:
        try:
            resolve_in_dir(svc.cfg.recipes_dir, body.recipe)  # the file must exist now; the worker loads it
        except RecipeError as exc:
            raise HTTPException(404 if svc.cfg.recipes_dir else 422, str(exc)) from None
    try:
        job_id = svc.submit_job(spec)
    except QueueFull as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": str(svc.cfg.retry_after_s)}) from None
    job = svc.job(job_id)
    assert job is not None
    return _job_view(svc, job, True)


@router.get("/v1/jobs", response_model=list[S.Job], tags=["jobs"], responses=documented(*AUTH))
def list_jobs(_: Principal = Depends(require_admin), svc: Service = Depends(service)) -> list[dict]:
    return [_job_view(svc, j, False) for j in svc.jobs()]


@router.get("/v1/jobs/{job_id}", response_model=S.Job, tags=["jobs"],
            responses=documented(*AUTH, 404, 422, e404="no such job"))
def get_job(job_id: str, _: Principal = Depends(require_admin), svc: Service = Depends(service)) -> dict:
    """One job with its round curve (validation / new-client accuracy per round)."""
    job = svc.job(job_id[:64])
    if job is None:
        raise HTTPException(404, f"no job {job_id[:64]!r}")
    return _job_view(svc, job, True)


@router.delete("/v1/jobs/{job_id}", response_model=S.Job, tags=["jobs"],
               responses=documented(*AUTH, 404, 409, e404="no such job", e409="the job has finished already"))
def cancel_job(job_id: str, _: Principal = Depends(require_admin), svc: Service = Depends(service)) -> dict:
    """Cancel a queued or running job (a running job's training process is killed); it is never served."""
    job = svc.job(job_id[:64])
    if job is None:
        raise HTTPException(404, f"no job {job_id[:64]!r}")
    if not svc.cancel_job(job["id"]):
        raise HTTPException(409, f"job {job['id']} is {svc.job(job['id'])['status']}; only a queued or "
                                 "running job can be cancelled")
    return _job_view(svc, svc.job(job["id"]), True)


# ------------------------------------------------------------------ metrics
@router.get("/metrics", response_class=PlainTextResponse, tags=["ops"])
def metrics(svc: Service = Depends(service)) -> PlainTextResponse:
    """Prometheus text format: request counters and latencies, clients, jobs by status, bundles, DLEs, and the
    process (CPU, memory, open files, GC)."""
    totals = svc.totals()
    gauges = {
        "fl_clients": ("Joined clients.", {(): float(totals["clients"])}),
        "fl_bundles": ("Bundles served.", {(): float(totals["bundles"])}),
        "fl_btfl_dles": ("Clients with an uploaded DLE.", {(): float(totals["dles"])}),
        "fl_jobs": ("Training jobs by status.", {(("status", s),): float(n) for s, n in svc.job_counts().items()}),
    }
    return PlainTextResponse(svc.metrics.render(gauges), media_type=METRICS_CONTENT_TYPE)
