"""The device path against the server path on the new clients of a finished run (issue 7, Table-1 parity).

For each run directory (``fl-server train --out DIR`` or a ``fl-server bench`` run dir: run.json + best.npz) the
run is exported to a bundle (``export_run``); every held-out new client of the run's protocol is personalised
twice on its unlabeled data, by the method's torch code (``Algorithm.personalize``, as in the harness) and by
``edge_sdk.personalize.Personalizer`` on onnxruntime, and scored on its labels. Reports both mean accuracies,
their difference (target |diff| <= 0.1 point) and the per-client agreement of predictions. Rows merged into
docs/benchmarks/edge-sdk.json by (what, device).

    python benchmarks/sdk_table1_parity.py runs/bench/upfl-table1/mnist/FedTTApp/seed0 [RUN_DIR ...]
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from edge_sdk.bundle import load_bundle
from edge_sdk.personalize import Personalizer
from export.run import export_run
from fl_server.algorithms import build_algorithm
from fl_server.bench.rows import merge_rows
from fl_server.data import load_dataset
from fl_server.data.federated import make_federated
from fl_server.engine.simulation import load_state
from fl_server.models import build_model


def measure(run_dir: Path, data_dir: str | None, work: Path, command: str) -> dict:
    run = json.loads((run_dir / "run.json").read_text())
    proto = run["protocol"]
    model = build_model(run["model"], tuple(run["input_shape"]), run["num_classes"], seed=run["seed"])
    algorithm = build_algorithm(run["method"], model, 1, seed=run["seed"], **run["hyper"])
    state = {k: {n: v.float() for n, v in d.items()} for k, d in load_state(run_dir / "best.npz").items()}
    device = Personalizer(load_bundle(export_run(run_dir, work / run_dir.name)))
    ds = load_dataset(run["dataset"], root=data_dir, split="all")
    fed = make_federated(ds, proto["partition"], proto["num_clients"], proto["new_fraction"], proto["val_fraction"],
                         seed=run["seed"], alpha=proto["alpha"])
    acc_torch, acc_sdk, agree = [], [], []
    for idx in fed.new:
        x, y = ds.x[idx], ds.y[idx]
        xt = torch.from_numpy(x)
        with torch.enable_grad():
            params = algorithm.personalize(state, xt)
        with torch.no_grad():
            pred_torch = algorithm.forward(params, xt).argmax(-1).numpy()
        pred_sdk = device.predict(x, device.personalize(x).weights).argmax(-1)
        acc_torch.append(float((pred_torch == y).mean()))
        acc_sdk.append(float((pred_sdk == y).mean()))
        agree.append(float((pred_torch == pred_sdk).mean()))
    t, s = 100 * float(np.mean(acc_torch)), 100 * float(np.mean(acc_sdk))
    return {"benchmark": "edge-sdk", "what": f"new-client parity SDK vs torch, {run['method']} {run['dataset']} seed {run['seed']}",
            "metric": "accuracy_diff_points_sdk_minus_torch", "value": round(s - t, 3),
            "accuracy_torch": round(t, 3), "accuracy_sdk": round(s, 3),
            "prediction_agreement": round(100 * float(np.mean(agree)), 3), "new_clients": len(fed.new),
            "device_kind": device.kind, "run": str(run_dir), "device": "cpu", "torch": torch.__version__,
            "command": command}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="docs/benchmarks/edge-sdk.json")
    args = ap.parse_args()
    command = "python benchmarks/sdk_table1_parity.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(Path(r), args.data_dir, Path(tmp), command) for r in args.runs]
    merge_rows(args.out, rows)
    for r in rows:
        print(f"{r['what']}: torch {r['accuracy_torch']:.2f}%  sdk {r['accuracy_sdk']:.2f}%  "
              f"diff {r['value']:+.3f}  agreement {r['prediction_agreement']:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
