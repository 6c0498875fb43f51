"""``EdgeClient``: a device's connection to the coordinator (httpx only; no torch).

    client = EdgeClient("http://coordinator:8000", cache_dir="~/.cache/fl-edge")
    info = client.join("FedTTA++")             # client id, bearer token, methods, manifest
    bundle = client.download(info.manifest)    # resumable, sha256-verified, cached -> edge_sdk._bundle.Bundle

Every request has a timeout and is retried with exponential backoff on connection errors, timeouts, 5xx
(but 507, the coordinator's full disk, which is reported at once) and 429/503 (honouring Retry-After, capped). Downloads resume from a partial file with ``Range`` (``If-Range``
on the artifact's ETag) and every file is checked against its sha256 before it enters the cache; a cached
file that no longer matches is detected and fetched again. With the coordinator unreachable, ``manifest``
and ``download`` fall back to the last cached manifest and its verified files (offline mode).

Authenticity: every manifest is signed by the coordinator's Ed25519 key and ``download`` checks the signature
(:mod:`edge_sdk.signing`) before it fetches any artifact, and again (with every sha256) when it loads the
bundle, so nothing unsigned reaches onnxruntime.
* ``EdgeClient(url, public_key="<hex>")``: the key is pinned (get it from the operator, ``fl-server serve``'s
  startup line or ``GET /v1/signing-key`` over a channel you trust); a bundle signed by any other key, or
  not signed, is refused.
* no ``public_key``: trust on first use. The first contact with ``url`` fetches ``/v1/signing-key``, stores it
  in ``<cache>/trusted_keys.json`` (mode 0600) and warns (:class:`TrustOnFirstUseWarning`); from then on that
  key is required, and a coordinator that presents another key is refused until the entry is deleted or a
  key is pinned. This protects against later tampering, not against an attacker present at first contact.

Freshness: each signature is a signed *release* (:mod:`edge_sdk.signing`) with a version that the coordinator
assigns, rising with every bundle it publishes for a method, and an expiry. ``download`` refuses an offline
export's candidate (no version: only the coordinator numbers releases), an expired release
(:class:`~edge_sdk._errors.BundleExpiredError`: a stale or replayed manifest) and one older than the newest it
accepted for that method from this ``url`` under any key it still pins (one ratchet across key rotations;
:class:`~edge_sdk._errors.BundleRollbackError`), which it keeps in ``<cache>/accepted_versions.json``
(:mod:`edge_sdk._versions`). Offline (``manifest`` fell back to the cache), ``download`` keeps using the cached
bundle after its release expired, with a :class:`StaleReleaseWarning` that states the expiry; the same expired
release from the network is refused.

Transport: use ``https://`` so that tokens and manifests do not travel in clear. The coordinator's certificate
is verified against the CA bundle httpx ships (certifi) or, for a self-signed deployment, only against the CA
in ``ca_file`` (pinned): ``EdgeClient("https://coordinator:8443", ca_file="ca.pem", public_key=KEY)``.

Replies are bounded: a JSON reply larger than ``max_response_bytes``, an artifact larger than its manifest
size, a reply that is not HTTP or not JSON each give a clear :class:`EdgeClientError`; every read has the
``timeout`` and every attempt a total ``deadline`` that covers connecting, the TLS handshake, sending, the reply's
headers and its body (:mod:`edge_sdk._deadline`: a server that trickles bytes, headers included, cannot hold the
device past it).
"""
from __future__ import annotations

import base64
import hashlib
import math
import json
import os
import re
import ssl
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np

from edge_sdk import _deadline, _strictjson as strictjson, _tensors as tensors
from edge_sdk._atomic import atomic_link, atomic_write_text, move
from edge_sdk._bundle import MANIFEST, Bundle, load_bundle, sha256_file
from edge_sdk._errors import BundleSignatureError
from edge_sdk.signing import PublicKey, key_id, parse_public_key, verify_manifest, write_signature
from edge_sdk._versions import VersionLedger

_SHA = re.compile(r"[0-9a-f]{64}")  # used with fullmatch: "$" would also accept a trailing newline
_SAFE = re.compile(r"[A-Za-z0-9._+-]{1,64}")
_RESERVED = {".", "..", MANIFEST, "manifest.sig"}  # an artifact must not land on these in the bundle folder
ANY_METHOD = "none"  # the coordinator's plain-inference method: any bundle serves it


class EdgeClientError(RuntimeError):
    """The coordinator could not be reached, refused the request (``status``: its HTTP status), or sent
    something that fails verification."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TrustOnFirstUseWarning(UserWarning):
    """No public key was pinned: the coordinator's key was trusted on first use and stored in the cache."""


class StaleReleaseWarning(UserWarning):
    """The coordinator is unreachable and the cached bundle in use has an expired signed release."""


class _Deadline(Exception):
    pass


@dataclass
class JoinInfo:
    client_id: str
    token: str
    methods: list[str]
    manifest: dict[str, Any]


class EdgeClient:
    def __init__(self, url: str, *, cache_dir: str | os.PathLike | None = None, timeout: float = 10.0,
                 retries: int = 4, backoff: float = 0.5, max_backoff: float = 10.0,
                 token: str | None = None, transport: httpx.BaseTransport | None = None,
                 event_hooks: dict[str, list[Callable]] | None = None,
                 public_key: PublicKey | list[PublicKey] | tuple[PublicKey, ...] | None = None,
                 deadline: float = 300.0, max_response_bytes: int = 64 << 20,
                 ca_file: str | os.PathLike | None = None) -> None:
        """``public_key``: the coordinator's Ed25519 key (hex or 32 bytes) to pin, or several during a key
        rotation (a manifest signed by any of them is accepted); None = trust on first use.
        ``timeout``: per read/connect; ``deadline``: per attempt, in all (connect, headers and body; a custom
        ``transport`` other than ``httpx.HTTPTransport`` gets it between body chunks only); ``max_response_bytes``:
        JSON replies.
        ``ca_file``: PEM of the only CA(s) an ``https://`` coordinator's certificate may chain to (a
        self-signed deployment); None: httpx's default CA bundle."""
        self.url = url.rstrip("/")
        self.cache = Path(cache_dir or Path.home() / ".cache" / "fl-edge").expanduser()
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        keys = public_key if isinstance(public_key, (list, tuple)) else [] if public_key is None else [public_key]
        if public_key is not None and not keys:
            raise BundleSignatureError("public_key: an empty list pins no key (None trusts on first use)")
        self.pinned_keys = [parse_public_key(k) for k in keys]
        self.pinned = self.pinned_keys[0] if self.pinned_keys else None
        self.deadline, self.max_response_bytes = deadline, max_response_bytes
        self.token = token
        self.client_id: str | None = None
        verify: ssl.SSLContext | bool = True
        if ca_file is not None:
            try:
                verify = ssl.create_default_context(cafile=os.fspath(ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise EdgeClientError(f"ca_file {os.fspath(ca_file)!r}: not a readable PEM CA certificate "
                                      f"({exc})") from None
        self.versions = VersionLedger(self.cache / "accepted_versions.json")
        self._offline: set[str] = set()  # bundle ids of cached manifests manifest() fell back to (unreachable)
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout), transport=transport,
                                 verify=verify, event_hooks=event_hooks or {}, headers={"User-Agent": "edge_sdk/0.1"})
        _deadline.guard(self.http)  # each attempt's deadline bounds connect, headers and body, not only each read
        (self.cache / "objects").mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> EdgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # --------------------------------------------------------------- requests
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request with retries; returns the response of the last attempt (body read, at most
        ``max_response_bytes``) or raises EdgeClientError."""
        last = ""
        for attempt in range(self.retries + 1):
            try:
                r = self._read(method, path, self.max_response_bytes, **kwargs)
            except (httpx.TransportError, httpx.DecodingError, _Deadline) as exc:
                last = _transport_problem(exc)
            else:
                if r.status_code < 500 and r.status_code != 429 or r.status_code == 507:
                    return r  # 507: the coordinator's disk is full; retrying at once only adds load
                last = f"HTTP {r.status_code}: {r.text[:300]}"
                if r.status_code in (429, 503) and attempt < self.retries:
                    time.sleep(min(self.max_backoff, _retry_after(r, self.backoff * 2 ** attempt)))
                    continue
            if attempt < self.retries:
                time.sleep(min(self.max_backoff, self.backoff * 2 ** attempt))
        raise EdgeClientError(f"{method} {self.url}{path}: {last} (after {self.retries + 1} attempts)")

    def _read(self, method: str, path: str, limit: int, end: float | None = None, **kwargs: Any) -> httpx.Response:
        """A response with its body read under ``limit`` bytes and the per-attempt ``deadline`` (or ``end``, a
        ``time.monotonic()`` when sooner); nothing (connect, headers, body) waits past it."""
        now = time.monotonic()
        end = min(now + self.deadline, end if end is not None else math.inf)
        left = max(0.01, end - now)  # the pool wait too (not a network operation: the guard does not see it)
        default = self.http.timeout
        kwargs.setdefault("timeout", httpx.Timeout(**{k: min(left, t if t is not None else math.inf) for k, t in (
            ("connect", default.connect), ("read", default.read), ("write", default.write), ("pool", default.pool))}))
        with _deadline.attempt(self.deadline, end), self.http.stream(method, path, **kwargs) as r:
            body = bytearray()
            for chunk in r.iter_bytes():  # as received (decoded): the limit bounds what lands in memory
                body += chunk
                if len(body) > limit:
                    raise EdgeClientError(f"{method} {self.url}{path}: reply larger than {limit} bytes; refusing it")
                if time.monotonic() > end:
                    raise _Deadline(f"reply not complete after {end - now:g}s")
        return httpx.Response(r.status_code, headers=_plain(r.headers), content=bytes(body), request=r.request)

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self._request(method, path, **kwargs)
        if r.status_code >= 400:
            raise EdgeClientError(f"{method} {path}: HTTP {r.status_code}: {_detail(r)}", r.status_code)
        try:
            return strictjson.loads(r.content)
        except (ValueError, RecursionError):
            raise EdgeClientError(f"{method} {self.url}{path}: the reply is not JSON (HTTP {r.status_code}, "
                                  f"{r.headers.get('content-type', 'no content type')}, starts {r.content[:40]!r})",
                                  r.status_code) from None

    def _auth(self) -> dict[str, str]:
        if not self.token:
            raise EdgeClientError("not joined: call join() first (or pass token=)")
        return {"Authorization": f"Bearer {self.token}"}

    # ------------------------------------------------------------------- API
    def health(self) -> dict[str, Any]:
        return self._json("GET", "/healthz")

    def join(self, method: str | None = None, enrollment_token: str | None = None) -> JoinInfo:
        """Join as a new client; the token is kept for later calls (and in the cache, mode 0600).
        ``enrollment_token``: the operator's, where the coordinator requires one (FL_SERVE_ENROLLMENT=token)."""
        request = {"method": method, **({"enrollment_token": enrollment_token} if enrollment_token else {})}
        body = self._json("POST", "/v1/clients", json=request)
        try:
            info = JoinInfo(str(body["client_id"]), str(body["token"]), list(body["methods"]), dict(body["manifest"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise EdgeClientError(f"POST {self.url}/v1/clients: unexpected reply (no {exc}); is {self.url} "
                                  "an fl-edge coordinator?") from None
        self.token, self.client_id = info.token, info.client_id
        self._save_manifest(info.manifest, method)
        fd = os.open(self.cache / "identity.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"url": self.url, "client_id": info.client_id, "token": info.token}, fh)
        return info

    def manifest(self, method: str | None = None) -> dict[str, Any]:
        """The coordinator's current manifest for ``method``; the cached one when the coordinator is unreachable."""
        try:
            m = self._json("GET", "/v1/manifest", params={"method": method} if method else None)
        except EdgeClientError as exc:
            cached = self._manifest_path(method)
            if cached.is_file() and exc.status is None:  # offline, not refused
                try:
                    m = strictjson.loads(cached.read_bytes())
                except (ValueError, RecursionError):
                    raise exc from None  # the cached copy is damaged too: report the network error
                if isinstance(m, dict):
                    self._offline.add(str(m.get("bundle_id")))  # download may use it after its release expired
                return m
            raise
        if not isinstance(m, dict):
            raise EdgeClientError(f"GET {self.url}/v1/manifest: unexpected reply (a JSON {type(m).__name__})")
        self._offline.clear()  # reachable again: every release must be fresh
        self._save_manifest(m, method)
        return m

    # ------------------------------------------------------------ trust
    def trusted_key(self) -> bytes:
        """The key manifests must be signed with: the pinned one, else the one trusted on first use."""
        if self.pinned is not None:
            return self.pinned
        store = self._trust_path()
        try:
            known = json.loads(store.read_text()) if store.is_file() else {}
            if self.url in known:
                return parse_public_key(known[self.url])
        except (ValueError, TypeError, AttributeError) as exc:
            raise EdgeClientError(f"{store} is corrupt ({exc}); delete it to trust the coordinator's key again, "
                                  "or pass public_key=") from None
        try:
            body = self._json("GET", "/v1/signing-key")
        except EdgeClientError as exc:
            raise EdgeClientError(f"no public key pinned and none trusted yet for {self.url}, and its signing key "
                                  f"cannot be fetched: {exc}; pass public_key= to verify bundles offline",
                                  exc.status) from None
        try:
            key = parse_public_key(body["public_key"])
        except (KeyError, TypeError, BundleSignatureError) as exc:
            raise EdgeClientError(f"GET {self.url}/v1/signing-key: no usable public key ({exc})") from None
        known[self.url] = key.hex()
        atomic_write_text(store, json.dumps(known, indent=1), mode=0o600)  # only this user may read it
        warnings.warn(TrustOnFirstUseWarning(
            f"no public key pinned: trusting {self.url}'s signing key {key.hex()} on first use (stored in {store}); "
            f"pin it with EdgeClient(url, public_key='{key.hex()}')"), stacklevel=3)
        return key

    def _trust_path(self) -> Path:
        return self.cache / "trusted_keys.json"

    # ------------------------------------------------------------ bundles
    def download(self, manifest: dict[str, Any] | None = None, method: str | None = None) -> Bundle:
        """Fetch (or reuse from the cache) every artifact of ``manifest``, verify the manifest's signature
        and each sha256, and return the bundle as a verified :class:`edge_sdk._bundle.Bundle` in the cache.
        With ``method``, the signed manifest must be that method's (``"none"``: any bundle)."""
        m = manifest if manifest is not None else self.manifest(method)
        bundle_id = str(m.get("bundle_id", ""))
        if not _SHA.fullmatch(bundle_id):
            raise EdgeClientError(f"manifest has no valid bundle_id: {bundle_id[:80]!r}")
        key = self.trusted_key()
        record = m.get("signature")
        signer = record.get("public_key") if isinstance(record, dict) else None
        key = next((k for k in self.pinned_keys if k.hex() == signer), key)  # rotation: the pinned key that signed
        root = self.cache / "bundles" / bundle_id
        root.mkdir(parents=True, exist_ok=True)
        manifest_file = self.fetch(bundle_id)  # the manifest.json bytes; their sha256 is the bundle id
        raw = manifest_file.read_bytes()
        try:  # authenticity first: nothing else is fetched for a manifest that is not signed by the key
            release = verify_manifest(raw, m.get("signature"), key, f"bundle {bundle_id}")
        except BundleSignatureError as exc:
            hint = "" if self.pinned is not None else (f" (key trusted on first use, from {self._trust_path()}: "
                                                       "delete the entry there if the key was rotated on purpose)")
            raise BundleSignatureError(f"{exc}{hint}") from None
        # freshness next: an expired release, or one older than this device accepted, is a replay. One ratchet
        # per coordinator and method across key rotations (the coordinator numbers releases whatever key signs);
        # only keys still pinned hold it up, so dropping a compromised key that signed a huge version unlocks it
        stale = release.expired() and bundle_id in self._offline  # our own cache, the coordinator unreachable
        keys = [key_id(k) for k in self.pinned_keys] or [key_id(key)]
        self.versions.check(self.url, release, f"bundle {bundle_id}", keys=keys, expired_ok=stale)
        try:
            listed = strictjson.loads(raw)
            same = [a["sha256"] for a in listed["artifacts"]] == [a["sha256"] for a in m["artifacts"]]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise EdgeClientError(f"bundle {bundle_id}: malformed manifest ({exc})") from None
        if not same:
            raise EdgeClientError(f"bundle {bundle_id}: the served manifest does not match its signed bytes")
        if method not in (None, ANY_METHOD) and listed.get("method") != method:  # e.g. a replayed signed bundle
            raise EdgeClientError(f"bundle {bundle_id}: a {str(listed.get('method'))[:64]!r} bundle, not the "
                                  f"{method!r} bundle that was asked for")
        for a in listed["artifacts"]:
            if not _SAFE.fullmatch(str(a.get("file", ""))) or a.get("file") in _RESERVED:
                raise EdgeClientError(f"bundle {bundle_id}: invalid artifact file name {a.get('file')!r}")
            atomic_link(self.fetch(a["sha256"], a.get("size")), root / a["file"])
        write_signature(root, m["signature"])
        atomic_link(manifest_file, root / MANIFEST)
        bundle = load_bundle(root, public_key=key)
        if stale:
            warnings.warn(StaleReleaseWarning(
                f"{self.url} is unreachable: using the cached bundle {bundle_id} ({release.method}, release "
                f"{release.version}), whose signed release expired at {release.expires}; it is refused from the "
                "network until the coordinator signs it again"), stacklevel=2)
        else:
            self.versions.accept(self.url, release)
        return bundle

    def fetch(self, sha256: str, size: int | None = None) -> Path:
        """One artifact by content address into ``cache/objects`` (resuming a partial download), verified."""
        if not _SHA.fullmatch(sha256):
            raise EdgeClientError(f"not a sha256: {sha256[:80]!r}")
        path = self.cache / "objects" / sha256
        if path.is_file():
            if sha256_file(path) == sha256:
                return path
            path.unlink()  # corrupted cache entry: fetch again
        part = path.with_suffix(".part")
        limit = int(size) if isinstance(size, int) and size >= 0 else self.max_response_bytes
        for _ in range(2):  # a second, clean attempt if a resumed file fails its hash
            self._download_to(sha256, part, limit)
            if sha256_file(part) == sha256:
                move(part, path)
                return path
            part.unlink()
        raise EdgeClientError(f"artifact {sha256}: downloaded bytes do not match their sha256; refusing them")

    def _download_to(self, sha256: str, part: Path, limit: int) -> None:
        """Download into ``part``, resuming with Range; at most ``limit`` bytes in all. An attempt that adds
        bytes does not use up a retry (the file is finite), so a flaky link still completes."""
        url = f"/v1/artifacts/{sha256}"
        last, failures = "", 0
        while True:
            have = part.stat().st_size if part.exists() else 0
            if have > limit:
                part.unlink()
                have = 0
            headers = {"Range": f"bytes={have}-", "If-Range": f'"{sha256}"'} if have else {}
            try:
                with _deadline.attempt(self.deadline) as end, self.http.stream("GET", url, headers=headers) as r:
                    if r.status_code == 416:  # the partial file is already complete (or bogus)
                        return
                    if r.status_code not in (200, 206):
                        error = b""
                        for chunk in r.iter_bytes():  # an error reply: 64 KiB of it at most, within the deadline
                            error += chunk
                            if len(error) > 64 << 10 or time.monotonic() > end:
                                raise EdgeClientError(f"GET {url}: HTTP {r.status_code} with an endless reply",
                                                      r.status_code)
                        r = httpx.Response(r.status_code, headers=_plain(r.headers), content=error, request=r.request)
                        if r.status_code < 500:
                            raise EdgeClientError(f"GET {url}: HTTP {r.status_code}: {_detail(r)}", r.status_code)
                        raise httpx.TransportError(f"HTTP {r.status_code}")
                    written = have if r.status_code == 206 else 0
                    with open(part, "ab" if r.status_code == 206 else "wb") as fh:
                        for chunk in r.iter_bytes():  # as received: a cut keeps every byte that arrived
                            written += len(chunk)
                            if written > limit:
                                raise EdgeClientError(f"GET {self.url}{url}: the server sent more than the "
                                                      f"{limit} bytes the manifest lists; refusing it")
                            fh.write(chunk)
                            if time.monotonic() > end:
                                raise _Deadline(f"download not complete after {self.deadline:g}s")
                return
            except (httpx.TransportError, httpx.DecodingError, _Deadline) as exc:
                last = _transport_problem(exc)
            if (part.stat().st_size if part.exists() else 0) <= have:  # no progress: that costs a retry
                failures += 1
                if failures > self.retries:
                    break
                time.sleep(min(self.max_backoff, self.backoff * 2 ** (failures - 1)))
        raise EdgeClientError(f"GET {self.url}{url}: {last} (after {self.retries + 1} attempts without progress; "
                              f"{part.stat().st_size if part.exists() else 0} bytes kept for resuming)")

    def generate(self, embedding: np.ndarray, bundle_id: str) -> dict[str, np.ndarray]:
        """ODPFL-HN: send only the embedding e, receive the personalised weights {psi.<name>: array}.
        ``bundle_id``: the bundle whose encoder computed e and whose hypernetwork must answer (``Bundle.id``; a
        device's runner names its own), refused with 404 when the coordinator no longer serves it, and the reply
        must name it. Asks for the binary reply (:mod:`edge_sdk._tensors`) and still reads the JSON one of an older
        coordinator."""
        e = np.asarray(embedding, dtype=np.float64).reshape(-1)
        if not np.isfinite(e).all():
            raise ValueError("embedding contains NaN or inf")
        r = self._request("POST", "/v1/hypernetwork/generate",
                          headers={**self._auth(), "Accept": f"{tensors.MEDIA_TYPE}, application/json;q=0.5"},
                          json={"embedding": e.tolist(), "bundle_id": bundle_id})
        if r.status_code >= 400:
            raise EdgeClientError(f"POST /v1/hypernetwork/generate: HTTP {r.status_code}: {_detail(r)}",
                                  r.status_code)
        if r.headers.get("content-type", "").split(";")[0].strip() == tensors.MEDIA_TYPE:
            try:
                weights, meta = tensors.decode(r.content)
            except ValueError as exc:
                raise EdgeClientError(f"generate: malformed weights reply ({exc})") from None
            replied = meta.get("bundle_id")
        else:
            try:  # the JSON reply of an older coordinator
                body = r.json()
                weights = {k: np.frombuffer(base64.b64decode(t["data"]), dtype="<f4").reshape(t["shape"])
                           .astype(np.float32) for k, t in body["params"].items()}
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:  # base64: ValueError
                raise EdgeClientError(f"generate: malformed weights reply ({type(exc).__name__}: {exc})") from None
            replied = body.get("bundle_id")
        if replied != bundle_id:  # weights of another bundle's hypernetwork
            raise EdgeClientError(f"generate: the coordinator answered for bundle {str(replied)[:80]!r}, not "
                                  f"{bundle_id}")
        return weights

    def upload_dle(self, freqs: np.ndarray, num_samples: int, bundle_id: str) -> dict[str, Any]:
        """BTFL: upload this client's local DLE [D, levels]; returns the re-aggregated global DLE. ``bundle_id``:
        the bundle whose features the DLE was fitted on (``Bundle.id``; a device's runner names its own): the
        coordinator refuses it (409) while it serves another BTFL bundle, and a reply averaged with another
        bundle's clients is refused here."""
        request = {"freqs": np.asarray(freqs, dtype=np.float64).tolist(), "num_samples": int(num_samples),
                   "bundle_id": bundle_id}
        body = self._json("POST", "/v1/btfl/dle", headers=self._auth(), json=request)
        base = body.get("base")
        if isinstance(base, dict) and base.get("bundle_id") != bundle_id:
            raise EdgeClientError(f"upload_dle: the global DLE was averaged with bundle "
                                  f"{str(base.get('bundle_id'))[:80]!r}'s clients, not {bundle_id}'s")
        body["global_dle"] = np.asarray(body["global_dle"])
        return body

    def wait_ready(self, method: str | None = None, timeout: float = 600.0, poll: float = 2.0,
                   on_wait: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Block until the coordinator serves a bundle for ``method``; returns its manifest. ``on_wait`` gets
        each 503 reply's ``detail`` (the training jobs' progress: method, rounds_done, rounds)."""
        deadline = time.monotonic() + timeout
        params = {"method": method} if method else None
        while True:
            try:  # every reply under max_response_bytes, and nothing waits past the deadline
                r = self._read("GET", "/v1/manifest", self.max_response_bytes, end=deadline, params=params)
            except (httpx.TransportError, httpx.DecodingError, _Deadline) as exc:  # not up yet, or too slow
                if time.monotonic() > deadline:
                    raise EdgeClientError(f"{self.url}: no manifest within {timeout:g}s "
                                          f"({_transport_problem(exc)})") from None
                time.sleep(max(0.0, min(poll, deadline - time.monotonic())))
                continue
            if r.status_code == 200:
                try:
                    return strictjson.loads(r.content)
                except ValueError:
                    raise EdgeClientError(f"GET {self.url}/v1/manifest: the reply is not JSON (starts "
                                          f"{r.content[:40]!r})", r.status_code) from None
            if r.status_code != 503 or time.monotonic() > deadline:
                raise EdgeClientError(f"no bundle for {method or 'the default method'}: HTTP {r.status_code} "
                                      f"{_detail(r)}", r.status_code)
            if on_wait is not None:
                try:
                    detail = strictjson.loads(r.content).get("detail")
                except (ValueError, AttributeError):
                    detail = None
                if isinstance(detail, dict):
                    on_wait(detail)
            time.sleep(max(0.0, min(poll, _retry_after(r, poll), deadline - time.monotonic())))

    # ----------------------------------------------------------------- cache
    def _manifest_path(self, method: str | None) -> Path:
        return self.cache / "manifests" / f"{_safe_key(method or 'default')}.json"

    def _save_manifest(self, m: dict[str, Any], method: str | None) -> None:
        path = self._manifest_path(method)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, strictjson.dumps(m))


def _transport_problem(exc: Exception) -> str:
    """One line for a failed attempt: timed out, not HTTP, or unreachable."""
    if isinstance(exc, _Deadline):
        return f"timed out ({exc})"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({exc})" if _deadline.caused(exc) else f"timed out ({type(exc).__name__})"
    if isinstance(exc, (httpx.ProtocolError, httpx.DecodingError)):
        return f"sent an invalid HTTP response ({type(exc).__name__}: {exc})"
    return f"unreachable ({type(exc).__name__}: {exc})"


def _retry_after(r: httpx.Response, default: float) -> float:
    try:
        return max(0.0, float(r.headers.get("Retry-After", default)))
    except ValueError:
        return default


def _plain(headers: httpx.Headers) -> list[tuple[str, str]]:
    """A read reply's headers for a response rebuilt from its decoded body."""
    return [(k, v) for k, v in headers.items() if k.lower() not in ("content-encoding", "content-length")]


def _detail(r: httpx.Response) -> str:
    try:
        return json.dumps(strictjson.loads(r.content).get("detail"))[:500]
    except (ValueError, AttributeError):
        return r.text[:500]


def _safe_key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16] + "-" + re.sub(r"[^A-Za-z0-9]+", "_", name)[:32]
