"""Device adaptation step on onnxruntime against the torch eager step, one CPU core, same run.

For the MLP 2x200 and the ConvNet: FedTTA's adaptation step (UPFL Eq. 5), TENT's entropy step and FedICON's
test-time step (Eq. 7 on two augmented views of each image, the projection included) on a batch of real MNIST
images; also the plain forward. Median over repeats after warm-up, the ORT and torch calls
alternating. Rows merged into docs/benchmarks/edge-sdk.json by (what, device).

The ConvNet's steps are convolution-bound: its second convolution (32 -> 64 channels, 5x5, on 14x14) runs four
times in a step (forward with the received weights, input gradient, weight gradient, forward with the updated
weights). Three more rows time that convolution's three kernels alone, as the step graphs run them on
onnxruntime (the forward Conv; the input and weight gradients as :mod:`export.decompositions` lowers them) against
torch's own kernels (``aten.convolution`` / ``aten.convolution_backward``), with the rate each reaches
(``gflops_*``: 2 * multiply-adds / time).

    python benchmarks/edge_step_speed.py [--batch 64] [--repeats 50] [--data-dir DIR]
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.rows import merge_rows  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from edge_sdk._steps import load_session  # noqa: E402
from timing import interleaved_median_ms  # noqa: E402
from export import export_function, export_spec, fedtta_step_spec, forward_spec, tent_step_spec  # noqa: E402
from export.fedicon import fedicon_tta_step_spec  # noqa: E402
from export.decompositions import convolution_backward  # noqa: E402
from fl_server.algorithms import build_algorithm  # noqa: E402
from fl_server.recipes.presets import FEDTTA_HP  # noqa: E402
from fl_server.data import load_dataset  # noqa: E402
from fl_server.models import build_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="docs/benchmarks/edge-sdk.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ds = load_dataset("mnist", root=args.data_dir, split="test")
    x = torch.from_numpy(ds.x[: args.batch])
    command = "python benchmarks/edge_step_speed.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in ("mlp", "convnet"):
            fedtta = build_algorithm("FedTTA", build_model(model_name, (1, 28, 28), 10, seed=0), 1,
                                     **FEDTTA_HP["mnist"]["FedTTA"])
            tent = build_algorithm("TENT", build_model(model_name, (1, 28, 28), 10, seed=0), 1, lr=0.1)
            icon = build_algorithm("FedICON", build_model(model_name, (1, 28, 28), 10, seed=0), 1)
            st = fedtta.init_state(torch.float32, torch.device("cpu"))
            proj = icon.init_state(torch.float32, torch.device("cpu"))["proj"]
            specs = {"forward": forward_spec(fedtta.model, st["params"]),
                     "FedTTA step": fedtta_step_spec(fedtta, st["params"], st["phi"]),
                     "TENT step": tent_step_spec(tent, st["params"]),
                     # its example uniforms u are made for the batch timed here
                     "FedICON step": fedicon_tta_step_spec(icon, st["params"], proj, batch=args.batch)}
            for label, spec in specs.items():
                path = export_spec(spec, Path(tmp) / f"{model_name}-{label.replace(' ', '_')}.onnx")
                session = load_session(path, threads=1)
                feeds = dict(zip(spec.input_names, [x.numpy(), *(w.detach().numpy() for w in spec.example[1:])]))
                # alternating calls: load on a shared machine hits both alike
                ms = interleaved_median_ms({"ort": lambda: session.run(None, feeds),
                                            "torch": lambda: spec.fn(x, *spec.example[1:])}, args.repeats)
                ort_ms, torch_ms = ms["ort"], ms["torch"]
                row = {"benchmark": "edge-sdk", "what": f"{label}, {model_name}, batch {args.batch}",
                       "metric": "speedup_ort_vs_torch", "value": round(torch_ms / ort_ms, 2),
                       "ort_ms": round(ort_ms, 3), "torch_eager_ms": round(torch_ms, 3),
                       "device": "cpu:1 thread", "torch": torch.__version__, "onnxruntime": ort.__version__,
                       "load_average_1min": round(os.getloadavg()[0], 2), "command": command}
                print(json.dumps(row))
                rows.append(row)
        rows += conv_kernel_rows(args.batch, args.repeats, Path(tmp), command)
    merge_rows(args.out, rows)
    for r in rows:
        print(f"{r['what']:<34} ORT {r['ort_ms']:>8.3f} ms   torch {r['torch_eager_ms']:>8.3f} ms   x{r['value']}")
    return 0


def conv_kernel_rows(batch: int, repeats: int, tmp: Path, command: str) -> list[dict]:
    """The ConvNet's second convolution's forward, input-gradient and weight-gradient kernels, ORT vs torch."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(batch, 32, 14, 14, generator=g), torch.randn(64, 32, 5, 5, generator=g)
    gy = torch.randn(batch, 64, 14, 14, generator=g)
    conv = [[1, 1], [2, 2], [1, 1], False, [0, 0], 1]  # stride, padding, dilation, transposed, output padding, groups

    def backward(mask: list[bool]):  # type: ignore[no-untyped-def]
        return lambda x, w, gy: tuple(t for t in convolution_backward(gy, x, w, None, *conv, mask) if t is not None)

    kernels = {  # name: (function of (x, w, gy) traced for ORT, torch's own kernel)
        "forward": (lambda x, w, gy: (torch.nn.functional.conv2d(x, w, padding=2),),
                    lambda: torch.ops.aten.convolution(x, w, None, *conv)),
        "input gradient": (backward([True, False, False]),
                           lambda: torch.ops.aten.convolution_backward(gy, x, w, None, *conv, [True, False, False])),
        "weight gradient": (backward([False, True, False]),
                            lambda: torch.ops.aten.convolution_backward(gy, x, w, None, *conv, [False, True, False])),
    }
    flop = 2 * batch * 64 * 14 * 14 * 32 * 5 * 5
    rows = []
    for label, (fn, eager) in kernels.items():
        path = export_function(fn, [x, w, gy], ["x", "w", "gy"], ["out"], ["x", "gy"],
                               tmp / f"conv-{label.replace(' ', '_')}.onnx")
        session = load_session(path, threads=1)
        feeds = {i.name: {"x": x, "w": w, "gy": gy}[i.name].numpy() for i in session.get_inputs()}
        ms = interleaved_median_ms({"ort": lambda: session.run(None, feeds), "torch": eager}, repeats)
        row = {"benchmark": "edge-sdk", "what": f"convnet conv2 {label} kernel, batch {batch}",
               "metric": "speedup_ort_vs_torch", "value": round(ms["torch"] / ms["ort"], 2),
               "ort_ms": round(ms["ort"], 3), "torch_eager_ms": round(ms["torch"], 3),
               "gflops_ort": round(flop / ms["ort"] / 1e6, 1), "gflops_torch": round(flop / ms["torch"] / 1e6, 1),
               "device": "cpu:1 thread", "torch": torch.__version__, "onnxruntime": ort.__version__,
               "load_average_1min": round(os.getloadavg()[0], 2), "command": command}
        print(json.dumps(row))
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
