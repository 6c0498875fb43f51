"""Device adaptation step on onnxruntime against the torch eager step, one CPU core, same run.

For the MLP 2x200 and the ConvNet: FedTTA's adaptation step (UPFL Eq. 5) and TENT's entropy step on a batch
of real MNIST images; also the plain forward. Median over repeats after warm-up, the ORT and torch calls
alternating. Rows merged into docs/benchmarks/edge-sdk.json by (what, device).

    python benchmarks/edge_step_speed.py [--batch 64] [--repeats 50] [--data-dir DIR]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from edge_sdk.steps import load_session  # noqa: E402
from timing import interleaved_median_ms  # noqa: E402
from export import export_spec, fedtta_step_spec, forward_spec, tent_step_spec  # noqa: E402
from fl_server.algorithms import build_algorithm  # noqa: E402
from fl_server.recipes.presets import FEDTTA_HP  # noqa: E402
from fl_server.bench.rows import merge_rows  # noqa: E402
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
            st = fedtta.init_state(torch.float32, torch.device("cpu"))
            specs = {"forward": forward_spec(fedtta.model, st["params"]),
                     "FedTTA step": fedtta_step_spec(fedtta, st["params"], st["phi"]),
                     "TENT step": tent_step_spec(tent, st["params"])}
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
    merge_rows(args.out, rows)
    for r in rows:
        print(f"{r['what']:<34} ORT {r['ort_ms']:>8.3f} ms   torch {r['torch_eager_ms']:>8.3f} ms   x{r['value']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
