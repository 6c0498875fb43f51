"""Load an artifact bundle on the device: parse ``manifest.json``, verify every file's sha256 and size
before use, load weights without pickle, open ONNX sessions. Nothing unverified is ever executed."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"


class BundleError(ValueError):
    """A bundle is missing, malformed, or does not match its manifest."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Bundle:
    root: Path
    manifest: dict[str, Any]

    @property
    def method(self) -> str:
        return str(self.manifest["method"])

    @property
    def hyperparameters(self) -> dict[str, Any]:
        return dict(self.manifest.get("hyperparameters", {}))

    def artifact(self, name: str) -> dict[str, Any]:
        for a in self.manifest["artifacts"]:
            if a["name"] == name:
                return a
        names = ", ".join(a["name"] for a in self.manifest["artifacts"])
        raise BundleError(f"bundle {self.root} has no artifact {name!r} (it has: {names})")

    def path(self, name: str) -> Path:
        return self.root / self.artifact(name)["file"]

    def weights(self, name: str) -> dict[str, np.ndarray]:
        with np.load(self.path(name), allow_pickle=False) as arrays:
            return {k: arrays[k] for k in arrays.files}

    def session(self, name: str, threads: int | None = None):  # type: ignore[no-untyped-def]
        from edge_sdk.steps import load_session

        if self.artifact(name)["kind"] != "onnx":
            raise BundleError(f"artifact {name!r} is not an ONNX graph")
        return load_session(self.path(name), threads)


def load_bundle(root: str | os.PathLike) -> Bundle:
    """Read and fully verify a bundle directory; raises :class:`BundleError` with one clear line."""
    root = Path(root)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path}: not found (is {root} a bundle directory?)")
    try:
        manifest = json.loads(manifest_path.read_text())
        artifacts = manifest["artifacts"]
        manifest["method"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise BundleError(f"{manifest_path}: malformed manifest ({exc})") from None
    for a in artifacts:
        file = a.get("file", "")
        if not file or Path(file).name != file:  # no paths, no traversal
            raise BundleError(f"{manifest_path}: artifact {a.get('name')!r} has an invalid file name {file!r}")
        path = root / file
        if not path.is_file():
            raise BundleError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != a.get("size"):
            raise BundleError(f"{path}: size {path.stat().st_size} does not match the manifest ({a.get('size')})")
        if sha256_file(path) != a.get("sha256"):
            raise BundleError(f"{path}: sha256 does not match the manifest; refusing to use it")
    return Bundle(root, manifest)
