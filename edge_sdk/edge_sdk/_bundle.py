"""Load an artifact bundle on the device: check the manifest's Ed25519 signature against a pinned key
(:mod:`edge_sdk.signing`), verify every file's sha256 and size before use, load weights without pickle,
open ONNX sessions. Nothing unverified is ever executed: each file is read once, its bytes hashed and kept,
and weights and sessions are built from those bytes (a file changed in the cache after the check never
reaches onnxruntime or numpy).

Without a pinned key (``public_key=None``) only the sha256 hashes are checked: that catches corruption, not
an attacker who rewrites the manifest too, so every bundle loaded so warns (:class:`UnverifiedSignatureWarning`),
signed or not (an unsigned one may be a signed one whose ``manifest.sig`` was deleted). ``EdgeClient`` always
passes a key (pinned, or trusted on first use).

A graph that names external data (a tensor whose bytes onnxruntime would read from a file beside the model, or,
for a model given as bytes, relative to the process's working directory) is refused by :func:`load_bundle`, at any
depth (initializers, attribute tensors, subgraphs, functions), before any session exists: the device never reads
a file a bundle names. The SDK has no ONNX dependency, so :func:`external_tensors` reads the protobuf wire format
itself (onnxruntime has no session option that forbids external data). One case is not a file: a step graph's
frozen weights (``fl_server.export.steps.frozen_spec``) are initializers of its main graph whose only external-data
entry is ``location`` = :data:`FROZEN_LOCATION`, a name no bundle file can have; each names a weight the bundle
already holds (``psi.<p>``: ``params``' array ``p``, ``phi.<p>``: ``phi``'s, :data:`FROZEN_SOURCES`) with the same
dtype and shape, and :meth:`Bundle.session` hands onnxruntime those verified arrays
(``SessionOptions.add_external_initializers``), so it reads no file and the weights are stored once."""
from __future__ import annotations

import hashlib
import io
import os
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk import _strictjson as strictjson
from edge_sdk._errors import BundleError, BundleSignatureError
from edge_sdk._preprocess import Preprocess
from edge_sdk.safeguard import SafeguardRule
from edge_sdk.signing import SIGNATURE_FILE, PublicKey, Release, parse_public_key, verify_manifest

__all__ = ["FROZEN_LOCATION", "FROZEN_SOURCES", "MANIFEST", "Bundle", "BundleError", "BundleSignatureError",
           "ExternalTensor", "UnverifiedSignatureWarning", "external_tensors", "load_bundle",
           "sha256_file"]
MANIFEST = "manifest.json"
#: the newest bundle format this SDK reads (fl_server.export.bundle writes it): 3 names the device step, 4 lets a
#: step graph refer to the bundle's frozen weights (:data:`FROZEN_LOCATION`) instead of holding them
BUNDLE_FORMAT = 4
# the external-data location of a step graph's frozen weights: not a file (no artifact name holds '<' or '>', and
# onnxruntime never looks for it: Bundle.session supplies the values), but the bundle's weights of the same name
FROZEN_LOCATION = "<bundle-weights>"
# a frozen weight's graph name prefix -> the weights artifact that holds it (fl_server.export.steps' input names)
FROZEN_SOURCES = {"psi.": "params", "phi.": "phi"}
_DTYPES = {1: "float32", 11: "float64", 7: "int64", 6: "int32"}  # onnx.TensorProto data types a weight can have

# ONNX messages that can hold tensors, and the field numbers (onnx.proto) of their sub-messages
_MODEL, _GRAPH, _NODE, _ATTRIBUTE, _TENSOR, _SPARSE, _FUNCTION, _TRAINING = range(8)
_CHILDREN = {
    _MODEL: {7: _GRAPH, 20: _TRAINING, 25: _FUNCTION},
    _TRAINING: {1: _GRAPH, 2: _GRAPH},
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},
    _NODE: {5: _ATTRIBUTE},
    _FUNCTION: {7: _NODE, 11: _ATTRIBUTE},
    _ATTRIBUTE: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},
}
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME, _TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 1, 2, 8, 13, 14
_MAX_NESTING = 100  # protobuf's own parsers stop at 100 nested messages too


class UnverifiedSignatureWarning(UserWarning):
    """A bundle was loaded without a public key: only its hashes were checked, not who wrote it."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _varint(buf: bytes, i: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= end or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return value, i


@dataclass(frozen=True)
class ExternalTensor:
    """A tensor of an ONNX model that stores its data outside it, as :func:`external_tensors` reads it."""
    name: str
    entries: tuple[tuple[str, str], ...]  # its external_data (key, value) pairs
    dims: tuple[int, ...]
    data_type: int  # onnx.TensorProto.DataType
    initializer: bool  # an initializer of the model's main graph (not of a subgraph, function or attribute)

    @property
    def frozen_weight(self) -> bool:
        """Whether it has the form of a frozen step weight: a main-graph initializer at :data:`FROZEN_LOCATION`."""
        return self.initializer and self.entries == (("location", FROZEN_LOCATION),)


def _entry(buf: bytes, i: int, end: int) -> tuple[str, str]:
    """A StringStringEntryProto (key = 1, value = 2) as (key, value); other fields are skipped."""
    out = ["", ""]
    while i < end:
        key, i = _varint(buf, i, end)
        if key & 7 == 0:
            _, i = _varint(buf, i, end)
            continue
        if key & 7 != 2:
            raise ValueError("an external_data entry holds only strings")
        size, i = _varint(buf, i, end)
        if i + size > end:
            raise ValueError("truncated field")
        if key >> 3 in (1, 2):
            out[(key >> 3) - 1] = buf[i:i + size].decode("utf-8", "replace")
        i += size
    return out[0], out[1]


def external_tensors(model: bytes) -> list[ExternalTensor]:
    """Every tensor of this serialised ONNX model that stores its data outside it (``data_location`` EXTERNAL or
    ``external_data`` entries), anywhere in it; empty when it has none. Raises ValueError for bytes that are not a
    protobuf message."""
    found: list[ExternalTensor] = []
    stack = [(_MODEL, 0, len(model), 0, False)]  # (message kind, start, end, depth, main graph / its initializer)
    while stack:
        kind, i, end, depth, main = stack.pop()
        if depth > _MAX_NESTING:
            raise ValueError(f"messages nested over {_MAX_NESTING} deep")
        children, name, external, groups = _CHILDREN.get(kind, {}), "", False, 0
        entries: list[tuple[str, str]] = []
        dims: list[int] = []
        data_type = 0
        tensor = kind == _TENSOR
        while i < end:
            key, i = _varint(model, i, end)
            field, wire = key >> 3, key & 7
            ours = tensor and not groups  # a field of this tensor (not of a group inside it)
            if wire == 0:
                value, i = _varint(model, i, end)
                external |= ours and field == _TENSOR_DATA_LOCATION and value == 1
                if ours and field == _TENSOR_DIMS:
                    dims.append(value)
                elif ours and field == _TENSOR_DATA_TYPE:
                    data_type = value
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            elif wire == 2:
                size, i = _varint(model, i, end)
                if i + size > end:
                    raise ValueError("truncated field")
                if not groups and field in children:
                    top = (kind == _MODEL and field == 7) or (main and kind == _GRAPH and field == 5)
                    stack.append((children[field], i, i + size, depth + 1, top))
                elif ours and field == _TENSOR_NAME:
                    name = model[i:i + size].decode("utf-8", "replace")
                elif ours and field == _TENSOR_EXTERNAL_DATA:
                    entries.append(_entry(model, i, i + size))
                elif ours and field == _TENSOR_DIMS:  # packed
                    j = i
                    while j < i + size:
                        value, j = _varint(model, j, i + size)
                        dims.append(value)
                external |= ours and field == _TENSOR_EXTERNAL_DATA
                i += size
            elif wire in (3, 4):  # a (deprecated) group in an unknown field: skipped
                groups += 1 if wire == 3 else -1
                if groups < 0:
                    raise ValueError("unbalanced group")
            else:
                raise ValueError(f"wire type {wire}")
        if i != end or groups:
            raise ValueError("truncated message")
        if external:
            found.append(ExternalTensor(name or "(unnamed)", tuple(entries), tuple(dims), data_type, main))
    return found


def frozen_weight_source(tensor: ExternalTensor, arrays: dict[str, dict[str, np.ndarray]]) -> tuple[str, str] | None:
    """(weights artifact, array) that a frozen step weight names, when ``arrays`` (artifact -> its arrays) holds it
    with the tensor's dtype and shape; None for any other external tensor."""
    named = _named_weight(tensor.name)
    if not tensor.frozen_weight or named is None:
        return None
    artifact, key = named
    value = arrays.get(artifact, {}).get(key)
    if value is None or str(value.dtype) != _DTYPES.get(tensor.data_type) or value.shape != tensor.dims:
        return None
    return artifact, key


def _named_weight(name: str) -> tuple[str, str] | None:
    """(weights artifact, array) that the graph name of a frozen weight names (:data:`FROZEN_SOURCES`)."""
    prefix = next((p for p in FROZEN_SOURCES if name.startswith(p)), None)
    return None if prefix is None else (FROZEN_SOURCES[prefix], name[len(prefix):])


@dataclass
class Bundle:
    root: Path
    manifest: dict[str, Any]
    signed_by: bytes | None = None  # the pinned key the manifest was verified with (None: hashes only)
    release: Release | None = None  # the signed release (method, version, expiry) when verified with a key
    verified: dict[str, bytes] = field(default_factory=dict, repr=False)  # artifact name -> the hashed bytes
    # graph -> {initializer: (weights artifact, array)}: its frozen weights, checked by load_bundle (module docstring)
    frozen: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict, repr=False)
    # the sha256 of manifest.json's bytes: the coordinator's id of this bundle (what a device names when it asks
    # for something only this bundle's server side can answer: ODPFL-HN's weights)
    id: str = ""

    @property
    def method(self) -> str:
        return str(self.manifest["method"])

    @property
    def device_step(self) -> str | None:
        """How a device personalises with this bundle (``Algorithm.device_step`` of its method, recorded at
        export): "tent_step", "fedtta_step", "fedicon_step", "encoder", "btfl" or None (the received model)."""
        return self.manifest["device_step"]

    @property
    def hyperparameters(self) -> dict[str, Any]:
        return dict(self.manifest.get("hyperparameters", {}))

    @property
    def safeguard(self) -> SafeguardRule | None:
        """The label-free safeguard rule the method declared (``manifest["safeguard"]``, validated at load), which
        :meth:`edge_sdk.Device.personalize` applies; None for a bundle that declares none."""
        spec = self.manifest.get("safeguard")
        return None if spec is None else SafeguardRule.from_manifest(spec)

    @property
    def preprocess(self) -> Preprocess:
        """How raw images become the model's input (``manifest["preprocess"]``); identity for bundles
        written before the manifest held one (their devices pass float32 NCHW, as the model reads)."""
        d = self.manifest.get("preprocess")
        pre = Preprocess.identity() if d is None else Preprocess.from_dict(d)
        return pre.with_moments(self.manifest.get("input_moments"))  # float data in no known range: its scale

    def artifact(self, name: str) -> dict[str, Any]:
        for a in self.manifest["artifacts"]:
            if a["name"] == name:
                return a
        names = ", ".join(a["name"] for a in self.manifest["artifacts"])
        raise BundleError(f"bundle {self.root} has no artifact {name!r} (it has: {names})")

    def path(self, name: str) -> Path:
        return self.root / self.artifact(name)["file"]

    def data(self, name: str) -> bytes:
        """An artifact's bytes as verified by :func:`load_bundle` (not read again from the file)."""
        self.artifact(name)
        return self.verified[name]

    def weights(self, name: str) -> dict[str, np.ndarray]:
        """An ``.npz`` artifact's arrays (no pickles). Those stored uncompressed (``np.savez``, as bundles are
        written) are read-only views of the verified bytes, not copies: a device holds its weights once (the
        ConvNet's 6.6 MB); copy one to change it."""
        data = self.data(name)
        views = _stored_arrays(data)
        if views is not None:
            return views
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return {k: arrays[k] for k in arrays.files}

    def session(self, name: str, threads: int | None = None):  # type: ignore[no-untyped-def]
        """An onnxruntime session of the ONNX artifact ``name``; TENT's and FedTTA's step graphs run in their own
        node order (:data:`IN_GRAPH_ORDER`, :func:`edge_sdk._steps.load_session`), optimised when they hold model
        weights as constants (:meth:`holds_model_weights`)."""
        from edge_sdk._steps import load_session

        if self.artifact(name)["kind"] != "onnx":
            raise BundleError(f"artifact {name!r} is not an ONNX graph")
        # FedICON's step runs optimised: in the graph's order, unoptimised, its projection-free variant's tuned
        # encoder left torch's by 0.03 in the logits (tests/test_fedicon_device.py), where optimised it agrees
        ordered = name in IN_GRAPH_ORDER
        return load_session(self.data(name), threads, in_graph_order=ordered,
                            constant_weights=ordered and self.holds_model_weights(name),
                            initializers=self.frozen_weights(name))

    def frozen_weights(self, name: str) -> dict[str, np.ndarray]:
        """The values of graph ``name``'s frozen weights (initializer name -> the bundle's verified array); empty
        for a graph that holds all its data."""
        refs = self.frozen.get(name, {})
        arrays = {artifact: self.weights(artifact) for artifact in {a for a, _ in refs.values()}}
        return {t: arrays[artifact][key] for t, (artifact, key) in refs.items()}

    def holds_model_weights(self, name: str) -> bool:
        """Whether the graph ``name`` holds some of the model's weights (the bundle's ``params``) as constants: it
        takes not every one as a ``psi.`` input (a frozen step graph: TENT's adapting only normalisation layers)."""
        inputs = {i.get("name") for i in self.artifact(name).get("inputs", [])}
        params = next((a for a in self.manifest["artifacts"] if a.get("name") == "params"), None)
        return params is not None and any(f"psi.{p}" not in inputs for p in params.get("arrays", {}))


# the step graphs that run in their own node order, unoptimised (edge_sdk._steps.load_session): the adaptation
# steps whose peak memory that order lowers
IN_GRAPH_ORDER = frozenset({"tent_step", "fedtta_step"})


def _stored_arrays(data: bytes) -> dict[str, np.ndarray] | None:
    """The arrays of an ``.npz`` whose members are all stored uncompressed, as read-only views of ``data``; None
    for any other archive (np.load reads it). Object arrays are refused as np.load(allow_pickle=False) does."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, ValueError):
        return None
    out: dict[str, np.ndarray] = {}
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED or not m.filename.endswith(".npy"):
            return None
        header = data[m.header_offset:m.header_offset + 30]
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            return None
        start = m.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
        member = io.BytesIO(data[start:start + min(m.file_size, 1 << 16)])  # the .npy header is within this
        try:
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(np.lib.format.read_magic(member))
            if read_header is None:
                return None
            shape, fortran, dtype = read_header(member)
        except ValueError:
            return None
        if dtype.hasobject:
            raise ValueError(f"{m.filename}: object arrays need pickle, which the SDK never loads")
        count = int(np.prod(shape))
        if member.tell() + count * dtype.itemsize != m.file_size:
            return None
        flat = np.frombuffer(data, dtype, count, start + member.tell())
        out[m.filename[:-len(".npy")]] = flat.reshape(shape, order="F" if fortran else "C")
    return out


def load_bundle(root: str | os.PathLike, public_key: PublicKey | None = None) -> Bundle:
    """Read and fully verify a bundle directory; raises :class:`BundleError` with one clear line.
    ``public_key`` (32 bytes or hex): the manifest's bytes must carry a valid signature by this key
    (``manifest.sig``), checked before anything else is read: a coordinator's release or an offline export's
    candidate (``Bundle.release.candidate``). The signed release's version and expiry are in ``Bundle.release``;
    judging them (rollback, freeze) is the update channel's job (``EdgeClient.download``,
    :mod:`edge_sdk._versions`): a bundle already on disk stays loadable offline after its release expires."""
    root = Path(root)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path}: not found (is {root} a bundle directory?)")
    raw = manifest_path.read_bytes()  # read once: the bytes verified are the bytes parsed
    trusted = release = None
    if public_key is not None:
        trusted = parse_public_key(public_key)
        sig_path = root / SIGNATURE_FILE
        release = verify_manifest(raw, sig_path.read_bytes() if sig_path.is_file() else None, trusted, str(root),
                                  candidate_ok=True)
    try:
        manifest = strictjson.loads(raw)
        artifacts = manifest["artifacts"]
        manifest["method"]
        if not isinstance(artifacts, list) or not all(isinstance(a, dict) for a in artifacts):
            raise TypeError("'artifacts' must be a list of objects")
        if manifest.get("preprocess") is not None:  # a bad one fails here, not at the first image
            Preprocess.from_dict(manifest["preprocess"]).with_moments(manifest.get("input_moments"))
        if manifest.get("safeguard") is not None:
            SafeguardRule.from_manifest(manifest["safeguard"])  # a bad rule fails here, not after adaptation
        fmt = manifest.get("format")
        if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > BUNDLE_FORMAT:
            raise TypeError(f"bundle format {fmt} is newer than this SDK reads (up to {BUNDLE_FORMAT}): "
                            "upgrade fl-edge-sdk")
        if "device_step" not in manifest:
            raise TypeError("it names no 'device_step' (written before bundle format 3): export it again")
        step = manifest["device_step"]
        if step is not None and not (isinstance(step, str) and 0 < len(step) <= 64):
            raise TypeError(f"'device_step' must be a step kind or null, got {str(step)[:40]!r}")
    except (ValueError, KeyError, TypeError) as exc:  # JSON and UTF-8 decoding errors are ValueErrors
        raise BundleError(f"{manifest_path}: malformed manifest ({exc})") from None
    verified: dict[str, bytes] = {}
    external: dict[str, tuple[Path, list[ExternalTensor]]] = {}
    for a in artifacts:
        file = a.get("file", "")
        if not file or Path(file).name != file or file in (".", "..", MANIFEST):  # no paths, no traversal
            raise BundleError(f"{manifest_path}: artifact {a.get('name')!r} has an invalid file name {file!r}")
        path = root / file
        if not path.is_file():
            raise BundleError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != a.get("size"):
            raise BundleError(f"{path}: size {path.stat().st_size} does not match the manifest ({a.get('size')})")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != a.get("sha256"):
            raise BundleError(f"{path}: sha256 does not match the manifest; refusing to use it")
        if a.get("kind") == "onnx":
            try:
                external[str(a.get("name"))] = (path, external_tensors(data))
            except ValueError as exc:
                raise BundleError(f"{path}: not an ONNX model ({exc})") from None
        verified[str(a.get("name"))] = data
    bundle = Bundle(root, manifest, trusted, release, verified, id=hashlib.sha256(raw).hexdigest())
    bundle.frozen = _frozen_references(bundle, external)
    if trusted is None:  # unsigned warns too: deleting manifest.sig must not be the way to silence the warning
        what = ("is signed, but no public key was given: its signature is not checked"
                if (root / SIGNATURE_FILE).is_file() else "is not signed and no public key was given")
        warnings.warn(UnverifiedSignatureWarning(
            f"{root} {what}; only its sha256 hashes are, which catch corruption, not someone who rewrites the "
            "manifest too. Pass public_key= (the coordinator's key, GET /v1/signing-key; an offline export's "
            "fl-server export --signing-key) to verify it"), stacklevel=2)
    return bundle


def _frozen_references(bundle: Bundle, external: dict[str, tuple[Path, list[ExternalTensor]]]
                       ) -> dict[str, dict[str, tuple[str, str]]]:
    """graph -> {tensor: (weights artifact, array)} for the graphs' external tensors, every one a frozen weight of
    the bundle (:func:`frozen_weight_source`); raises :class:`BundleError` for any other."""
    arrays: dict[str, dict[str, np.ndarray]] = {}
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for graph, (path, tensors) in external.items():
        for t in tensors:
            source = (_named_weight(t.name) or ("", ""))[0]
            if t.frozen_weight and source and source not in arrays and _is_weights(bundle, source):
                try:
                    arrays[source] = bundle.weights(source)
                except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
                    raise BundleError(f"{bundle.path(source)}: not a plain .npz of arrays ({exc})") from None
            found = frozen_weight_source(t, arrays)
            if found is None:
                reason = ("it names no weight of the bundle with its dtype and shape" if t.frozen_weight else
                          "a file outside the graph")
                raise BundleError(f"{path}: tensor {t.name!r} is stored as external data ({reason}); a bundle's graphs "
                                  f"hold all their data but frozen weights ({FROZEN_LOCATION!r}): export it again")
            out.setdefault(graph, {})[t.name] = found
    return out


def _is_weights(bundle: Bundle, name: str) -> bool:
    return any(a.get("name") == name and a.get("kind") == "weights" for a in bundle.manifest["artifacts"])
