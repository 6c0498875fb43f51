"""Can int8 bring BTFL's features graph under the device budget? The BTFL CNN's frozen ``features`` graph (bundle
format 2, what ``benchmarks/btfl_sdk_e2e.py --latency-only`` streams) against int8 versions of it, at batch 1 on one
onnxruntime thread, in one run:

- ``fp32``: the graph as exported (weights as initializers);
- ``int8``: onnxruntime's static quantization (QOperator: QLinearConv / QGemm, uint8 activations, int8 weights,
  ranges calibrated on 512 training images; never the timed test images);
- ``int8, conv1 in fp32``: the same with the 1-channel first convolution left in float32;
- ``identity``: a graph that copies its input, the fixed cost of a ``run`` call from Python;
- ``openvino f32`` / ``openvino bf16``: the fp32 graph on OpenVINO's CPU plugin (oneDNN kernels; bf16 on AMX
  where the CPU has it), one thread, latency hint, when ``openvino`` is installed (it is no dependency of the SDK).

Per variant: CPU p50 microseconds per sample (passes interleaved), outputs against fp32 (max abs feature
difference, global-head argmax agreement), and the top kernels of onnxruntime's profiler (which slows every
kernel: compare shares, not sums). The second convolution's rate in fp32 (6.55 MFLOP per sample) says how close
the float path is to what one core can do.

    python lab/research/probe_btfl_int8.py [--samples 2000] [--passes 3] [--data-dir DIR] [--out FILE]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from btfl_sdk_e2e import seeded_btfl  # noqa: E402
from fl_server.export.btfl import export_btfl_client  # noqa: E402

CONV2_MFLOP = 2 * 8 * 8 * 64 * 32 * 5 * 5 / 1e6  # 64 outputs of 8x8 from 32 channels, 5x5 kernels


def session(path: Path, profile: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if profile:
        so.enable_profiling, so.profile_file_prefix = True, profile
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


Runner = Callable[[np.ndarray], list[np.ndarray]]  # x [N, 1, 28, 28] -> (features, global logits)


def onnxruntime_runner(sess: ort.InferenceSession) -> Runner:
    name, outs = sess.get_inputs()[0].name, [o.name for o in sess.get_outputs()]
    return lambda x: sess.run(outs, {name: x})


def openvino_runners(path: Path) -> dict[str, Runner]:
    """OpenVINO's CPU plugin on the fp32 graph, batch 1, one thread (empty without ``openvino``)."""
    try:
        import openvino as ov
    except ImportError:
        return {}
    core, runners = ov.Core(), {}
    for precision in ("f32", "bf16"):
        model = core.read_model(str(path))
        model.reshape({"x": [1, 1, 28, 28]})
        compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1,
                                                     "PERFORMANCE_HINT": "LATENCY",
                                                     "INFERENCE_PRECISION_HINT": precision})
        request = compiled.create_infer_request()
        runners[f"openvino {precision} ({ov.__version__.split('-')[0]})"] = (
            lambda x, r=request: [np.copy(o) for o in r.infer({0: x}, share_inputs=True).values()])
    return runners


def cpu_us_per_sample(run: Runner, x: np.ndarray) -> np.ndarray:
    cpu = np.empty(len(x))
    for i in range(len(x)):
        c0 = time.thread_time()
        run(x[i:i + 1])
        cpu[i] = time.thread_time() - c0
    return 1e6 * cpu


def top_kernels(path: Path, x: np.ndarray, tmp: Path, top: int = 6) -> list[tuple[str, str, float]]:
    """(node, op, median us under the profiler) of the slowest kernels of a batch-1 run."""
    sess = session(path, str(tmp / "prof"))
    name = sess.get_inputs()[0].name
    for i in range(min(len(x), 1000)):
        sess.run(None, {name: x[i:i + 1]})
    events = json.loads(Path(sess.end_profiling()).read_text())
    times: dict[tuple[str, str], list[int]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            times[(e["name"].removesuffix("_kernel_time"), e["args"].get("op_name", ""))].append(e["dur"])
    rows = sorted(((n, op, float(np.median(d))) for (n, op), d in times.items()), key=lambda r: -r[2])
    return rows[:top]


def identity_graph(dest: Path) -> Path:
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, 1, 28, 28]) for n in ("x", "y")]
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "id", io[:1], io[1:]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(dest))
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2000, help="test images streamed per pass")
    ap.add_argument("--passes", type=int, default=3, help="interleaved passes per variant")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="docs/research/btfl-int8-probe.txt")
    args = ap.parse_args()
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType, quant_pre_process,
                                          quantize_static)

    torch.set_num_threads(1)
    algorithm, state, art, dataset = seeded_btfl("fashion_mnist", 0, args.data_dir)  # the graph --latency-only streams
    x = np.ascontiguousarray(dataset.x[-args.samples:], dtype=np.float32)

    class Calibration(CalibrationDataReader):  # 512 training images in batches of 64
        def __init__(self) -> None:
            self.batches = iter({"x": dataset.x[i:i + 64].astype(np.float32)} for i in range(0, 512, 64))

        def get_next(self) -> dict | None:
            return next(self.batches, None)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        fp32 = export_btfl_client(algorithm, state["params"], art, tmp / "bundle", frozen=True) / "features.onnx"
        pre = tmp / "pre.onnx"
        quant_pre_process(str(fp32), str(pre))
        conv1 = next(n.name for n in onnx.load(str(pre)).graph.node if n.op_type == "Conv")
        paths = {"fp32": fp32, "int8": tmp / "int8.onnx", "int8, conv1 in fp32": tmp / "int8_conv1_fp32.onnx",
                 "identity": identity_graph(tmp / "identity.onnx")}
        for key, exclude in (("int8", []), ("int8, conv1 in fp32", [conv1])):
            quantize_static(str(pre), str(paths[key]), Calibration(), quant_format=QuantFormat.QOperator,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, nodes_to_exclude=exclude)
        runners = {k: onnxruntime_runner(session(p)) for k, p in paths.items()}
        cpu: dict[str, list[np.ndarray]] = {k: [] for k in runners}
        for _ in range(args.passes):
            for k, run in runners.items():
                cpu[k].append(cpu_us_per_sample(run, x))
        # OpenVINO after the onnxruntime passes, beside an fp32 control: its runtime's worker threads stay
        # resident once loaded and may share the core with whatever runs next
        later = openvino_runners(fp32)
        if later:
            later = {"fp32, again after OpenVINO loaded": runners["fp32"], **later}
            cpu |= {k: [] for k in later}
            for _ in range(args.passes):
                for k, run in later.items():
                    cpu[k].append(cpu_us_per_sample(run, x))
            runners |= later
        compared = x[:200]
        ref = [runners["fp32"](compared[i:i + 1]) for i in range(len(compared))]
        lines = [f"# {Path(__file__).name}: BTFL CNN features graph at batch 1, one onnxruntime thread "
                 f"(onnxruntime {ort.__version__}, {platform.machine()}, load {os.getloadavg()[0]:.2f}), "
                 f"{args.samples} Fashion-MNIST test images x {args.passes} interleaved passes", "",
                 "| variant | CPU p50 us | vs fp32 | max abs feature diff (feature scale) | global argmax agreement |",
                 "|---|---|---|---|---|"]
        p50 = {k: float(np.percentile(np.concatenate(v), 50)) for k, v in cpu.items()}
        for k, run in runners.items():
            if k == "identity":
                diff = "-"
                agree = "-"
            else:
                out = [run(compared[i:i + 1]) for i in range(len(compared))]
                feats = [(np.abs(o[0] - r[0]).max(), np.abs(r[0]).max()) for o, r in zip(out, ref)]
                diff = f"{max(f[0] for f in feats):.2e} ({max(f[1] for f in feats):.2e})"
                agree = f"{100 * np.mean([o[1].argmax() == r[1].argmax() for o, r in zip(out, ref)]):.1f}%"
            lines.append(f"| {k} | {p50[k]:.1f} | {p50['fp32'] / p50[k]:.2f}x | {diff} | {agree} |")
        lines += ["", f"Outputs compared on the first {len(compared)} images, one at a time."]
        for k in ("fp32", "int8", "int8, conv1 in fp32"):
            lines += ["", f"Top kernels under the profiler, {k}:", ""]
            for node, op, us in top_kernels(paths[k], x, tmp):
                rate = f" ({CONV2_MFLOP / us * 1e3:.0f} GFLOP/s)" if k == "fp32" and op == "Conv" and us > 20 else ""
                lines.append(f"- {op} `{node}`: {us:.0f} us{rate}")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
