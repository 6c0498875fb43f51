"""Publish a bundle exported elsewhere (``fl-server export``, a recipe's export): verify it, copy it into the
coordinator's content-addressed store and record it, after which it is served (and its manifest signed with
the coordinator's key, :meth:`fl_server.service.state.Service.signature`) exactly like a bundle the
coordinator trained; the newest bundle of a method is the one served.

Two doors, one check (:func:`verify_bundle_dir`):
* ``fl-server publish BUNDLE --store DIR`` (:func:`publish_dir`) on the coordinator's store, or
  ``fl-server publish BUNDLE --server URL`` (the endpoint below, with the admin token);
* ``POST /v1/bundles`` (admin token): the bundle directory as a tar archive (plain or gzip), e.g.
  ``tar -C runs/bundle -cf - . | curl -H "Authorization: Bearer $T" --data-binary @- URL/v1/bundles``.

What is refused, each with one line saying why: an archive that is not tar, members that are not regular
files (links, devices), paths with directories or ``..``, more than ``MAX_FILES`` files or ``max_bytes`` in
all, a file the manifest does not list, a malformed manifest, a file whose size or sha256 differs from the
manifest, an ONNX graph that onnxruntime cannot load or whose inputs differ from the manifest, weights that
are not plain finite float arrays (read without pickle), a method this coordinator does not know, a
bundle that lacks what its method's device contract declares (``Algorithm.bundle_artifacts``, the manifest's
``device_step``), and bundles of a method that cannot be published (ODPFL-HN: its hypernetwork never leaves the
coordinator that trained it).
"""
from __future__ import annotations

import io
import re
import shutil
import tarfile
import tempfile
import warnings
from pathlib import Path
from typing import IO, Any

import numpy as np

from edge_sdk._bundle import MANIFEST, Bundle, BundleError, UnverifiedSignatureWarning, load_bundle
from fl_server.algorithms import ALGORITHMS
from fl_server.service.artifacts import ArtifactStore
from fl_server.service.store import Store

PUBLISHED_JOB = "published"  # the job id recorded for a published bundle
MAX_FILES = 64
SIGNATURE = "manifest.sig"  # a publisher's own signature is not needed: the coordinator signs what it serves
_NAME = re.compile(r"[A-Za-z0-9._+-]{1,64}")
_METHOD = re.compile(r"[A-Za-z0-9 ._+()-]{1,64}")


def check_contract(method: str, manifest: dict[str, Any], names: list[str]) -> None:
    """The bundle holds what its method's device contract declares (:meth:`Algorithm.bundle_artifacts`, the
    manifest's ``device_step``): a registered method, publishable, every artifact a device needs."""
    cls = ALGORITHMS.get(method)
    if cls is None:
        raise PublishError(f"manifest 'method' {method!r} is not a method this coordinator knows; registered: "
                           f"{', '.join(ALGORITHMS)} (a method of your own: the coordinator's operator names "
                           "the file that registers it in FL_SERVE_PLUGINS)")
    if cls.publish_refusal:
        raise PublishError(f"{method} bundles cannot be published: {cls.publish_refusal}")
    hyper = manifest.get("hyperparameters") or {}
    step = cls.device_step_for(hyper)
    if manifest.get("device_step") != step:
        raise PublishError(f"manifest 'device_step' is {manifest.get('device_step')!r}, a {method} bundle's is "
                           f"{step!r}; export it again with this version (fl-server export)")
    missing = [n for n in cls.bundle_artifacts(hyper) if n not in names]
    if missing:
        raise PublishError(f"a {method} bundle needs the artifacts {', '.join(missing)}; export it with "
                           "fl-server export (or the recipe's export)")


class PublishError(ValueError):
    """A bundle that cannot be published; the message says what is wrong and how to fix it."""


def verify_bundle_dir(root: Path, max_bytes: int, publisher: bool = False) -> Bundle:
    """Check a bundle directory completely (module docstring) and return it loaded; raises :class:`PublishError`.
    ``publisher``: the pre-check on the publishing machine (:func:`upload`), which leaves the contract of a
    method it does not know (one the coordinator's plugins register) to the coordinator."""
    files = sorted(p for p in root.iterdir())
    if len(files) > MAX_FILES:
        raise PublishError(f"a bundle has at most {MAX_FILES} files, this one {len(files)}")
    total = 0
    for p in files:
        if p.is_symlink() or not p.is_file():
            raise PublishError(f"{p.name!r} is not a regular file (a bundle holds plain files only)")
        total += p.stat().st_size
    if total > max_bytes:
        raise PublishError(f"the bundle has {total} bytes, over the limit of {max_bytes}")
    try:
        with warnings.catch_warnings():  # the publisher's signature is not ours to check: we sign what we serve
            warnings.simplefilter("ignore", UnverifiedSignatureWarning)
            bundle = load_bundle(root)
    except BundleError as exc:
        raise PublishError(str(exc).replace(str(root), "bundle")) from None
    m = bundle.manifest
    method = m["method"]
    if not isinstance(method, str) or not _METHOD.fullmatch(method):
        raise PublishError(f"manifest 'method' must be a method name (letters, digits, ' ._+()-'), got {method!r}")
    listed = {a["file"] for a in m["artifacts"]}
    extra = sorted({p.name for p in files} - listed - {MANIFEST, SIGNATURE})
    if extra:
        raise PublishError(f"files not listed in the manifest: {', '.join(extra)}; remove them or export again")
    names = [a.get("name") for a in m["artifacts"]]
    if len(set(names)) != len(names) or not all(isinstance(n, str) and _NAME.fullmatch(n) for n in names):
        raise PublishError(f"artifact names must be unique and match {_NAME.pattern}, got {names}")
    if not publisher or method in ALGORITHMS:
        check_contract(method, m, names)
    if "dataset" in m and not isinstance(m["dataset"], str):
        raise PublishError("manifest 'dataset' must be a string")
    graph_inputs = [_check_artifact(bundle, a) for a in m["artifacts"]]
    if any("bn_momentum" in inputs for inputs in graph_inputs) and ("stats" not in names or "batch_norm" not in m):
        raise PublishError("the model is batch-normalised but the bundle has no population statistics ('stats') or "
                           "no 'batch_norm' rule; export it again with this version")
    return bundle


def _check_artifact(bundle: Bundle, a: dict[str, Any]) -> list[str]:
    """Check one artifact; returns a graph's input names ([] for weights)."""
    name, kind = a["name"], a.get("kind")
    if kind == "onnx":
        try:
            session = bundle.session(name, threads=1)
        except Exception as exc:  # onnxruntime raises its own exception types for a broken graph
            raise PublishError(f"artifact {name!r}: onnxruntime cannot load it ({type(exc).__name__}: "
                               f"{str(exc)[:200]})") from None
        have = [i.name for i in session.get_inputs()]
        want = [i.get("name") for i in a.get("inputs", [])]
        if have != want or "x" not in have:
            raise PublishError(f"artifact {name!r}: the graph's inputs {have[:8]} differ from the manifest's "
                               f"{want[:8]} (or have no 'x')")
        return have
    elif kind == "weights":
        try:
            arrays = bundle.weights(name)
        except Exception as exc:  # np.load: ValueError (pickled objects refused), BadZipFile, OSError
            raise PublishError(f"artifact {name!r}: not a plain .npz of arrays ({type(exc).__name__}: "
                               f"{str(exc)[:200]})") from None
        for key, v in arrays.items():
            if v.dtype.kind not in "fiu" or (v.dtype.kind == "f" and not np.isfinite(v).all()):
                raise PublishError(f"artifact {name!r}: array {key!r} must be finite numbers, got {v.dtype}"
                                   f"{' with NaN or inf' if v.dtype.kind == 'f' else ''}")
        return []
    else:
        raise PublishError(f"artifact {name!r}: unknown kind {kind!r} (onnx or weights)")


def publish_dir(store: Store, artifacts: ArtifactStore, root: Path, max_bytes: int) -> dict[str, Any]:
    """Verify ``root`` and serve it: its files enter the artifact store, the bundle the store's table.
    Returns ``{"bundle_id", "method", "dataset"}``. Publishing the same bundle again is harmless."""
    bundle = verify_bundle_dir(root, max_bytes)
    for a in bundle.manifest["artifacts"]:
        artifacts.put_file(root / a["file"], expected=a["sha256"])
    bundle_id = artifacts.put_file(root / MANIFEST)
    dataset = str(bundle.manifest.get("dataset", "custom"))
    store.add_bundle(bundle_id, PUBLISHED_JOB, bundle.method, dataset, bundle.manifest, {})
    return {"bundle_id": bundle_id, "method": bundle.method, "dataset": dataset}


def extract_tar(archive: IO[bytes], dest: Path, max_bytes: int) -> Path:
    """Unpack a bundle archive into ``dest`` safely (no links, no paths, bounded); returns ``dest``. Members
    may sit in one top directory (``tar -cf b.tar bundle/``) or at the top (``tar -C bundle -cf - .``)."""
    try:
        tar = tarfile.open(fileobj=archive, mode="r:*")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise PublishError(f"the body is not a tar archive (plain or gzip) of a bundle directory ({exc})") from None
    total, seen, tops = 0, set(), set()
    with tar:
        for member in _members(tar):
            parts = [p for p in member.name.split("/") if p not in ("", ".")]
            if member.isdir() and len(parts) <= 1:
                tops.update(parts)
                continue
            if not member.isreg():
                raise PublishError(f"archive member {member.name[:80]!r} is not a regular file")
            if len(parts) > 2 or not all(_NAME.fullmatch(p) and p != ".." for p in parts):
                raise PublishError(f"archive member {member.name[:80]!r}: a bundle is one flat directory of files "
                                   "named [A-Za-z0-9._+-]")
            tops.update(parts[:-1])
            if len(tops) > 1:
                raise PublishError("the archive holds more than one directory; archive one bundle directory")
            name = parts[-1]
            if name in seen:
                raise PublishError(f"archive member {name!r} appears twice")
            seen.add(name)
            total += member.size
            if total > max_bytes or len(seen) > MAX_FILES:
                raise PublishError(f"the archive is over the limit of {max_bytes} bytes or {MAX_FILES} files")
            src = tar.extractfile(member)
            assert src is not None
            with src, open(dest / name, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    if MANIFEST not in seen:
        raise PublishError(f"the archive has no {MANIFEST}: archive the bundle directory that fl-server export wrote")
    return dest


def _members(tar: tarfile.TarFile):  # type: ignore[no-untyped-def]
    try:
        yield from tar
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise PublishError(f"the tar archive is damaged ({exc})") from None


def publish_archive(store: Store, artifacts: ArtifactStore, archive: IO[bytes], max_bytes: int) -> dict[str, Any]:
    """:func:`extract_tar` into a temporary directory, then :func:`publish_dir`."""
    with tempfile.TemporaryDirectory(dir=artifacts.root, prefix=".publish-") as tmp:
        return publish_dir(store, artifacts, extract_tar(archive, Path(tmp), max_bytes), max_bytes)


def tar_bundle(root: Path) -> bytes:
    """A bundle directory as a tar archive (what ``POST /v1/bundles`` takes), files at the top level."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(root.iterdir()):
            if p.is_file():
                tar.add(p, arcname=p.name)
    return buf.getvalue()


def upload(root: Path, url: str, admin_token: str, timeout: float = 120.0) -> dict[str, Any]:
    """Publish ``root`` to a running coordinator at ``url`` (``POST /v1/bundles`` with the admin token)."""
    import httpx

    verify_bundle_dir(root, 1 << 62, publisher=True)  # the same checks here first: a broken bundle fails early
    r = httpx.post(f"{url.rstrip('/')}/v1/bundles", content=tar_bundle(root), timeout=timeout,
                   headers={"Authorization": f"Bearer {admin_token}", "Content-Type": "application/octet-stream"})
    if r.status_code != 201:
        try:
            detail = r.json().get("detail")
        except ValueError:
            detail = r.text[:300]
        raise PublishError(f"{url} refused the bundle: HTTP {r.status_code}: {detail}")
    return r.json()
