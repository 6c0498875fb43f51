"""int8 dynamic quantization of a trained model's frozen forward path: size, accuracy change, latency.

For each finished run directory (``fl-server train --out DIR``: run.json + best.npz), the received model's
forward graph is exported, frozen (weights as initializers) and quantized to int8 (fl_server/export/quantize.py). Both are
scored on the run's own new clients (the held-out clients of its protocol, received model without
personalisation; each client's samples one batch, as its device predicts them) and timed at batch 64 on one
onnxruntime thread, in the same run. Rows merged into
docs/benchmarks/edge-sdk.json by (what, device).

    python benchmarks/int8_frozen.py runs/int8/mnist-fedavg [RUN_DIR ...] [--data-dir DIR]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from edge_sdk._steps import load_session
from fl_server.export import export_spec, forward_spec
from fl_server.export.quantize import freeze_weights, quantize_int8
from fl_server.engine.simulation import load_state
from fl_server.models import build_model
from run_dirs import measure_runs, run_clients
from timing import median_ms


def client_accuracy(session, x: np.ndarray, y: np.ndarray, clients: list[np.ndarray]) -> float:  # type: ignore[no-untyped-def]
    """Mean over clients of the accuracy on the client's data (the UPFL new-client metric), each client's samples
    one batch, as its device predicts them (the int8 graph scales a batch's activations by the batch's range)."""
    return 100 * float(np.mean([(session.run(["logits"], {"x": x[idx]})[0].argmax(-1) == y[idx]).mean()
                                for idx in clients]))


def checkpoint_rounds(run_dir: Path) -> dict:
    """Rounds trained so far and the round of best.npz (a run may be measured before it finished): best.npz is
    written whenever validation improves, so it is the best-val row of metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    best = max(rows, key=lambda r: r["val"])
    return {"rounds_done": len(rows), "best_round": best["round"], "test_at_best_round_torch": round(100 * best["test"], 2)}


def measure(run_dir: Path, data_dir: str | None, work: Path, command: str) -> dict:
    run, fed = run_clients(run_dir, data_dir)
    ds = fed.dataset
    model = build_model(run["model"], tuple(run["input_shape"]), run["num_classes"], seed=run["seed"])
    params = {n: v.float() for n, v in load_state(run_dir / "best.npz")["params"].items()}
    graph = export_spec(forward_spec(model, params), work / f"{run_dir.name}.onnx")
    fp32 = freeze_weights(graph, {n: v.numpy() for n, v in params.items()}, work / f"{run_dir.name}.fp32.onnx")
    int8 = quantize_int8(fp32, work / f"{run_dir.name}.int8.onnx")
    idx = np.concatenate(fed.new)
    local = [np.arange(s, s + len(c)) for s, c in zip(np.cumsum([0] + [len(c) for c in fed.new[:-1]]), fed.new)]
    sessions = {k: load_session(p, threads=1) for k, p in (("fp32", fp32), ("int8", int8))}
    acc = {k: client_accuracy(s, ds.x[idx], ds.y[idx], local) for k, s in sessions.items()}
    batch = ds.x[idx[:64]]
    ms = {k: median_ms(lambda s=s: s.run(["logits"], {"x": batch}), 30) for k, s in sessions.items()}
    return {"benchmark": "edge-sdk", "what": f"int8 forward, {run['model']}, {run['dataset']} {run['method']} run",
            "metric": "accuracy_change_points", "value": round(acc["int8"] - acc["fp32"], 2),
            "accuracy_fp32": round(acc["fp32"], 2), "accuracy_int8": round(acc["int8"], 2),
            "evaluated_on": f"{len(fed.new)} new clients of the run's protocol, received model (no personalisation)",
            "bytes_fp32": fp32.stat().st_size, "bytes_int8": int8.stat().st_size,
            "ms_fp32_batch64": round(ms["fp32"], 3), "ms_int8_batch64": round(ms["int8"], 3),
            "device": "cpu:1 thread", "run": str(run_dir), **checkpoint_rounds(run_dir),
            "torch": torch.__version__, "command": command, "trained_by": run.get("command", "not recorded")}


def main() -> int:
    torch.set_num_threads(1)
    return measure_runs(__doc__, "int8_frozen.py", measure, lambda r: (
        f"{r['accuracy_fp32']:.2f}% -> {r['accuracy_int8']:.2f}% (int8), "
        f"{r['bytes_fp32'] / 1e6:.2f} MB -> {r['bytes_int8'] / 1e6:.2f} MB, "
        f"{r['ms_fp32_batch64']:.2f} -> {r['ms_int8_batch64']:.2f} ms per batch of 64"))


if __name__ == "__main__":
    sys.exit(main())
