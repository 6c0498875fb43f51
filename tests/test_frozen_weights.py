"""A step graph's frozen weights stored once (issue #51): TENT's step on a batch-normalised ConvNet, exported frozen
(the default), refers to the bundle's ``params`` for every weight it never changes (external data at
``FROZEN_LOCATION``, no bytes), so its bundle is no larger than the unfrozen one; the device supplies those arrays to
onnxruntime, which reads no file (a file of that name in the working directory is never opened), and the steps
equal the unfrozen graph's. A reference to a weight the bundle lacks, or of another shape, is refused by the
device and the coordinator's publish check alike, before any session exists."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from edge_sdk import BundleError, load_bundle
from edge_sdk._steps import StepRunner
from edge_sdk.shared import FROZEN_LOCATION
from fl_server.algorithms import build_algorithm
from fl_server.algorithms.tent import norm_affine_names
from fl_server.export import export_spec
from fl_server.export.bundle import export_specs, write_bundle
from fl_server.export.steps import device_specs
from fl_server.functional import make_forward
from fl_server.models import build_model
from fl_server.models.norm import BATCH_NORM_RULE, calibrate, statistics_arrays
from fl_server.service.publish import PublishError, verify_bundle_dir


@pytest.fixture(scope="module")
def bundles(mnist_all, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:  # type: ignore[no-untyped-def]
    """freeze -> a TENT bundle (adapt="norm_affine") of a batch-normalised ConvNet, calibrated on real MNIST."""
    work = tmp_path_factory.mktemp("frozen")
    tent = build_algorithm("TENT", build_model("btfl_cnn_bn", (1, 28, 28), 10, seed=0), 1, seed=0,
                           adapt="norm_affine", tent_lr=1.0)
    state = tent.init_state(torch.float32, torch.device("cpu"))
    forward = make_forward(tent.model)
    calibrate(tent.model, lambda xb: forward(state["params"], xb), [torch.from_numpy(mnist_all.x[:64])])
    weights = {"params": {n: v.detach().numpy() for n, v in state["params"].items()},
               "stats": statistics_arrays(tent.model)}
    graphs = export_specs(device_specs(tent, state), work / "frozen")  # freeze: the default
    full = {**graphs, "tent_step": export_spec(device_specs(tent, state, freeze=False)["tent_step"], work / "full.onnx")}
    return {freeze: write_bundle(work / f"bundle-{freeze}", g, weights, "TENT", {"adapt": "norm_affine"},
                                 extra={"batch_norm": dict(BATCH_NORM_RULE)})
            for freeze, g in ((True, graphs), (False, full))}


def test_frozen_weights_are_stored_once_and_step_as_the_unfrozen_graph(  # type: ignore[no-untyped-def]
        bundles: dict[bool, Path], mnist_all, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lean, full = bundles[True], bundles[False]
    graph = onnx.load(str(lean / "tent_step.onnx"), load_external_data=False).graph
    refs = {t.name: t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    params = load_bundle(lean).weights("params")
    moving = set(norm_affine_names(build_model("btfl_cnn_bn", (1, 28, 28), 10, seed=0)))
    assert set(refs) == {f"psi.{n}" for n in params if n not in moving}  # every frozen weight, by its name
    assert all([(e.key, e.value) for e in t.external_data] == [("location", FROZEN_LOCATION)] and not t.raw_data
               for t in refs.values())
    sizes = {root: sum(f.stat().st_size for f in root.iterdir()) for root in (lean, full)}
    assert sizes[lean] <= 1.01 * sizes[full], sizes  # (inline, the frozen weights were 480 kB more)
    # onnxruntime gets the bundle's arrays: a file named as the location, where it would look, is never read
    monkeypatch.chdir(tmp_path)
    (tmp_path / FROZEN_LOCATION).write_bytes(b"\xff" * 64)
    x = mnist_all.x[:64]
    runners = {}
    for root in (lean, full):
        bundle = load_bundle(root)
        session = bundle.session("tent_step", 1)
        runners[root] = StepRunner(session, stats=bundle.weights("stats"))
    assert load_bundle(lean).frozen["tent_step"] == {n: ("params", n[len("psi."):]) for n in refs}
    assert runners[lean].session.get_session_options().graph_optimization_level == \
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # constants: onnxruntime pre-packs the convolutions
    wa = wb = params
    for _ in range(2):
        wa, la, ha = runners[full].step(x, wa)
        wb, lb, hb = runners[lean].step(x, wb)
        for n in wa:
            np.testing.assert_allclose(wb[n], wa[n], rtol=1e-6, atol=1e-6, err_msg=n)
        np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-6)
        assert abs(ha - hb) <= 1e-6
    assert any(not np.array_equal(wb[n], params[n]) for n in moving)  # the steps moved the scales and shifts


def _edit_reference(bundle: Path, dest: Path, edit: Callable[[onnx.TensorProto], None]) -> Path:
    """A copy of ``bundle`` whose step graph's first frozen weight reference is edited, its manifest consistent."""
    shutil.copytree(bundle, dest)
    model = onnx.load(str(dest / "tent_step.onnx"), load_external_data=False)
    edit(next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL))
    data = model.SerializeToString()
    (dest / "tent_step.onnx").write_bytes(data)
    m = json.loads((dest / "manifest.json").read_text())
    a = next(a for a in m["artifacts"] if a["name"] == "tent_step")
    a["sha256"], a["size"] = hashlib.sha256(data).hexdigest(), len(data)
    (dest / "manifest.json").write_text(json.dumps(m))
    return dest


def _rename(t: onnx.TensorProto) -> None:
    t.name = "psi.not_a_weight"


def _relocate(t: onnx.TensorProto) -> None:
    t.external_data[0].value = "params.npz"  # the bundle's own file, beside the graph


def _reshape(t: onnx.TensorProto) -> None:
    t.dims.append(1)


@pytest.mark.parametrize("edit", [_rename, _relocate, _reshape], ids=["unknown name", "relative location", "shape"])
def test_a_reference_to_no_weight_of_the_bundle_is_refused(bundles: dict[bool, Path], tmp_path: Path,
                                                           edit: Callable[[onnx.TensorProto], None]) -> None:
    bad = _edit_reference(bundles[True], tmp_path / "bad", edit)
    with pytest.raises(BundleError, match="external data") as device:
        load_bundle(bad)  # creates no session: onnxruntime never sees the graph
    assert "\n" not in str(device.value) and "export it again" in str(device.value)
    with pytest.raises(PublishError, match="external data"):
        verify_bundle_dir(bad, 1 << 30)  # the coordinator's publish check
    assert verify_bundle_dir(bundles[True], 1 << 30).frozen  # the bundle as exported publishes
