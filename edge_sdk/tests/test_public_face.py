"""The SDK's face: ``open_bundle -> Device`` is the one way in, the registry is the only dispatch, and a runner a
user registers for a new device step kind is what a bundle naming that kind runs (torch-free, real bundles)."""
from __future__ import annotations

import ast
import importlib
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edge_sdk
from edge_sdk._registry import RUNNERS

PUBLIC = {"Adaptation", "Bundle", "BundleError", "BundleExpiredError", "BundleRollbackError", "BundleSignatureError",
          "Device", "EdgeClient", "EdgeClientError", "EntropyEarlyStopping", "ModelRunner", "Preprocess", "Runner",
          "InputScaleWarning", "StaleReleaseWarning", "StepRunner", "TrustOnFirstUseWarning", "UnverifiedSignatureWarning", "__version__", "entropy",
          "load_bundle", "log_softmax", "open_bundle", "register_runner", "safeguard", "shared", "signing", "softmax"}
PUBLIC_MODULES = ["edge_sdk", "edge_sdk.safeguard", "edge_sdk.shared", "edge_sdk.signing"]
REMOVED = ["Personalizer", "personalize", "DeviceModel", "BTFLDevice", "fedthe_predict"]
# every method a bundle can name (fl_server.algorithms.ALGORITHMS, checked in tests/test_edge_sdk.py) and FedTHE
METHODS = ["FedAvg", "FedProx", "FedAvg+FT", "Local", "TENT", "FedTTA", "FedTTA-Prox", "FedTTA++", "ODPFL-HN", "BTFL",
           "FedICON", "MAP", "FedRS", "FedPHP", "FedTHE"]
ARTIFACTS = ["forward", "forward_int8", "params", "stats", "phi", "enc", "proj", "btfl", "features", "encoder",
             "tent_step", "fedtta_step", "fedicon_step"]
PACKAGE = Path(edge_sdk.__file__).parent
DISPATCH = [PACKAGE / "_device.py", PACKAGE / "_registry.py"]


def test_the_public_face_is_exactly_this() -> None:
    assert set(edge_sdk.__all__) == PUBLIC
    for name in edge_sdk.__all__:
        getattr(edge_sdk, name)
    public_files = {p.stem for p in PACKAGE.glob("*.py") if not p.name.startswith("_")}
    assert {f"edge_sdk.{m}" for m in public_files} == set(PUBLIC_MODULES[1:])  # everything else is private


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_no_public_module_exposes_a_removed_entry_point(module: str) -> None:
    mod = importlib.import_module(module)
    assert not [n for n in REMOVED if hasattr(mod, n)]


@pytest.mark.parametrize("gone", ["personalize", "btfl_device", "btfl", "fedthe", "device", "steps"])
def test_the_old_module_paths_are_gone(gone: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"edge_sdk.{gone}")


def _code_strings(path: Path) -> list[str]:
    """String constants of a module's code (docstrings left out), f-string parts included."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


@pytest.mark.parametrize("path", DISPATCH, ids=lambda p: p.name)
def test_the_dispatch_names_no_method_and_no_artifact(path: Path) -> None:
    """Device and the registry choose a runner from the manifest's device_step alone: no method name, no artifact
    name in their code."""
    strings = _code_strings(path)
    assert strings  # the scan sees the module's code
    found = [(s, w) for s in strings for w in METHODS + ARTIFACTS if w in s.replace("'", " ").replace('"', " ").split()
             or s == w]
    assert not found, found


@pytest.fixture()
def new_kind_bundle(sdk_fixture: Path, tmp_path: Path) -> Path:
    """The fixture's TENT bundle whose manifest names a device step this SDK does not know (unsigned copy)."""
    root = Path(shutil.copytree(sdk_fixture / "tent", tmp_path / "custom"))
    (root / "manifest.sig").unlink()
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["device_step"] = "test_custom_step"
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def _open(root: Path, **options: Any) -> edge_sdk.Device:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", edge_sdk.UnverifiedSignatureWarning)
        return edge_sdk.open_bundle(root, **options)


def test_a_registered_runner_serves_a_bundle_of_its_kind(sdk_fixture: Path, new_kind_bundle: Path) -> None:
    with np.load(sdk_fixture / "reference.npz", allow_pickle=False) as ref:
        x = ref["x"][:16]
    with pytest.raises(edge_sdk.BundleError, match=r"no runner for the device step 'test_custom_step'.*"
                                                   r"register_runner\('test_custom_step'\)"):
        _open(new_kind_bundle)
    try:
        @edge_sdk.register_runner("test_custom_step")
        class Sharpened(edge_sdk.ModelRunner):
            """The received model with its logits doubled; personalising counts the samples it saw."""

            def adapt(self, x: np.ndarray, **options: Any) -> tuple[dict[str, np.ndarray], int, dict[str, Any]]:
                return self.base, 1, {"seen": len(x)}

            def predict(self, x: np.ndarray) -> np.ndarray:
                return 2.0 * self.logits(x, self.weights)

        device = _open(new_kind_bundle)
        assert isinstance(device.runner, Sharpened) and device.method == "TENT" and not device.needs_labels
        received = _open(new_kind_bundle, method="none")  # the received model: the "none" runner
        assert type(received.runner) is edge_sdk.ModelRunner
        np.testing.assert_allclose(device.predict(x), 2.0 * received.predict(x), rtol=1e-6)
        result = device.personalize(x)
        assert (result.method, result.steps, result.samples, result.details) == ("TENT", 1, 16, {"seen": 16})
        with pytest.raises(ValueError, match="already has the runner .*Sharpened; pass replace=True"):
            edge_sdk.register_runner("test_custom_step")(type("Other", (edge_sdk.ModelRunner,), {}))

        @edge_sdk.register_runner("test_custom_step", variant="Plain")
        class Plain(edge_sdk.ModelRunner):
            pass

        assert isinstance(_open(new_kind_bundle, method="Plain").runner, Plain)
        with pytest.raises(edge_sdk.BundleError, match="cannot run FedTTA: open it with method= one of None "
                                                       r"\(TENT\), 'none', 'Plain'"):
            _open(new_kind_bundle, method="FedTTA")
        edge_sdk.register_runner("test_custom_step", replace=True)(edge_sdk.ModelRunner)
        assert type(_open(new_kind_bundle).runner) is edge_sdk.ModelRunner
    finally:
        RUNNERS.pop(("test_custom_step", None), None)
        RUNNERS.pop(("test_custom_step", "Plain"), None)


def test_a_bundle_format_newer_than_the_sdk_says_to_upgrade(sdk_fixture: Path, tmp_path: Path) -> None:
    """A bundle written by a newer exporter is refused with one line naming the upgrade, not with whatever its new
    contents would trip over; the fixture's own format loads."""
    root = Path(shutil.copytree(sdk_fixture / "tent", tmp_path / "newer"))
    (root / "manifest.sig").unlink()
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["format"] <= edge_sdk.shared.BUNDLE_FORMAT
    _open(root)  # unsigned copy of a bundle of this SDK's format
    manifest["format"] = edge_sdk.shared.BUNDLE_FORMAT + 1
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(edge_sdk.BundleError, match=rf"bundle format {edge_sdk.shared.BUNDLE_FORMAT + 1} is newer "
                                                   rf"than this SDK reads \(up to {edge_sdk.shared.BUNDLE_FORMAT}\): "
                                                   r"upgrade fl-edge-sdk"):
        _open(root)
