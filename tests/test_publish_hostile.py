"""Hostile bundles on publish (issue 50: N1 external data, N6 expansion bombs, N7 semantic fields) against a real
coordinator (uvicorn) and the device SDK's ``load_bundle``; and N10, rotated secrets retired for good. Each bad
bundle is a real exported TENT or BTFL bundle with one part replaced by a graph built with ``onnx.helper`` (or an
``.npz`` / tar written by hand), its manifest made consistent so that only the new checks can catch it."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from coordinator_proc import ADMIN, Coordinator, auth, start
from edge_sdk import BundleError, load_bundle
from edge_sdk.shared import FROZEN_LOCATION
from fl_server.cli import main as cli
from fl_server.export.embed import weight_reference
from fl_server.service.publish import tar_bundle

pytestmark = pytest.mark.timeout(300)
LIMIT = 3_000_000  # FL_SERVE_MAX_BUNDLE_BYTES of the test server (expanded: 4x, 12 MB)
BIG = 250_000_000  # floats: 1 GB once expanded


def _export(root: Path, method: str) -> dict[str, bytes]:
    assert cli(["train", "--dataset", "digits", "--method", method, "--rounds", "1", "--out", str(root / "run"),
                "--no-progress"]) == 0
    assert cli(["export", str(root / "run"), "--out", str(root / "bundle")]) == 0
    return {p.name: p.read_bytes() for p in sorted((root / "bundle").iterdir())}


@pytest.fixture(scope="module")
def tent(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return _export(tmp_path_factory.mktemp("tent"), "TENT")


@pytest.fixture(scope="module")
def btfl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return _export(tmp_path_factory.mktemp("btfl"), "BTFL")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tent: dict[str, bytes]):  # type: ignore[no-untyped-def]
    coord = start(tmp_path_factory.mktemp("hostile") / "store", methods="",
                  env={"FL_SERVE_MAX_BUNDLE_BYTES": str(LIMIT)})
    assert _post(coord, _tar(tent)).status_code == 201  # warm: the publish path's imports are loaded
    yield coord
    coord.stop()


def _post(server: Coordinator, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/bundles", content=body, headers=auth(ADMIN), timeout=120)


def _tar(files: dict[str, bytes], dirs: int = 0) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for _ in range(dirs):  # "./" entries, as `tar -C bundle -cf - .` writes one
            info = tarfile.TarInfo(".")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _with(files: dict[str, bytes], artifact: str | None = None, data: bytes = b"",
          edit: Callable[[dict[str, Any]], None] | None = None) -> dict[str, bytes]:
    """The bundle with one artifact's bytes replaced and/or its manifest edited, hashes made consistent."""
    m = json.loads(files["manifest.json"])
    out = dict(files)
    if artifact is not None:
        a = next(a for a in m["artifacts"] if a["name"] == artifact)
        a["sha256"], a["size"] = hashlib.sha256(data).hexdigest(), len(data)
        out[a["file"]] = data
    if edit is not None:
        edit(m)
    out["manifest.json"] = json.dumps(m).encode()
    return out


def _graph(files: dict[str, bytes], nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto],
           output: str = "logits") -> bytes:
    """A forward graph with the inputs the manifest lists (so the input check passes) and the given body."""
    m = json.loads(files["manifest.json"])
    spec = next(a for a in m["artifacts"] if a["name"] == "forward")["inputs"]
    inputs = [helper.make_tensor_value_info(i["name"], TensorProto.FLOAT, i["shape"]) for i in spec]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "forward", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _external(name: str, location: str = "pyproject.toml") -> onnx.TensorProto:
    """A float[4] tensor whose 16 bytes onnxruntime would read from ``location``, relative to its working
    directory (the coordinator runs in the repository root, which has a pyproject.toml)."""
    t = helper.make_tensor(name, TensorProto.FLOAT, [4], np.zeros(4, np.float32).tobytes(), raw=True)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "16")):
        t.external_data.add(key=k, value=v)
    return t


def _one(name: str = "one") -> onnx.TensorProto:
    return numpy_helper.from_array(np.ones(1, np.float32), name)


def _external_graphs(files: dict[str, bytes]) -> dict[str, bytes]:
    """Graphs naming external data: as an initializer, inside an If branch, as a Constant's attribute."""
    cond = numpy_helper.from_array(np.array(True), "cond")
    branch = helper.make_graph([helper.make_node("Identity", ["w"], ["out"])], "branch", [],
                               [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])],
                               initializer=[_external("w")])
    constant = helper.make_node("Constant", [], ["c"])
    constant.attribute.add().CopyFrom(helper.make_attribute("value", _external("v")))
    return {
        "initializer": _graph(files, [helper.make_node("Identity", ["w"], ["logits"])], [_external("w")]),
        "if branch": _graph(files, [helper.make_node("If", ["cond"], ["logits"], then_branch=branch,
                                                     else_branch=branch)], [cond]),
        "constant attribute": _graph(files, [constant, helper.make_node("Identity", ["c"], ["logits"])], []),
    }


# ---------------------------------------------------------------- N1: external data
def test_publish_refuses_a_graph_that_reads_a_file_of_the_coordinator(server: Coordinator,
                                                                       tent: dict[str, bytes]) -> None:
    graph = _external_graphs(tent)["initializer"]
    r = _post(server, _tar(_with(tent, "forward", graph)))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "external data" in detail and "'w'" in detail and "\n" not in detail, detail


@pytest.mark.parametrize("where", ["initializer", "if branch", "constant attribute"])
def test_the_device_refuses_external_data_at_any_depth(tent: dict[str, bytes], tmp_path: Path, where: str) -> None:
    files = _with(tent, "forward", _external_graphs(tent)[where])
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(BundleError, match="external data"):
        load_bundle(tmp_path)  # before any onnxruntime session: load_bundle creates none
    (tmp_path / "forward.onnx").write_bytes(b"\x08\x07garbage")  # not protobuf: refused too, not skipped
    files = _with(tent, "forward", b"\x08\x07garbage")
    (tmp_path / "manifest.json").write_bytes(files["manifest.json"])
    with pytest.raises(BundleError, match="not an ONNX model"):
        load_bundle(tmp_path)


def _referring(files: dict[str, bytes], name: str, shape: list[int],
               location: str = FROZEN_LOCATION) -> dict[str, bytes]:
    """The bundle with a forward graph whose output is the initializer ``name``, a frozen weight reference as the
    exporter writes one (``location`` replaced), and which no longer takes ``name`` as an input."""
    def drop(m: dict[str, Any]) -> None:
        forward = next(a for a in m["artifacts"] if a["name"] == "forward")
        forward["inputs"] = [i for i in forward["inputs"] if i["name"] != name]

    edited = _with(files, edit=drop)
    reference = weight_reference(np.zeros(shape, np.float32), name)
    reference.external_data[0].value = location
    return _with(edited, "forward", _graph(edited, [helper.make_node("Identity", [name], ["logits"])], [reference]))


@pytest.mark.parametrize("case", ["a weight of the bundle", "unknown name", "relative location", "other shape"])
def test_frozen_weight_references_name_a_weight_of_the_bundle(server: Coordinator, tent: dict[str, bytes],
                                                              tmp_path: Path, case: str) -> None:
    with np.load(io.BytesIO(tent["params.npz"])) as params:
        key, value = next((k, params[k]) for k in params.files)
    name, shape, location = {"a weight of the bundle": (f"psi.{key}", list(value.shape), FROZEN_LOCATION),
                             "unknown name": ("psi.not_a_weight", list(value.shape), FROZEN_LOCATION),
                             "relative location": (f"psi.{key}", list(value.shape), "params.npz"),
                             "other shape": (f"psi.{key}", [*value.shape, 1], FROZEN_LOCATION)}[case]
    files = _referring(tent, name, shape, location)
    for file, data in files.items():
        (tmp_path / file).write_bytes(data)
    r = _post(server, _tar(files))
    if case == "a weight of the bundle":  # the coordinator loads it; the device's session reads the bundle's array
        assert r.status_code == 201, r.text
        bundle = load_bundle(tmp_path)
        session = bundle.session("forward")
        feeds = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], np.float32)
                 for i in session.get_inputs()}
        assert np.array_equal(session.run(["logits"], feeds)[0], value)
        return
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "external data" in detail and repr(name) in detail and "\n" not in detail, detail
    with pytest.raises(BundleError, match="external data"):
        load_bundle(tmp_path)  # before any onnxruntime session


# ---------------------------------------------------------------- N6: expansion bombs
def _expand_bomb(files: dict[str, bytes]) -> bytes:
    shape = numpy_helper.from_array(np.array([BIG], np.int64), "shape")
    return _graph(files, [helper.make_node("Expand", ["one", "shape"], ["logits"])], [_one(), shape])


def _npz_bomb() -> bytes:
    """An .npz whose one member declares BIG float32 zeros (1 GB) in ~1 MB of deflate."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        with z.open("w.npy", "w", force_zip64=True) as out:
            np.lib.format.write_array_header_1_0(out, {"descr": "<f4", "fortran_order": False, "shape": (BIG,)})
            chunk = bytes(16 << 20)
            for _ in range(4 * BIG // len(chunk)):
                out.write(chunk)
            out.write(bytes(4 * BIG % len(chunk)))
    return buf.getvalue()


def _pax_bomb(files: dict[str, bytes]) -> bytes:
    """A gzip tar whose first header is a pax header of 200 MB of zeros (tarfile reads a pax header's data
    whole), then the bundle."""
    import gzip

    pax = tarfile.TarInfo("pax")
    pax.type, pax.size = tarfile.XHDTYPE, 200 << 20
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9) as gz:
        gz.write(pax.tobuf(format=tarfile.USTAR_FORMAT))
        for _ in range(pax.size // (16 << 20)):
            gz.write(bytes(16 << 20))
        gz.write(_tar(files))
    return buf.getvalue()


class _PeakRSS:
    """The largest VmRSS (bytes) of a process while the block runs, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def rss(self) -> int:
        line = next(l for l in Path(f"/proc/{self.pid}/status").read_text().splitlines() if l.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    def __enter__(self) -> "_PeakRSS":
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def test_expansion_bombs_are_refused_without_expanding(server: Coordinator, tent: dict[str, bytes]) -> None:
    graph, npz = _expand_bomb(tent), _npz_bomb()
    assert len(graph) < 1000 and len(npz) < 2 << 20
    bombs = {"graph": (_tar(_with(tent, "forward", graph)), "would expand to", "'logits'"),
             "weights": (_tar(_with(tent, "params", npz)), "would expand to", "'w'"),
             "tar header": (_pax_bomb(tent), "tar archive", "header of 209715200 bytes")}
    sampler = _PeakRSS(server.proc.pid)
    baseline = sampler.rss()
    for case, (body, message, names) in bombs.items():
        with sampler:
            r = _post(server, body)
        assert 400 <= r.status_code < 500, (case, r.text)
        detail = r.json()["detail"]
        assert message in detail and names in detail and "\n" not in detail, detail
        assert sampler.peak - baseline < 100 << 20, f"{case}: RSS rose {(sampler.peak - baseline) >> 20} MiB"


def test_an_archive_of_many_members_is_refused_early(server: Coordinator, tent: dict[str, bytes]) -> None:
    r = _post(server, _tar(tent, dirs=2000))
    assert r.status_code == 422 and "members" in r.json()["detail"], r.text


# ---------------------------------------------------------------- N7: semantic fields
def _btfl_arrays(files: dict[str, bytes], **changes: np.ndarray) -> bytes:
    with np.load(io.BytesIO(files["btfl.npz"])) as arrays:
        out = {k: arrays[k] for k in arrays.files}
    out.update(changes)
    buf = io.BytesIO()
    np.savez(buf, **out)
    return buf.getvalue()


def _dle(files: dict[str, bytes], row: np.ndarray) -> np.ndarray:
    with np.load(io.BytesIO(files["btfl.npz"])) as arrays:
        dle = arrays["global_dle"].copy()
    dle[3] = row
    return dle


BTFL_BAD: list[tuple[str, Callable[[dict[str, bytes]], dict[str, np.ndarray]], str]] = [
    ("dle_clients -1", lambda f: {"dle_clients": np.array([-1], np.int64)}, "dle_clients"),
    ("dle_clients 0", lambda f: {"dle_clients": np.array([0], np.int64)}, "dle_clients"),
    ("dle_clients 2.5", lambda f: {"dle_clients": np.array([2.5])}, "dle_clients"),
    ("dle_clients 1e12", lambda f: {"dle_clients": np.array([10 ** 12], np.int64)}, "dle_clients"),
    ("zero dle row", lambda f: {"global_dle": _dle(f, np.zeros(2))}, "global_dle"),
    ("negative dle row", lambda f: {"global_dle": _dle(f, np.array([1.5, -0.5]))}, "global_dle"),
]


@pytest.mark.parametrize("case, change, field", BTFL_BAD, ids=[b[0] for b in BTFL_BAD])
def test_btfl_fields_are_validated(server: Coordinator, btfl: dict[str, bytes], case: str,
                                   change: Callable[[dict[str, bytes]], dict[str, np.ndarray]], field: str) -> None:
    r = _post(server, _tar(_with(btfl, "btfl", _btfl_arrays(btfl, **change(btfl)))))
    assert r.status_code == 422 and field in r.json()["detail"], r.text


def _nest(depth: int) -> Any:
    return json.loads("[" * depth + "]" * depth)


MANIFEST_BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("huge preprocess size", lambda m: m["preprocess"].update(size=[100_000, 100_000]), "preprocess"),
    ("huge raw shape", lambda m: m["preprocess"]["raw"].update(shape=[1, 100_000, 100_000]), "preprocess"),
    ("method none", lambda m: m.update(method="none"), "not a method this coordinator knows"),
    ("unknown method", lambda m: m.update(method="NoSuchMethod"), "not a method this coordinator knows"),
    ("nested 40 deep", lambda m: m.update(notes=_nest(40)), "nested"),
    ("unknown safeguard rule", lambda m: m.update(safeguard={"rule": "trust-me"}), "unknown safeguard rule"),
    ("safeguard weight 1e300", lambda m: m.update(safeguard={"rule": "linear", "weights": {"disagreement": 1e300}}),
     "finite numbers below 1e6"),
]


@pytest.mark.parametrize("case, edit, message", MANIFEST_BAD, ids=[b[0] for b in MANIFEST_BAD])
def test_manifest_fields_are_validated(server: Coordinator, tent: dict[str, bytes], case: str,
                                       edit: Callable[[dict[str, Any]], None], message: str) -> None:
    r = _post(server, _tar(_with(tent, edit=edit)))
    assert r.status_code == 422 and message in r.json()["detail"], r.text


def test_a_manifest_nested_100k_deep_is_a_422(server: Coordinator, tent: dict[str, bytes]) -> None:
    m = tent["manifest.json"].decode()
    deep = m[:-1].rstrip() + ', "notes": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = _post(server, _tar({**tent, "manifest.json": deep.encode()}))
    assert r.status_code == 422 and "nested" in r.json()["detail"], r.text


# ---------------------------------------------------------------- N10: rotated secrets
def test_rotated_secrets_do_not_come_back(tmp_path: Path) -> None:
    """A store first run with a generated admin token and signing key, then with both from the environment: once
    the variables are unset again, neither old secret works (the admin token is a new one; the old signing key
    is refused with one line, so devices pinning the new key do not silently meet the old one)."""
    store = tmp_path / "store"
    first = start(store, methods="", env={"FL_ADMIN_TOKEN": ""})
    try:
        old_token = (store / "admin_token").read_text().strip()
        old_key = httpx.get(f"{first.url}/v1/signing-key", timeout=10).json()["public_key"]
        assert httpx.get(f"{first.url}/v1/jobs", headers=auth(old_token), timeout=10).status_code == 200
    finally:
        first.stop()
    new_seed = "11" * 32
    rotated = start(store, methods="", env={"FL_SIGNING_KEY": new_seed})  # FL_ADMIN_TOKEN = ADMIN
    try:
        new_key = httpx.get(f"{rotated.url}/v1/signing-key", timeout=10).json()["public_key"]
        assert new_key != old_key
        assert httpx.get(f"{rotated.url}/v1/jobs", headers=auth(old_token), timeout=10).status_code == 401
    finally:
        rotated.stop()
    assert not (store / "admin_token").exists() and not (store / "signing_key.pem").exists()
    unset_token = start(store, methods="", env={"FL_ADMIN_TOKEN": "", "FL_SIGNING_KEY": new_seed})
    try:
        assert httpx.get(f"{unset_token.url}/v1/jobs", headers=auth(old_token), timeout=10).status_code == 401
        fresh = (store / "admin_token").read_text().strip()
        assert fresh != old_token
        assert httpx.get(f"{unset_token.url}/v1/jobs", headers=auth(fresh), timeout=10).status_code == 200
    finally:
        unset_token.stop()
    with pytest.raises(RuntimeError, match="retired"):
        start(store, methods="", env={"FL_SIGNING_KEY": ""})
