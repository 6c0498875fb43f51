"""Publish a bundle exported elsewhere (``fl-server export``, a recipe's export): verify it, copy it into the
coordinator's content-addressed store and record it, after which it is served (and its manifest signed with
the coordinator's key, :meth:`fl_server.service.state.Service.signature`) exactly like a bundle the
coordinator trained; the newest bundle of a method is the one served.

Two doors, one check (:func:`verify_bundle_dir`):
* ``fl-server publish BUNDLE --store DIR`` (:func:`publish_dir`) on the coordinator's store, or
  ``fl-server publish BUNDLE --server URL`` (the endpoint below, with the admin token);
* ``POST /v1/bundles`` (admin token): the bundle directory as a tar archive (plain or gzip), e.g.
  ``tar -C runs/bundle -cf - . | curl -H "Authorization: Bearer $T" --data-binary @- URL/v1/bundles``.

What is refused, each with one line saying why: a ``manifest.sig`` that does not verify under the key it names
(the manifest changed after signing), an archive that is not tar, members that are not regular
files (links, devices), paths with directories or ``..``, more than ``MAX_FILES`` files or ``max_bytes`` in
all, a file the manifest does not list, a malformed manifest, a file whose size or sha256 differs from the
manifest, an ONNX graph that onnxruntime cannot load or whose inputs differ from the manifest, weights that
are not plain finite float arrays (read without pickle), a method this coordinator does not know, a
bundle that lacks what its method's device contract declares (``Algorithm.bundle_artifacts``, the manifest's
``device_step``), and bundles of a method that cannot be published (ODPFL-HN: its hypernetwork never leaves the
coordinator that trained it).

Hostile bundles are refused before anything expands: a graph that names external data (any tensor,
at any depth: initializers, attribute tensors, subgraphs, functions), but for a step graph's frozen weights -- main
graph initializers at ``edge_sdk.shared.FROZEN_LOCATION`` that name a weight of the bundle with its dtype and shape
(``load_bundle`` checks them; onnxruntime gets the bundle's arrays, reads no file); graphs and weights whose
declared sizes (initializers, constants, every value whose static shape onnx shape inference computes, with the graph's own
shape annotations ignored; each ``.npz`` member's npy header) sum past :func:`expanded_limit`; archives of more
than ``MAX_MEMBERS`` members or with tar headers over ``MAX_TAR_HEADER`` bytes; a manifest nested deeper than
``MAX_MANIFEST_DEPTH``, images over ``MAX_IMAGE_SIDE`` per side, and a BTFL bundle whose ``dle_clients`` or
global DLE a device or the DLE aggregate cannot use.
"""
from __future__ import annotations

import io
import math
import os
import re
import shutil
import tarfile
import tempfile
import warnings
import zipfile
from collections import Counter
from pathlib import Path
from typing import IO, Any

import numpy as np

from edge_sdk import Bundle, BundleError, BundleSignatureError, UnverifiedSignatureWarning, load_bundle
from edge_sdk.signing import parse_signature, verify_manifest
from edge_sdk.shared import FROZEN_LOCATION, MANIFEST
from fl_server.algorithms import ALGORITHMS
from fl_server.service.artifacts import ArtifactStore
from fl_server.service.store import Store

PUBLISHED_JOB = "published"  # the job id recorded for a published bundle
MAX_FILES = 64
SIGNATURE = "manifest.sig"  # a publisher's own signature is not needed (the coordinator signs what it serves); one
# that is there must verify (check_own_signature)
_NAME = re.compile(r"[A-Za-z0-9._+-]{1,64}")
_METHOD = re.compile(r"[A-Za-z0-9 ._+()-]{1,64}")
MAX_MEMBERS = MAX_FILES + 1  # archive members at most: the files and one directory entry
MAX_TAR_HEADER = 64 << 10  # the data of one pax or GNU long-name header at most (tarfile reads it into memory)
MAX_NPZ_ARRAYS = 4096  # members of one weights file at most
MAX_MANIFEST_DEPTH = 32  # nesting of the manifest's JSON (an export's is 5)
MAX_IMAGE_SIDE = 4096  # preprocess 'size' and raw image sizes at most, per side
MAX_DLE_CLIENTS = 10_000  # a BTFL bundle's training clients at most (a job trains at most 1000)
EXPANDED_PER_BYTE = 4  # the default expanded limit, in multiples of the bundle byte limit


def expanded_limit(max_bytes: int) -> int:
    """Bytes a bundle's graphs and weights may expand to in all: ``FL_SERVE_MAX_BUNDLE_EXPANDED_BYTES``, else
    ``EXPANDED_PER_BYTE`` times the byte limit (weights stored plainly expand about 1:1; a frozen graph holds the
    weights once more)."""
    raw = os.environ.get("FL_SERVE_MAX_BUNDLE_EXPANDED_BYTES", "").strip()
    return int(raw) if raw else EXPANDED_PER_BYTE * max_bytes


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


def check_own_signature(root: Path) -> None:
    """A publisher's ``manifest.sig`` must verify under the key it names: whoever signed the bundle, a signature
    that fails means the manifest changed after signing while the signature travelled with it (in transit, or an
    edit by hand), which no release may hide under the coordinator's signature. Raises
    :class:`edge_sdk.BundleSignatureError`. A bundle without one, or with one this version cannot read (an older
    coordinator's), passes, as before: the check catches an edit, not a publisher who deletes the signature (the
    admin token is what guards publishing)."""
    sig = root / SIGNATURE
    if not sig.is_file():
        return
    record = sig.read_bytes()
    try:
        signer = parse_signature(record, "bundle")[0]
    except BundleSignatureError:
        return  # not a record this version reads: nothing to check it against
    try:
        verify_manifest((root / MANIFEST).read_bytes(), record, signer, "bundle", candidate_ok=True)
    except BundleSignatureError as exc:
        raise BundleSignatureError(f"{exc}: export it again from its run (its {SIGNATURE} fails, so it is not "
                                   "the bundle that was signed)") from None


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
        with warnings.catch_warnings():  # the coordinator signs what it serves, whoever signed the candidate
            warnings.simplefilter("ignore", UnverifiedSignatureWarning)
            bundle = load_bundle(root)
        check_own_signature(root)
    except BundleError as exc:
        raise PublishError(str(exc).replace(str(root), "bundle")) from None  # too deep to parse: strictjson says so
    m = bundle.manifest
    check_manifest_fields(m)
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
    check_expansion(bundle, expanded_limit(max_bytes))
    graph_inputs = [_check_artifact(bundle, a) for a in m["artifacts"]]
    if "btfl" in names:
        check_btfl(bundle.weights("btfl"))
    if any("bn_momentum" in inputs for inputs in graph_inputs) and ("stats" not in names or "batch_norm" not in m):
        raise PublishError("the model is batch-normalised but the bundle has no population statistics ('stats') or "
                           "no 'batch_norm' rule; export it again with this version")
    return bundle


def check_manifest_fields(m: dict[str, Any]) -> None:
    """Bounds on the manifest's shape and on the image sizes a device will allocate (``preprocess``)."""
    depth, level = 1, [v for v in m.values() if isinstance(v, (dict, list))]
    while level and depth <= MAX_MANIFEST_DEPTH:
        depth += 1
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (dict, list))]
    if level:
        raise PublishError(f"{MANIFEST} is nested deeper than {MAX_MANIFEST_DEPTH} levels")
    p = m.get("preprocess") or {}
    sides = [*(p.get("size") or []), *((p.get("raw") or {}).get("shape") or [])]  # load_bundle checked the types
    if any(s is not None and s > MAX_IMAGE_SIDE for s in sides):
        raise PublishError(f"manifest 'preprocess': image sizes must be at most {MAX_IMAGE_SIDE} per side, got size "
                           f"{p.get('size')} and raw shape {(p.get('raw') or {}).get('shape')}")


def check_btfl(arrays: dict[str, np.ndarray]) -> None:
    """A BTFL bundle's ``btfl`` weights as the DLE aggregate and devices use them: ``dle_clients`` one integer in
    [1, ``MAX_DLE_CLIENTS``] (the training clients the global DLE counts as), ``global_dle`` [D, L] rows of level
    frequencies (finite, non-negative, summing to 1)."""
    n, dle = arrays.get("dle_clients"), arrays.get("global_dle")
    if n is None or n.size != 1 or n.dtype.kind not in "iu" or not 1 <= int(n.reshape(-1)[0]) <= MAX_DLE_CLIENTS:
        got = None if n is None else f"{n.reshape(-1)[:2].tolist()} ({n.dtype})"
        raise PublishError(f"artifact 'btfl': dle_clients must be one integer in [1, {MAX_DLE_CLIENTS}] (the training "
                           f"clients), got {got}")
    if dle is None or dle.ndim != 2 or dle.shape[1] < 2 or dle.dtype.kind != "f":
        raise PublishError(f"artifact 'btfl': global_dle must be a float [features, levels] array with levels >= 2, "
                           f"got {None if dle is None else (dle.dtype, dle.shape)}")
    bad = np.flatnonzero((dle < 0).any(axis=1) | ~np.isclose(dle.sum(axis=1), 1.0, atol=1e-6))
    if bad.size:
        raise PublishError(f"artifact 'btfl': every global_dle row must be level frequencies (non-negative, summing "
                           f"to 1); row {int(bad[0])} is {dle[bad[0]][:8].tolist()}")


def check_expansion(bundle: Bundle, limit: int) -> None:
    """What the bundle's graphs and weights declare they expand to, summed, is at most ``limit`` bytes; read from
    the graphs' protobufs and the npy headers, before any session is created or any array loaded. A graph naming
    external data is refused here too (load_bundle refuses it first), but for the frozen weights load_bundle
    accepted (``Bundle.frozen``), which the bundle's weights hold and count."""
    total = 0
    for a in bundle.manifest["artifacts"]:
        name, data = a["name"], bundle.data(a["name"])
        kind = a.get("kind")
        sizes = (_graph_sizes(name, data, set(bundle.frozen.get(name, {}))) if kind == "onnx" else
                 _npz_sizes(name, data) if kind == "weights" else [])
        total += sum(n for _, n in sizes)
        if total > limit:
            what, n = max(sizes, key=lambda s: s[1])
            raise PublishError(f"artifact {name!r}: {what!r} would expand to {n} bytes; a bundle's graphs and weights "
                               f"may expand to {limit} bytes in all (FL_SERVE_MAX_BUNDLE_EXPANDED_BYTES)")


def _nbytes(name: str, dims: list[int], elem_type: int) -> int:
    from onnx import helper

    if any(d < 0 for d in dims):
        raise PublishError(f"tensor {name!r} has a negative dimension {list(dims)[:8]}")
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    except (KeyError, ValueError, TypeError):
        itemsize = 8
    return math.prod(dims) * max(itemsize, 1)


def _graph_parts(model: Any) -> tuple[list[Any], list[Any]]:
    """(graphs, tensors) of an ONNX model: the main graph and every subgraph at any depth (attributes of nodes in
    graphs and in model-local functions), and every tensor in them (initializers, sparse ones, attribute values)."""
    graphs: list[Any] = []
    tensors: list[Any] = []
    attrs = [a for f in model.functions for a in [*f.attribute_proto, *(a for n in f.node for a in n.attribute)]]
    pending = [model.graph, *(g for t in model.training_info for g in (t.initialization, t.algorithm))]
    while pending or attrs:
        if pending:
            g = pending.pop()
            graphs.append(g)
            tensors += [*g.initializer, *(t for s in g.sparse_initializer for t in (s.values, s.indices))]
            attrs += [a for n in g.node for a in n.attribute]
            continue
        a = attrs.pop()
        sparse = [*([a.sparse_tensor] if a.HasField("sparse_tensor") else []), *a.sparse_tensors]
        tensors += [*([a.t] if a.HasField("t") else []), *a.tensors,
                    *(t for s in sparse for t in (s.values, s.indices))]
        pending += [*([a.g] if a.HasField("g") else []), *a.graphs]
    return graphs, tensors


def _graph_sizes(name: str, data: bytes, frozen: set[str] = set()) -> list[tuple[str, int]]:
    """(tensor or value name, bytes) for every tensor of the graph and every value whose shape onnx shape inference
    computes statically (shapes the graph itself declares are dropped first: they need not be true). ``frozen``:
    the main graph's initializers that refer to the bundle's weights (sized there), the only external data allowed."""
    import onnx

    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf's DecodeError (or RecursionError for nesting past its limit)
        raise PublishError(f"artifact {name!r}: not an ONNX model ({type(exc).__name__})") from None
    graphs, tensors = _graph_parts(model)
    references = Counter(t.name for t in model.graph.initializer if t.name in frozen and _frozen_reference(t))
    sizes = []
    for t in tensors:
        if references[t.name] and _frozen_reference(t):  # as many as the main graph has, whatever else names them
            references[t.name] -= 1
            continue
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data):
            raise PublishError(f"artifact {name!r}: tensor {t.name!r} is stored as external data (a file outside the "
                               "graph); a bundle's graphs must hold all their data: export it again")
        sizes.append((t.name, _nbytes(t.name, list(t.dims), t.data_type)))
    for g in graphs:
        del g.value_info[:]
        for v in g.output:
            v.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # onnx raises its own InferenceError / ValidationError types
        raise PublishError(f"artifact {name!r}: onnx shape inference fails ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    for g in _graph_parts(inferred)[0]:
        for v in [*g.value_info, *g.output]:
            t = v.type.tensor_type
            if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
                sizes.append((v.name, _nbytes(v.name, [d.dim_value for d in t.shape.dim], t.elem_type)))
    return sizes


def _frozen_reference(t: Any) -> bool:
    """Whether the tensor proto ``t`` has the form of a frozen weight: external data at FROZEN_LOCATION only."""
    from onnx import TensorProto

    return t.data_location == TensorProto.EXTERNAL and [(e.key, e.value) for e in t.external_data] == [
        ("location", FROZEN_LOCATION)]


def _npz_sizes(name: str, data: bytes) -> list[tuple[str, int]]:
    """(array name, bytes) of every member of an .npz, from its npy header and zip entry (no data read)."""
    sizes = []
    try:
        end = zipfile._EndRecData(io.BytesIO(data))  # type: ignore[attr-defined]  # zipfile parses all it lists
        if end and end[zipfile._ECD_SIZE] > MAX_NPZ_ARRAYS * 1024:  # type: ignore[attr-defined]
            raise PublishError(f"artifact {name!r}: its zip directory is over {MAX_NPZ_ARRAYS * 1024} bytes")
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            if len(z.infolist()) > MAX_NPZ_ARRAYS:
                raise PublishError(f"artifact {name!r}: more than {MAX_NPZ_ARRAYS} arrays")
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    raise PublishError(f"artifact {name!r}: member {info.filename[:80]!r} is not an .npy array")
                with z.open(info) as fh:
                    version = np.lib.format.read_magic(fh)
                    if version not in ((1, 0), (2, 0)):
                        raise PublishError(f"artifact {name!r}: {info.filename[:80]!r} has npy format {version}")
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    shape, _, dtype = read(fh)
                array = info.filename[:-4]
                sizes.append((array, max(info.file_size, math.prod(shape) * dtype.itemsize)))
    except PublishError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:  # np.lib.format: ValueError for a bad header
        raise PublishError(f"artifact {name!r}: not a plain .npz of arrays ({type(exc).__name__}: "
                           f"{str(exc)[:200]})") from None
    return sizes


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
    Returns ``{"bundle_id", "method", "dataset", "version"}``: the release version the coordinator assigned
    (:meth:`Store.add_bundle`; a publisher's own ``manifest.sig`` is ignored). Publishing the served bundle again
    is harmless; publishing an earlier one serves it again under a new version (a rollback)."""
    bundle = verify_bundle_dir(root, max_bytes)
    for a in bundle.manifest["artifacts"]:
        artifacts.put_file(root / a["file"], expected=a["sha256"])
    bundle_id = artifacts.put_file(root / MANIFEST)
    dataset = str(bundle.manifest.get("dataset", "custom"))
    version = store.add_bundle(bundle_id, PUBLISHED_JOB, bundle.method, dataset, bundle.manifest, {})
    return {"bundle_id": bundle_id, "method": bundle.method, "dataset": dataset, "version": version}


def extract_tar(archive: IO[bytes], dest: Path, max_bytes: int) -> Path:
    """Unpack a bundle archive into ``dest`` safely (no links, no paths, bounded); returns ``dest``. Members
    may sit in one top directory (``tar -cf b.tar bundle/``) or at the top (``tar -C bundle -cf - .``)."""
    try:
        tar = tarfile.open(fileobj=archive, mode="r:*", tarinfo=_BoundedTarInfo)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise PublishError(f"the body is not a tar archive (plain or gzip) of a bundle directory ({exc})") from None
    total, seen, tops = 0, set(), set()
    with tar:
        for count, member in enumerate(_members(tar), 1):
            if count > MAX_MEMBERS:  # directory entries too: 500k of them once cost 38 s
                raise PublishError(f"the archive has more than {MAX_MEMBERS} members; a bundle has at most "
                                   f"{MAX_FILES} files")
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


class _BoundedTarInfo(tarfile.TarInfo):
    """A tar header whose pax or GNU long-name data is refused over ``MAX_TAR_HEADER`` bytes, before tarfile
    reads that data into memory (its size is the attacker's)."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _HEADER_TYPES and self.size > MAX_TAR_HEADER:
            raise tarfile.HeaderError(f"a {self.type!r} header of {self.size} bytes (at most {MAX_TAR_HEADER})")
        return super()._proc_member(tar)  # type: ignore[misc]


_HEADER_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                 tarfile.GNUTYPE_LONGLINK)


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
