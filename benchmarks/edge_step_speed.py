"""Device adaptation step on onnxruntime against the torch eager step, one CPU core, same run; the device's peak memory.

For every edge model of the zoo (``--models``: the MLP 2x200, the ConvNet, resnet8_bn, mobilenet_s): FedTTA's
adaptation step (UPFL Eq. 5) and TENT's entropy step as a bundle ships them (:func:`fl_server.export.steps.device_specs`: the
weights a step never changes -- FedTTA's adaptation model, all but the normalisation scale and shift under TENT's
``adapt="norm_affine"``, which the batch-normalised models use -- are constants of the graph), on a batch of real
MNIST images; also the plain forward and, for the MLP and the ConvNet, FedICON's test-time step (Eq. 7 on two
augmented views of each image, the projection included). The torch side is the method's own step (the
batch-normalised models in torch's batch-statistics BatchNorm, as the engine trains and adapts at this batch), the
updated model's logits and entropy included; a step graph runs in the session the SDK opens for its bundle
(``Bundle.session``: in its node order, optimised where it holds model weights as constants), called as the device
calls it (``open_bundle(...).runner.step.step``: input checks and statistics feeds included; a step between others,
as in a multi-step adaptation -- the last step also gives onnxruntime's arena back). Median over repeats
after warm-up, the ORT and torch calls alternating. ``peak_rss_mb``: the peak resident memory (``ru_maxrss``) of a fresh torch-free process that opens
the method's bundle with the SDK and personalises on the batch (one subprocess per model and method). Rows merged
into docs/benchmarks/edge-sdk.json by (what, device). ``--memory-only``: export the step bundles and measure only
their peak memory (no timing); it updates the ``nodes``, ``bundle_bytes`` and ``peak_rss_mb`` of the step rows in
place (with ``memory_command`` and ``memory_load_average_1min``), their timings left as they were.

The ConvNet's steps are convolution-bound: its second convolution (32 -> 64 channels, 5x5, on 14x14) runs four
times in a step (forward with the received weights, input gradient, weight gradient, forward with the updated
weights). Three more rows time that convolution's three kernels alone, as the step graphs run them on
onnxruntime (the forward Conv; the input and weight gradients as :mod:`fl_server.export.decompositions` lowers them) against
torch's own kernels (``aten.convolution`` / ``aten.convolution_backward``), with the rate each reaches
(``gflops_*``: 2 * multiply-adds / time).

    python benchmarks/edge_step_speed.py [--batch 64] [--repeats 50] [--models mlp,convnet,...] [--data-dir DIR]
                                         [--memory-only]
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
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from edge_sdk import open_bundle  # noqa: E402
from edge_sdk._steps import load_session  # noqa: E402
from timing import interleaved_median_ms  # noqa: E402
from fl_server.export import export_function, export_spec  # noqa: E402
from fl_server.export.bundle import write_bundle  # noqa: E402
from fl_server.export.steps import device_specs  # noqa: E402
from fl_server.export.fedicon import fedicon_tta_step_spec  # noqa: E402
from fl_server.export.decompositions import convolution_backward  # noqa: E402
from fl_server.algorithms import build_algorithm  # noqa: E402
from fl_server.algorithms.losses import entropy_from_logits  # noqa: E402
from fl_server.algorithms.tent import norm_affine_names  # noqa: E402
from fl_server.functional import make_forward  # noqa: E402
from fl_server.recipes.presets import FEDTTA_HP  # noqa: E402
from fl_server.data import load_dataset  # noqa: E402
from fl_server.models import build_model  # noqa: E402
from fl_server.models.norm import BATCH_NORM_RULE, calibrate, norm_mode, stat_norms, statistics_arrays  # noqa: E402


MODELS = ("mlp", "convnet", "resnet8_bn", "mobilenet_s")
# run in a fresh interpreter (no torch): open a bundle, personalise on the saved batch, print the peak RSS in MB
DEVICE_PROCESS = """
import resource, sys
import numpy as np
from edge_sdk import open_bundle
device = open_bundle(sys.argv[1], safeguard=False)  # the steps themselves (a rollback rule would skip them)
steps = len(device.personalize(np.load(sys.argv[2])).details["entropy_history"]) - 1  # the steps it ran
assert "torch" not in sys.modules
print(steps, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo models")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="docs/benchmarks/edge-sdk.json")
    ap.add_argument("--memory-only", action="store_true", help="only the step bundles' peak memory (no timing)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ds = load_dataset("mnist", root=args.data_dir, split="test")
    x = torch.from_numpy(ds.x[: args.batch])
    command = "python benchmarks/edge_step_speed.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    common = {"device": "cpu:1 thread", "torch": torch.__version__, "onnxruntime": ort.__version__, "command": command}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "x.npy", x.numpy())
        if args.memory_only:
            for model_name in args.models.split(","):
                for label, extra in memory_rows(model_name, x, Path(tmp)):
                    row = {"what": f"{label}, {model_name}, batch {args.batch}", "device": common["device"], **extra,
                           "memory_command": command, "memory_load_average_1min": round(os.getloadavg()[0], 2)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            merge_memory_rows(args.out, rows)
            return 0
        for model_name in args.models.split(","):
            for label, ort_ms, torch_ms, extra in model_rows(model_name, x, args.repeats, Path(tmp)):
                row = {"benchmark": "edge-sdk", "what": f"{label}, {model_name}, batch {args.batch}",
                       "metric": "speedup_ort_vs_torch", "value": round(torch_ms / ort_ms, 2),
                       "ort_ms": round(ort_ms, 3), "torch_eager_ms": round(torch_ms, 3), **extra, **common,
                       "load_average_1min": round(os.getloadavg()[0], 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
        if "convnet" in args.models.split(","):
            rows += conv_kernel_rows(args.batch, args.repeats, Path(tmp), command)
    merge_rows(args.out, rows)
    for r in rows:
        rss = f"   peak RSS {r['peak_rss_mb']:>6.1f} MB" if "peak_rss_mb" in r else ""
        print(f"{r['what']:<40} ORT {r['ort_ms']:>8.3f} ms   torch {r['torch_eager_ms']:>8.3f} ms   x{r['value']}{rss}")
    return 0


def model_rows(model_name: str, x: torch.Tensor, repeats: int, tmp: Path) -> Iterator[tuple[str, float, float, dict]]:
    """(label, ORT ms, torch ms, extra fields) of the forward, FedTTA's and TENT's steps (FedICON's on models
    without normalisation layers) of ``model_name``; ``repeats=0``: the steps' extra fields only, not timed."""
    normalised = bool(norm_affine_names(build_model(model_name, (1, 28, 28), 10, seed=0)))
    fedtta_hp, tent_hp = dict(FEDTTA_HP["mnist"]["FedTTA"]), {"lr": 0.1, "adapt": "norm_affine" if normalised else "all"}
    state = build_algorithm("FedTTA", build_model(model_name, (1, 28, 28), 10, seed=0), 1,
                            **fedtta_hp).init_state(torch.float32, torch.device("cpu"))

    def build(method: str, **hp: Any) -> Any:
        algorithm = build_algorithm(method, build_model(model_name, (1, 28, 28), 10, seed=0), 1, **hp)
        if stat_norms(algorithm.model):  # the population statistics a bundle ships, from this batch
            forward = make_forward(algorithm.model)
            calibrate(algorithm.model, lambda xb: forward(state["params"], xb), [x])
        return algorithm

    fedtta, tent = build("FedTTA", **fedtta_hp), build("TENT", **tent_hp)
    steps = {"FedTTA step": (fedtta, "fedtta_step", fedtta_hp, lambda: fedtta.adapt_step(state["params"], state["phi"], x)),
             "TENT step": (tent, "tent_step", tent_hp, lambda: tent.entropy_step(state["params"], x))}
    if not repeats:  # memory only: FedTTA++'s personalisation (its step graph is FedTTA's) holds several iterates
        fedttapp_hp = dict(FEDTTA_HP["mnist"]["FedTTA++"])
        steps["FedTTA++ personalisation"] = (build("FedTTA++", **fedttapp_hp), "fedtta_step", fedttapp_hp, None)
    weights = {k: {n: v.detach().numpy() for n, v in d.items()} for k, d in state.items()}
    specs = device_specs(fedtta, state, freeze=True)
    graphs = {"forward": export_spec(specs["forward"], tmp / f"{model_name}-forward.onnx")}
    forward = specs["forward"]
    if repeats:
        yield ("forward", *ort_vs_torch(load_session(graphs["forward"], threads=1), forward, x,
                                          lambda: forward.fn(x, *forward.example[1:]), repeats), {})
    for label, (algorithm, kind, hp, torch_step) in steps.items():
        spec = device_specs(algorithm, state, freeze=True)[kind]
        graphs[kind] = export_spec(spec, tmp / f"{model_name}-{kind}.onnx")

        def eager(algorithm: Any = algorithm, torch_step: Any = torch_step) -> float:  # + the updated model's output
            with norm_mode(algorithm.model, "batch"):
                return entropy_from_logits(algorithm.forward(torch_step(), x)).mean()

        bundle = write_bundle(tmp / f"{model_name}-{algorithm.name}-{kind}", {"forward": graphs["forward"], kind: graphs[kind]},
                              {**weights, **({"stats": statistics_arrays(algorithm.model)} if stat_norms(algorithm.model) else {})},
                              algorithm.name, hp, extra={"batch_norm": dict(BATCH_NORM_RULE)} if stat_norms(algorithm.model) else None)
        nodes = len(onnx.load(str(graphs[kind]), load_external_data=False).graph.node)  # (frozen weights: no data)
        device_steps, peak = peak_rss_mb(bundle, tmp / "x.npy")
        extra = {"nodes": nodes, "bundle_bytes": tree_bytes(bundle), "peak_rss_mb": peak,
                 **({"device_steps": device_steps} if torch_step is None else {})}
        if not repeats:
            yield (label, 0.0, 0.0, extra)
            continue
        # the step as the device runs it: the runner open_bundle builds, its StepRunner.step (input checks, the
        # bundle's statistics feeds) on the received weights
        runner, x_np = open_bundle(bundle, threads=1).runner, x.numpy()
        ms = interleaved_median_ms({"ort": lambda: runner.step.step(x_np, runner.base), "torch": eager}, repeats)
        yield (label, ms["ort"], ms["torch"], extra)
    if repeats and not normalised:
        icon = build("FedICON")
        proj = icon.init_state(torch.float32, torch.device("cpu"))["proj"]
        spec = fedicon_tta_step_spec(icon, state["params"], proj, batch=len(x))  # its uniforms u: for this batch
        path = export_spec(spec, tmp / f"{model_name}-fedicon.onnx")
        yield ("FedICON step", *ort_vs_torch(load_session(path, threads=1), spec, x,
                                               lambda: spec.fn(x, *spec.example[1:]), repeats), {})


def memory_rows(model_name: str, x: torch.Tensor, tmp: Path) -> Iterator[tuple[str, dict]]:
    """(label, {nodes, bundle_bytes, peak_rss_mb}) of FedTTA's and TENT's step bundles of ``model_name``, and of
    FedTTA++'s personalisation (entropy early stopping: several steps, ``device_steps``, keeping the best iterate;
    a row of its own, metric ``peak_rss_mb``)."""
    for label, _, _, extra in model_rows(model_name, x, 0, tmp):
        yield label, ({"metric": "peak_rss_mb", "value": extra["peak_rss_mb"], **extra}
                      if "device_steps" in extra else extra)


def merge_memory_rows(path: str, rows: list[dict]) -> None:
    """Update the memory fields of the rows of ``path`` with the same (what, device) in place, their timings and
    the file's order kept; rows it lacks are appended."""
    old = json.loads(Path(path).read_text()) if Path(path).exists() else []
    new = {(r["what"], r["device"]): r for r in rows}
    kept = [{**r, **new.pop((r.get("what"), r.get("device")), {})} for r in old]
    merge_rows(path, kept + [{"benchmark": "edge-sdk", **r} for r in new.values()])  # every row: the order stays


def ort_vs_torch(session: ort.InferenceSession, spec: Any, x: torch.Tensor, eager: Callable[[], object],
                 repeats: int) -> tuple[float, float]:
    """Median ms of the graph of ``session`` (one thread) and of ``eager()``, calls alternating (load on a shared
    machine hits both alike)."""
    values = dict(zip(spec.input_names, [x.numpy(), *(w.detach().numpy() for w in spec.example[1:])]))
    feeds = {i.name: values[i.name] for i in session.get_inputs()}
    ms = interleaved_median_ms({"ort": lambda: session.run(None, feeds), "torch": eager}, repeats)
    return ms["ort"], ms["torch"]


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def peak_rss_mb(bundle: Path, x: Path) -> tuple[int, float]:
    """(steps taken, peak RSS in MB) of a fresh torch-free process that opens ``bundle`` and personalises on the
    batch saved at ``x``."""
    # started by a shell that forks it: Linux keeps ru_maxrss across exec, so a process forked from this one (torch
    # loaded, several hundred MB) would report this one's size ("; exit" keeps the shell from exec-ing it)
    out = subprocess.run(["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-c", DEVICE_PROCESS, str(bundle),
                          str(x)], check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    steps, peak = out.stdout.split()[-2:]
    return int(steps), round(float(peak), 1)


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
