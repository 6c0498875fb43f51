"""Lean device steps (issue #51): the weights a step never changes are constants of its graph (onnxruntime folds and
pre-packs them) and the device feeds only what the step changes, with the same results as the graph that takes
every weight, and a bundle runs such a graph optimised (in its own node order); the exported normalisation backward
has no ``Pow`` and each zoo model's TENT step stays within a
recorded node count and, run in its own node order (as the SDK runs step graphs), within a recorded peak of
intermediates (device memory, docs/benchmarks/edge-memory.md)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from edge_sdk import load_bundle, open_bundle
from edge_sdk._steps import StepRunner, load_session
from fl_server.export import export_spec, fedtta_step_spec, tent_step_spec
from fl_server.export.rewrites import (cancel_transpose_pairs, constant_transposed_convolutions, held_at_once,
                                      pow_to_mul, recompute_late_reads)
from fl_server.export.bundle import write_bundle
from fl_server.export.steps import device_specs, referenced_values
from fl_server.algorithms import build_algorithm
from fl_server.algorithms.tent import norm_affine_names
from fl_server.functional import make_forward
from fl_server.models import build_model
from fl_server.models.norm import calibrate, stat_norms, statistics_arrays
from fl_server.recipes.presets import FEDTTA_HP

# the TENT step graph a bundle ships, per zoo edge model: nodes at most (measured 74, 348, 773, 972; 2, 2, 50, 48
# Transposes that cancelled in pairs are gone: fl_server.export.rewrites; the batch-normalised models' backward is
# written out (fl_server.models.norm._MixNorm: 892 -> 757 and 1113 -> 943 nodes); the ConvNet, adapting every weight,
# computes each weight gradient one kernel offset at a time (fl_server.export.decompositions: 134 -> 348 nodes, a
# faster step))
NODE_BOUNDS = {"mlp": 78, "convnet": 352, "resnet8_bn": 780, "mobilenet_s": 980}
# ... and the MB its intermediates hold at once in its own node order, batch 64 (rewrites.held_at_once; measured
# 1.6, 38.5, 31.4, 22.0)
HELD_BOUNDS_MB = {"mlp": 2, "convnet": 40, "resnet8_bn": 34, "mobilenet_s": 24}


def _algorithm(method: str, arch: str, x: torch.Tensor, **hp: object):  # type: ignore[no-untyped-def]
    alg = build_algorithm(method, build_model(arch, (1, 28, 28), 10, seed=0), 1, seed=0, **hp)
    state = alg.init_state(torch.float32, torch.device("cpu"))
    if stat_norms(alg.model):
        forward = make_forward(alg.model)
        calibrate(alg.model, lambda xb: forward(state["params"], xb), [x])
    return alg, state


def _steps(full: Path, lean: Path, x: np.ndarray, psi: dict, fixed: dict, stats: dict, frozen: dict) -> None:
    """Two steps on each graph from the same weights: the same updated weights, logits and entropy. ``frozen``:
    the lean graph's frozen weights (it refers to them; a bundle supplies them)."""
    a = StepRunner(load_session(full), fixed=fixed, stats=stats)
    b = StepRunner(load_session(lean, initializers=frozen), fixed=fixed, stats=stats)
    wa, wb = psi, psi
    for _ in range(2):
        wa, la, ha = a.step(x, wa)
        wb, lb, hb = b.step(x, wb)
        assert wa.keys() == wb.keys() == psi.keys()
        for n in wa:
            np.testing.assert_allclose(wb[n], wa[n], rtol=1e-5, atol=1e-6, err_msg=n)
        np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)
        assert abs(ha - hb) <= 1e-5
    assert any(not np.array_equal(wb[n], psi[n]) for n in psi)  # the steps moved something


def test_frozen_weights_are_constants_of_the_step_graph(mnist_all, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x = torch.from_numpy(mnist_all.x[:64])
    tent, state = _algorithm("TENT", "btfl_cnn_bn", x, adapt="norm_affine", tent_lr=1.0)
    lean = device_specs(tent, state, freeze=True)["tent_step"]
    moving = set(norm_affine_names(tent.model))
    assert [n for n in lean.input_names if n.startswith("psi.")] == [f"psi.{n}" for n in state["params"]]
    export_spec(tent_step_spec(tent, state["params"]), tmp_path / "tent_full.onnx")
    export_spec(lean, tmp_path / "tent_lean.onnx")
    graph = onnx.load(str(tmp_path / "tent_lean.onnx"), load_external_data=False).graph
    # the graph takes and returns only the normalisation scale and shift; the rest are initializers
    assert {i.name for i in graph.input if i.name.startswith("psi.")} == {f"psi.{n}" for n in moving}
    assert {o.name for o in graph.output if o.name.startswith("new.")} == {f"new.{n}" for n in moving}
    assert {f"psi.{n}" for n in state["params"]} - {f"psi.{n}" for n in moving} <= {i.name for i in graph.initializer}
    psi = {n: v.numpy() for n, v in state["params"].items()}
    _steps(tmp_path / "tent_full.onnx", tmp_path / "tent_lean.onnx", x.numpy(), psi, {},
           statistics_arrays(tent.model), referenced_values(lean))
    # a bundle's frozen step graph runs optimised (its constant convolutions packed), still in its own order
    bundle = load_bundle(write_bundle(tmp_path / "bundle", {"tent_step": tmp_path / "tent_lean.onnx"},
                                      {"params": psi, "stats": statistics_arrays(tent.model)}, "TENT",
                                      {"adapt": "norm_affine"}))
    assert bundle.holds_model_weights("tent_step")
    options = bundle.session("tent_step", 1).get_session_options()
    assert options.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # TENT adapting every weight has nothing to freeze
    all_tent, all_state = _algorithm("TENT", "mlp", x, lr=0.1)
    assert not device_specs(all_tent, all_state, freeze=True)["tent_step"].referenced

    fedtta, fstate = _algorithm("FedTTA", "mlp", x, **FEDTTA_HP["mnist"]["FedTTA"])
    export_spec(fedtta_step_spec(fedtta, fstate["params"], fstate["phi"]), tmp_path / "fedtta_full.onnx")
    lean_fedtta = device_specs(fedtta, fstate, freeze=True)["fedtta_step"]
    export_spec(lean_fedtta, tmp_path / "fedtta_lean.onnx")
    assert not [i.name for i in onnx.load(str(tmp_path / "fedtta_lean.onnx"), load_external_data=False).graph.input
                if i.name.startswith("phi.")]
    _steps(tmp_path / "fedtta_full.onnx", tmp_path / "fedtta_lean.onnx", x.numpy(),
           {n: v.numpy() for n, v in fstate["params"].items()}, {n: v.numpy() for n, v in fstate["phi"].items()}, {},
           referenced_values(lean_fedtta))


@pytest.mark.parametrize("arch", list(NODE_BOUNDS))
def test_tent_step_graph_is_lean(arch: str, mnist_all, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x = torch.from_numpy(mnist_all.x[:16])
    normalised = bool(norm_affine_names(build_model(arch, (1, 28, 28), 10, seed=0)))
    tent, state = _algorithm("TENT", arch, x, lr=0.1, adapt="norm_affine" if normalised else "all")
    spec = device_specs(tent, state, freeze=True)["tent_step"]
    path = export_spec(spec, tmp_path / "t.onnx")
    model = onnx.load(str(path), load_external_data=False)
    nodes = model.graph.node
    assert not [n for n in nodes if n.op_type == "Pow"]
    assert len(nodes) <= NODE_BOUNDS[arch], f"{arch}: {len(nodes)} nodes, recorded bound {NODE_BOUNDS[arch]}"
    held = held_at_once(model) * 4 / 2**20
    assert held <= HELD_BOUNDS_MB[arch], f"{arch}: {held:.1f} MB held at once, recorded bound {HELD_BOUNDS_MB[arch]}"
    if normalised:  # the SDK's session for a step graph (its own order, unoptimised) computes the default's step
        stats = statistics_arrays(tent.model)
        psi = {n: v.numpy() for n, v in state["params"].items()}
        default, ordered = (StepRunner(load_session(path, 1, in_graph_order=o, initializers=referenced_values(spec)),
                                       stats=stats) for o in (False, True))
        assert ordered.session.get_session_options().execution_order == ort.ExecutionOrder.PRIORITY_BASED
        (wa, la, ha), (wb, lb, hb) = default.step(x.numpy(), psi), ordered.step(x.numpy(), psi)
        for n in wa:
            np.testing.assert_allclose(wb[n], wa[n], rtol=1e-5, atol=1e-6, err_msg=n)
        np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)
        assert abs(ha - hb) <= 1e-5


def test_bundle_runs_step_graphs_in_their_order(mnist_all, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x = torch.from_numpy(mnist_all.x[:16])
    tent, state = _algorithm("TENT", "mlp", x, lr=0.1)
    specs = device_specs(tent, state, freeze=True)
    graphs = {kind: export_spec(specs[kind], tmp_path / f"{kind}.onnx") for kind in ("forward", "tent_step")}
    weights = {k: {n: v.numpy() for n, v in d.items()} for k, d in state.items()}
    device = open_bundle(write_bundle(tmp_path / "bundle", graphs, weights, "TENT", {"lr": 0.1}))
    step, forward = device.runner.step.session.get_session_options(), device.runner.forward.get_session_options()
    assert step.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert step.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # weights fed, none constant
    assert not device.bundle.holds_model_weights("tent_step")
    assert forward.execution_order == ort.ExecutionOrder.DEFAULT  # other graphs: onnxruntime's optimisations
    assert forward.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    before = device.predict(x.numpy())
    assert device.personalize(x.numpy()).steps == 1
    assert not np.array_equal(device.predict(x.numpy()), before)


def test_recompute_late_reads_is_bit_identical_and_frees_earlier() -> None:
    # d = x - mean(x) is read at once (d * d) and again after a chain that holds three x-sized tensors, while x is
    # read there too: recomputing d before the late read frees it during the chain
    shape = [8, 4, 16, 16]
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
             helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["dd"]),
             helper.make_node("ReduceSum", ["dd"], ["var"], keepdims=0),
             helper.make_node("Abs", ["x"], ["t0"]),
             helper.make_node("Neg", ["t0"], ["t1"])]
    nodes += [helper.make_node("Add", [f"t{k - 1}", f"t{k - 2}"], [f"t{k}"]) for k in range(2, 26)]
    nodes += [helper.make_node("Add", ["t25", "x"], ["z"]),
              helper.make_node("Mul", ["d", "z"], ["w"]),
              helper.make_node("ReduceSum", ["w"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in ("var", "y")],
                              [numpy_helper.from_array(np.array([0, 2, 3], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    run = lambda: load_session(model.SerializeToString(), 1, in_graph_order=True).run(None, {"x": x})  # noqa: E731
    before, held = run(), held_at_once(model)
    assert recompute_late_reads(model) == 1
    assert [n.op_type for n in model.graph.node].count("Sub") == 2
    # through the chain d is no longer held, its per-channel mean m (read by the copy) is
    assert held_at_once(model) == held - int(np.prod(shape)) + shape[1]
    for a, b in zip(run(), before):
        np.testing.assert_array_equal(a, b)


def test_pow_to_mul_is_bit_identical() -> None:
    x = (np.random.default_rng(0).standard_normal(100_000) * 10).astype(np.float32)
    for power in (1.0, 2.0, 3.0, 0.5):
        graph = helper.make_graph(
            [helper.make_node("Pow", ["x", "e"], ["p"]), helper.make_node("Neg", ["p"], ["y"])], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
            [numpy_helper.from_array(np.array(power, np.float32), "e")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        run = lambda: ort.InferenceSession(model.SerializeToString(),  # noqa: E731
                                           providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        before = run()
        assert pow_to_mul(model) == (power != 0.5)  # x^0.5 is left to Pow
        assert [n.op_type for n in model.graph.node].count("Pow") == (power == 0.5)
        np.testing.assert_array_equal(run(), before)


def test_cancel_transpose_pairs_is_bit_identical() -> None:
    # x -> T[1,0] -> T[1,0] is x (cancelled); x3 -> T[0,2,1] -> T[1,0,2] is not the identity (kept)
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0]),
             helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0]),
             helper.make_node("Neg", ["b"], ["y"]),
             helper.make_node("Transpose", ["x3"], ["c"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["c"], ["d"], perm=[1, 0, 2]),
             helper.make_node("Neg", ["d"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5]),
                                           helper.make_tensor_value_info("x3", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 4, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 5)).astype(np.float32), "x3": rng.standard_normal((2, 3, 4)).astype(np.float32)}
    run = lambda: load_session(model.SerializeToString(), 1).run(None, feeds)  # noqa: E731
    before = run()
    assert cancel_transpose_pairs(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Neg", "Transpose", "Transpose", "Neg"]
    for a, b in zip(run(), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("c,c_out,groups,kernel,pads,dilation", [
    (6, 4, 1, 3, 1, 1), (8, 8, 8, 3, 1, 1), (6, 4, 1, 1, 0, 1), (6, 6, 2, 5, 2, 2), (6, 4, 1, 3, 0, 1)])
def test_constant_transposed_convolutions_compute_the_same(c, c_out, groups, kernel, pads, dilation) -> None:  # type: ignore[no-untyped-def]
    # a stride-1 ConvTranspose on a constant kernel becomes a Conv on the kernel transposed and reversed (folded by
    # onnxruntime); the strided one stays
    rng = np.random.default_rng(0)
    w = rng.standard_normal((c, c_out // groups, kernel, kernel)).astype(np.float32)
    nodes = [helper.make_node("ConvTranspose", ["g", "w"], ["y"], group=groups, pads=[pads] * 4,
                              dilations=[dilation] * 2, strides=[1, 1], kernel_shape=[kernel] * 2),
             helper.make_node("ConvTranspose", ["g", "w"], ["y2"], group=groups, strides=[2, 2], kernel_shape=[kernel] * 2)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("g", TensorProto.FLOAT, [None, c, 9, 9])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "y2")],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    feeds = {"g": rng.standard_normal((3, c, 9, 9)).astype(np.float32)}
    run = lambda: load_session(model.SerializeToString(), 1).run(None, feeds)  # noqa: E731
    before = run()
    assert constant_transposed_convolutions(model) == 1
    assert [n.op_type for n in model.graph.node].count("ConvTranspose") == 1
    for a, b in zip(run(), before):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
