"""Artifact bundles: ONNX graphs and ``.npz`` weights plus ``manifest.json`` (sha256, size, opset, I/O
signatures, method and hyperparameters, versions), and ``manifest.sig`` (Ed25519 over the manifest's bytes)
when a signer is given. Written atomically: files go to a temporary sibling directory, are fsynced, and the
directory is renamed into place only when complete, so a reader sees either no bundle or a whole one
(``tests/test_faults.py`` kills a writer at every step to check). A manifest names no path of the exporting
machine (:func:`portable`: a recipe is ``FILE.py:NAME``) and its graphs carry no debug records
(:func:`fl_server.export.graphs.strip_debug`)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

import fl_server
from edge_sdk.shared import BUNDLE_FORMAT, MANIFEST, json_finite, sha256_file, strict_dumps
from fl_server.atomic import move
from fl_server.export.graphs import OPSET, strip_debug
from fl_server.algorithms import ALGORITHMS
from fl_server.export.steps import StepSpec

if TYPE_CHECKING:
    from fl_server.signing import ManifestSigner

# 1: every graph takes its weights as inputs; 2: frozen graphs may embed them (a graph's "inputs" in the
# manifest list what a device feeds; edge_sdk._steps.graph_feeds picks them, so format-1 bundles still load)
# 3: the manifest names the method's device step (``device_step``), by which the SDK chooses its runner;
# 4: a step graph may refer to the bundle's frozen weights instead of holding them (edge_sdk.shared.FROZEN_LOCATION).
# An SDK refuses a format newer than it reads, with one line saying to upgrade it.
FORMAT_VERSION = BUNDLE_FORMAT
_ONNX_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64",
                onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32"}


def _signature(values: Any) -> list[dict[str, Any]]:
    out = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in t.shape.dim]
        out.append({"name": v.name, "dtype": _ONNX_DTYPES.get(t.elem_type, str(t.elem_type)), "shape": shape})
    return out


def portable(value: Any) -> Any:
    """``value`` (a manifest entry: dicts, lists, scalars) with every string that is an absolute path cut to its
    last part: a recipe's ``/home/alice/proj/my_recipes.py:NAME`` becomes ``my_recipes.py:NAME`` (the file in the
    working or recipe directory that ``fl-server device-data`` loads), so a bundle does not reveal the folders of
    the machine that exported it."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    if isinstance(value, str) and "\n" not in value:
        for flavour in (PurePosixPath, PureWindowsPath):
            if flavour(value).is_absolute():
                return flavour(value).name
    return value


def _fsync_tree(root: Path) -> None:
    """Flush every file of ``root`` and the directory itself, so the rename publishes durable bytes."""
    for path in root.iterdir():
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_bundle(dest: str | os.PathLike) -> None:
    """Clean up after a writer that was killed: drop its staging directory, and if it died between its two
    renames (no bundle at ``dest``), put the previous bundle back. Writers that are still alive are left alone."""
    dest = Path(dest)
    for leftover in sorted(dest.parent.glob(f".{dest.name}.*-*")):
        kind, _, pid = leftover.name[len(dest.name) + 2:].rpartition("-")
        if kind not in ("staging", "old") or not pid.isdigit() or (int(pid) != os.getpid() and _alive(int(pid))):
            continue
        if kind == "old" and not dest.exists():
            move(leftover, dest)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def write_bundle(dest: str | os.PathLike, graphs: dict[str, Path], weights: dict[str, dict[str, np.ndarray]],
                 method: str, hyperparameters: dict[str, Any], extra: dict[str, Any] | None = None,
                 signer: ManifestSigner | None = None) -> Path:
    """Assemble a bundle at ``dest`` from exported graphs (name -> .onnx path) and weight sets
    (name -> {param: array}, saved as ``<name>.npz``); ``signer`` adds ``manifest.sig``. Replaces an
    existing bundle atomically. The manifest's ``device_step`` is the registered method's
    (``Algorithm.device_step_for(hyperparameters)``), by which the SDK chooses how a device personalises."""
    cls = ALGORITHMS.get(method)
    if cls is None:
        raise ValueError(f"unknown method {method!r}: a bundle is of a registered method ({', '.join(ALGORITHMS)})")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    recover_bundle(dest)
    staging = dest.with_name(f".{dest.name}.staging-{os.getpid()}")
    staging.mkdir()
    artifacts = []
    for name, src in graphs.items():
        target = staging / f"{name}.onnx"
        model = onnx.load(str(src), load_external_data=False)
        if strip_debug(model):  # a graph not written by export_function (int8 quantization, a caller's own)
            onnx.save(model, str(target))
        else:
            shutil.copyfile(src, target)
        artifacts.append({"name": name, "kind": "onnx", "file": target.name, "opset": OPSET,
                          "inputs": _signature(model.graph.input), "outputs": _signature(model.graph.output)})
    for name, arrays in weights.items():
        target = staging / f"{name}.npz"
        np.savez(target, **arrays)
        artifacts.append({"name": name, "kind": "weights", "file": target.name,
                          "arrays": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in arrays.items()}})
    for a in artifacts:
        path = staging / a["file"]
        a["sha256"], a["size"] = sha256_file(path), path.stat().st_size
    manifest = {"format": FORMAT_VERSION, "method": method, "device_step": cls.device_step_for(hyperparameters),
                "hyperparameters": hyperparameters,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "versions": {"fl_server": fl_server.__version__, "onnx_opset": OPSET}, "artifacts": artifacts,
                **({"safeguard": cls.safeguard} if cls.safeguard is not None else {}), **(extra or {})}
    # strict JSON: an unbounded hyperparameter (ODPFL-HN's dp_epsilon = inf) is written as null, never Infinity
    (staging / MANIFEST).write_text(strict_dumps(json_finite(portable(manifest)), indent=1, default=str))
    if signer is not None:
        signer.sign_bundle(staging)
    _fsync_tree(staging)
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        move(dest, old)
    move(staging, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def export_specs(specs: dict[str, StepSpec], workdir: Path) -> dict[str, Path]:
    """Export several step specs into ``workdir``; returns name -> path."""
    from fl_server.export import export_spec

    workdir.mkdir(parents=True, exist_ok=True)
    return {name: export_spec(spec, workdir / f"{name}.onnx") for name, spec in specs.items()}
