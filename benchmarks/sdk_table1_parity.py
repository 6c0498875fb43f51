"""The device path against the server path on the new clients of a finished run (Table-1 parity).

For each run directory (``fl-server train --out DIR`` or a ``python -m lab bench`` run dir: run.json + best.npz) the
run is exported to a bundle (``export_run``); every held-out new client of the run's protocol is personalised
twice on its unlabeled data, by the method's torch code (``Algorithm.personalize``, as in the harness) and by
``edge_sdk.open_bundle`` on onnxruntime without the safeguard (``safeguard=False``: this compares the method's step;
the safeguard's decision on top is held to training's figure by tests/test_conformance.py), and scored on its
labels. Reports both mean accuracies,
their difference (target |diff| <= 0.1 point) and the per-client agreement of predictions. Rows merged into
docs/benchmarks/edge-sdk.json by (what, device).

    python benchmarks/sdk_table1_parity.py runs/bench/upfl-table1/mnist/FedTTApp/seed0 [RUN_DIR ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from edge_sdk import open_bundle
from fl_server.export.run import export_run
from fl_server.engine.simulation import load_state
from fl_server.recipes.run import rebuild
from fl_server.rundir import rounds_done
from fl_server.signing import ManifestSigner
from run_dirs import measure_runs, run_clients


def measure(run_dir: Path, data_dir: str | None, work: Path, command: str) -> dict:
    run, fed = run_clients(run_dir, data_dir)
    ds = fed.dataset
    _, _, algorithm = rebuild(run, data_dir)  # the run's own model and method (zoo or a recipe file)
    state = {k: {n: v.float() for n, v in d.items()} for k, d in load_state(run_dir / "best.npz").items()
             if isinstance(d, dict)}  # sub-states (FedICON's scalar round counter is not one)
    signer = ManifestSigner.generate()  # a device loads only what it verifies
    device = open_bundle(export_run(run_dir, work / run_dir.name, signer=signer), public_key=signer.public_hex,
                         safeguard=False)  # the method's step, as Algorithm.personalize computes it
    acc_torch, acc_sdk, agree = [], [], []
    for idx in tqdm(fed.new, desc=f"{run_dir.name}: new clients", unit="client"):
        x, y = ds.x[idx], ds.y[idx]
        xt = torch.from_numpy(x)
        with torch.enable_grad():
            params = algorithm.personalize(state, xt)
        with torch.no_grad():
            pred_torch = algorithm.forward(params, xt).argmax(-1).numpy()
        device.personalize(x)
        pred_sdk = device.predict(x).argmax(-1)
        acc_torch.append(float((pred_torch == y).mean()))
        acc_sdk.append(float((pred_sdk == y).mean()))
        agree.append(float((pred_torch == pred_sdk).mean()))
    t, s = 100 * float(np.mean(acc_torch)), 100 * float(np.mean(acc_sdk))
    return {"benchmark": "edge-sdk", "what": f"new-client parity SDK vs torch, {run['method']} {run['dataset']} seed {run['seed']}",
            "metric": "accuracy_diff_points_sdk_minus_torch", "value": round(s - t, 3),
            "accuracy_torch": round(t, 3), "accuracy_sdk": round(s, 3),
            "prediction_agreement": round(100 * float(np.mean(agree)), 3), "new_clients": len(fed.new),
            "protocol_rounds": rounds_done(run_dir),  # the run's own (a --rounds run is shorter than its recipe)
            "device_kind": device.bundle.device_step or "none", "run": str(run_dir), "device": "cpu", "torch": torch.__version__,
            "command": command, "trained_by": run.get("command", "not recorded")}


def main() -> int:
    return measure_runs(__doc__, "sdk_table1_parity.py", measure, lambda r: (
        f"torch {r['accuracy_torch']:.2f}%  sdk {r['accuracy_sdk']:.2f}%  diff {r['value']:+.3f}  "
        f"agreement {r['prediction_agreement']:.2f}%"))


if __name__ == "__main__":
    sys.exit(main())
