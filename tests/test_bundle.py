"""Bundles: written atomically with a verifiable manifest; the SDK refuses anything that does not match."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_sdk._bundle import BundleError, load_bundle
from edge_sdk._steps import StepRunner
from fl_server.export import fedtta_step_spec, forward_spec
from fl_server.export.bundle import export_specs, write_bundle
from fl_server.algorithms import build_algorithm
from fl_server.recipes.presets import FEDTTA_HP
from fl_server.models import build_model


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    alg = build_algorithm("FedTTA", build_model("mlp", (1, 28, 28), 10, seed=0), 1, seed=0,
                          **FEDTTA_HP["mnist"]["FedTTA"])
    st = alg.init_state(torch.float32, torch.device("cpu"))
    tmp = tmp_path_factory.mktemp("b")
    graphs = export_specs({"forward": forward_spec(alg.model, st["params"]),
                           "fedtta_step": fedtta_step_spec(alg, st["params"], st["phi"])}, tmp / "work")
    weights = {k: {n: v.numpy() for n, v in st[k].items()} for k in ("params", "phi")}
    return write_bundle(tmp / "bundle", graphs, weights, "FedTTA", FEDTTA_HP["mnist"]["FedTTA"])


def test_manifest_describes_every_artifact(bundle_dir: Path) -> None:
    b = load_bundle(bundle_dir)
    assert b.method == "FedTTA" and b.hyperparameters["inner_lr"] == 0.5
    step = b.artifact("fedtta_step")
    assert step["opset"] == 18 and step["inputs"][0] == {"name": "x", "dtype": "float32", "shape": ["batch", 1, 28, 28]}
    assert [o["name"] for o in step["outputs"]][-2:] == ["logits", "entropy"]
    assert b.weights("params")["head.weight"].shape == (10, 200)
    assert not any(p.name.startswith(".") for p in bundle_dir.parent.iterdir())  # no staging left behind


def test_bundle_runs_a_step(bundle_dir: Path, mnist_all) -> None:  # type: ignore[no-untyped-def]
    b = load_bundle(bundle_dir)
    runner = StepRunner(b.session("fedtta_step"), fixed=b.weights("phi"))
    new, logits, h = runner.step(mnist_all.x[:32], b.weights("params"))
    assert logits.shape == (32, 10) and np.isfinite(h) and set(new) == set(b.weights("params"))


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_tampered_artifact_is_refused(bundle_dir: Path, tmp_path: Path) -> None:
    bad = _copy(bundle_dir, tmp_path / "bad")
    data = bytearray((bad / "fedtta_step.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "fedtta_step.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256 does not match"):
        load_bundle(bad)


def test_bad_manifests_are_refused(bundle_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="not found"):
        load_bundle(tmp_path)
    trav = _copy(bundle_dir, tmp_path / "trav")
    manifest = json.loads((trav / "manifest.json").read_text())
    manifest["artifacts"][0]["file"] = "../../etc/passwd"
    (trav / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="invalid file name"):
        load_bundle(trav)
    (trav / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="malformed manifest"):
        load_bundle(trav)
    missing = _copy(bundle_dir, tmp_path / "missing")
    (missing / "params.npz").unlink()
    with pytest.raises(BundleError, match="missing"):
        load_bundle(missing)
    with pytest.raises(BundleError, match="no artifact 'nope'"):
        load_bundle(bundle_dir).artifact("nope")


def test_out_of_range_numbers_and_deep_nesting_are_bundle_errors(bundle_dir: Path, tmp_path: Path) -> None:
    """Issue 50, N9: ``1e999`` in a manifest escaped as a raw ValueError and a deeply nested one as a
    RecursionError; both are the SDK's BundleError with one line."""
    bad = _copy(bundle_dir, tmp_path / "bad")
    text = (bundle_dir / "manifest.json").read_text()
    cases = {"1e999": ('{"lr_bound": 1e999, ', "the number 1e999 is out of a float's range"),
             "deep": ('{"nested": ' + "[" * 100_000 + "]" * 100_000 + ", ", "nested too deeply")}
    for prefix, message in cases.values():
        (bad / "manifest.json").write_text(prefix + text.lstrip()[1:])
        with pytest.raises(BundleError, match=f"malformed manifest \\(not strict JSON: {message}\\)$"):
            load_bundle(bad)
