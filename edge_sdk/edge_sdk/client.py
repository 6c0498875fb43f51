"""``EdgeClient``: a device's connection to the coordinator (httpx only; no torch).

    client = EdgeClient("http://coordinator:8000", cache_dir="~/.cache/fl-edge")
    info = client.join("FedTTA++")             # client id, bearer token, methods, manifest
    bundle = client.download(info.manifest)    # resumable, sha256-verified, cached -> edge_sdk.bundle.Bundle

Every request has a timeout and is retried with exponential backoff on connection errors, timeouts, 5xx
and 429/503 (honouring Retry-After, capped). Downloads resume from a partial file with ``Range`` (``If-Range``
on the artifact's ETag) and every file is checked against its sha256 before it enters the cache; a cached
file that no longer matches is detected and fetched again. With the coordinator unreachable, ``manifest``
and ``download`` fall back to the last cached manifest and its verified files (offline mode).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np

from edge_sdk.bundle import MANIFEST, Bundle, load_bundle, sha256_file

_SHA = re.compile(r"^[0-9a-f]{64}$")
_SAFE = re.compile(r"^[A-Za-z0-9._+-]{1,64}$")


class EdgeClientError(RuntimeError):
    """The coordinator could not be reached, refused the request (``status``: its HTTP status), or sent
    something that fails verification."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class JoinInfo:
    client_id: str
    token: str
    methods: list[str]
    manifest: dict[str, Any]


class EdgeClient:
    def __init__(self, url: str, cache_dir: str | os.PathLike | None = None, timeout: float = 10.0,
                 retries: int = 4, backoff: float = 0.5, max_backoff: float = 10.0,
                 token: str | None = None, transport: httpx.BaseTransport | None = None,
                 event_hooks: dict[str, list[Callable]] | None = None) -> None:
        self.url = url.rstrip("/")
        self.cache = Path(cache_dir or Path.home() / ".cache" / "fl-edge").expanduser()
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.token = token
        self.client_id: str | None = None
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout), transport=transport,
                                 event_hooks=event_hooks or {}, headers={"User-Agent": "edge_sdk/0.1"})
        (self.cache / "objects").mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> EdgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # --------------------------------------------------------------- requests
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request with retries; returns the response of the last attempt or raises EdgeClientError."""
        last = ""
        for attempt in range(self.retries + 1):
            try:
                r = self.http.request(method, path, **kwargs)
            except httpx.TimeoutException as exc:
                last = f"timed out ({type(exc).__name__})"
            except httpx.TransportError as exc:
                last = f"unreachable ({type(exc).__name__}: {exc})"
            else:
                if r.status_code < 500 and r.status_code != 429:
                    return r
                last = f"HTTP {r.status_code}: {r.text[:300]}"
                if r.status_code in (429, 503) and attempt < self.retries:
                    time.sleep(min(self.max_backoff, _retry_after(r, self.backoff * 2 ** attempt)))
                    continue
            if attempt < self.retries:
                time.sleep(min(self.max_backoff, self.backoff * 2 ** attempt))
        raise EdgeClientError(f"{method} {self.url}{path}: {last} (after {self.retries + 1} attempts)")

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self._request(method, path, **kwargs)
        if r.status_code >= 400:
            raise EdgeClientError(f"{method} {path}: HTTP {r.status_code}: {_detail(r)}", r.status_code)
        return r.json()

    def _auth(self) -> dict[str, str]:
        if not self.token:
            raise EdgeClientError("not joined: call join() first (or pass token=)")
        return {"Authorization": f"Bearer {self.token}"}

    # ------------------------------------------------------------------- API
    def health(self) -> dict[str, Any]:
        return self._json("GET", "/healthz")

    def join(self, method: str | None = None) -> JoinInfo:
        """Join as a new client; the token is kept for later calls (and in the cache, mode 0600)."""
        body = self._json("POST", "/v1/clients", json={"method": method})
        info = JoinInfo(body["client_id"], body["token"], body["methods"], body["manifest"])
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
                return json.loads(cached.read_text())
            raise
        self._save_manifest(m, method)
        return m

    def download(self, manifest: dict[str, Any] | None = None, method: str | None = None) -> Bundle:
        """Fetch (or reuse from the cache) every artifact of ``manifest``, verify each sha256, and return the
        bundle as a verified :class:`edge_sdk.bundle.Bundle` directory in the cache."""
        m = manifest if manifest is not None else self.manifest(method)
        bundle_id = str(m.get("bundle_id", ""))
        if not _SHA.match(bundle_id):
            raise EdgeClientError(f"manifest has no valid bundle_id: {bundle_id[:80]!r}")
        root = self.cache / "bundles" / bundle_id
        root.mkdir(parents=True, exist_ok=True)
        manifest_file = self.fetch(bundle_id)  # the manifest.json bytes; their sha256 is the bundle id
        raw = json.loads(manifest_file.read_text())
        if [a["sha256"] for a in raw["artifacts"]] != [a["sha256"] for a in m["artifacts"]]:
            raise EdgeClientError(f"bundle {bundle_id}: the served manifest does not match its signed bytes")
        for a in raw["artifacts"]:
            if not _SAFE.match(str(a.get("file", ""))):
                raise EdgeClientError(f"bundle {bundle_id}: invalid artifact file name {a.get('file')!r}")
            _link(self.fetch(a["sha256"], a.get("size")), root / a["file"])
        _link(manifest_file, root / MANIFEST)
        return load_bundle(root)

    def fetch(self, sha256: str, size: int | None = None) -> Path:
        """One artifact by content address into ``cache/objects`` (resuming a partial download), verified."""
        if not _SHA.match(sha256):
            raise EdgeClientError(f"not a sha256: {sha256[:80]!r}")
        path = self.cache / "objects" / sha256
        if path.is_file():
            if sha256_file(path) == sha256:
                return path
            path.unlink()  # corrupted cache entry: fetch again
        part = path.with_suffix(".part")
        for _ in range(2):  # a second, clean attempt if a resumed file fails its hash
            self._download_to(sha256, part)
            if sha256_file(part) == sha256:
                os.replace(part, path)
                return path
            part.unlink()
        raise EdgeClientError(f"artifact {sha256}: downloaded bytes do not match their sha256; refusing them")

    def _download_to(self, sha256: str, part: Path) -> None:
        url = f"/v1/artifacts/{sha256}"
        last = ""
        for attempt in range(self.retries + 1):
            have = part.stat().st_size if part.exists() else 0
            headers = {"Range": f"bytes={have}-", "If-Range": f'"{sha256}"'} if have else {}
            try:
                with self.http.stream("GET", url, headers=headers) as r:
                    if r.status_code == 416:  # the partial file is already complete (or bogus)
                        return
                    if r.status_code not in (200, 206):
                        r.read()
                        if r.status_code < 500:
                            raise EdgeClientError(f"GET {url}: HTTP {r.status_code}: {_detail(r)}", r.status_code)
                        raise httpx.TransportError(f"HTTP {r.status_code}")
                    with open(part, "ab" if r.status_code == 206 else "wb") as fh:
                        for chunk in r.iter_bytes(1 << 16):
                            fh.write(chunk)
                return
            except httpx.TimeoutException as exc:
                last = f"timed out ({type(exc).__name__})"
            except httpx.TransportError as exc:
                last = f"interrupted ({exc})"
            if attempt < self.retries:
                time.sleep(min(self.max_backoff, self.backoff * 2 ** attempt))
        raise EdgeClientError(f"GET {self.url}{url}: {last} (after {self.retries + 1} attempts; "
                              f"{part.stat().st_size if part.exists() else 0} bytes kept for resuming)")

    def generate(self, embedding: np.ndarray, bundle_id: str | None = None) -> dict[str, np.ndarray]:
        """ODPFL-HN: send only the embedding e, receive the personalised weights {psi.<name>: array}."""
        e = np.asarray(embedding, dtype=np.float64).reshape(-1)
        if not np.isfinite(e).all():
            raise ValueError("embedding contains NaN or inf")
        body = self._json("POST", "/v1/hypernetwork/generate", headers=self._auth(),
                          json={"embedding": e.tolist(), "bundle_id": bundle_id})
        return {k: np.frombuffer(base64.b64decode(t["data"]), dtype="<f4").reshape(t["shape"]).astype(np.float32)
                for k, t in body["params"].items()}

    def upload_dle(self, freqs: np.ndarray, num_samples: int) -> dict[str, Any]:
        """BTFL: upload this client's local DLE [D, levels]; returns the re-aggregated global DLE."""
        body = self._json("POST", "/v1/btfl/dle", headers=self._auth(),
                          json={"freqs": np.asarray(freqs, dtype=np.float64).tolist(), "num_samples": int(num_samples)})
        body["global_dle"] = np.asarray(body["global_dle"])
        return body

    def wait_ready(self, method: str | None = None, timeout: float = 600.0, poll: float = 2.0) -> dict[str, Any]:
        """Block until the coordinator serves a bundle for ``method``; returns its manifest."""
        deadline = time.monotonic() + timeout
        params = {"method": method} if method else None
        while True:
            try:
                r = self.http.get("/v1/manifest", params=params)
            except httpx.TransportError as exc:  # not up yet
                if time.monotonic() > deadline:
                    raise EdgeClientError(f"{self.url} unreachable after {timeout:.0f}s ({exc})") from None
                time.sleep(poll)
                continue
            if r.status_code == 200:
                return r.json()
            if r.status_code != 503 or time.monotonic() > deadline:
                raise EdgeClientError(f"no bundle for {method or 'the default method'}: HTTP {r.status_code} "
                                      f"{_detail(r)}", r.status_code)
            time.sleep(min(poll, _retry_after(r, poll)))

    # ----------------------------------------------------------------- cache
    def _manifest_path(self, method: str | None) -> Path:
        return self.cache / "manifests" / f"{_safe_key(method or 'default')}.json"

    def _save_manifest(self, m: dict[str, Any], method: str | None) -> None:
        path = self._manifest_path(method)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(m))
        os.replace(tmp, path)


def _retry_after(r: httpx.Response, default: float) -> float:
    try:
        return max(0.0, float(r.headers.get("Retry-After", default)))
    except ValueError:
        return default


def _detail(r: httpx.Response) -> str:
    try:
        return json.dumps(r.json().get("detail"))[:500]
    except (ValueError, AttributeError):
        return r.text[:500]


def _safe_key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16] + "-" + re.sub(r"[^A-Za-z0-9]+", "_", name)[:32]


def _link(src: Path, dst: Path) -> None:
    """``dst`` becomes the verified cache object ``src`` (hard link, else copy), replacing what was there."""
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        tmp.write_bytes(src.read_bytes())
    os.replace(tmp, dst)
