"""BTFL on the device path, end to end, against the harness: parity and per-sample latency.

Takes a finished ``python -m lab bench btgfl`` training run (its last-round checkpoint, as the benchmark evaluates),
rebuilds the seed's clients and test streams exactly as :mod:`lab.btgfl` does, and for every client
exports its BTFL bundle (:func:`fl_server.export.btfl.export_btfl_client`: the ``features`` graph + the global model's
weights + the client's BTFL state), loads it torch-free (:func:`edge_sdk.load_bundle`) and streams each of
the five test columns one sample at a time, as a phone would:

    onnxruntime features + global logits (batch 1)  ->  local head (numpy)  ->  BTFLStream.predict_one

The device accuracy (mean over clients, per column and the average) is compared with the harness's torch path
(features in torch, ``BTFLStream.predict`` at batch 1): target |diff| <= 0.1 point. Latency per sample of the
whole device pipeline is recorded (p50, p99 over every streamed sample) on one core. Rows merged into
docs/benchmarks/edge-sdk.json by (what, device).

    python benchmarks/btfl_sdk_e2e.py --dataset fashion_mnist --seed 0 --run-dir runs/bench/btgfl/fashion_mnist/seed0
    python benchmarks/btfl_sdk_e2e.py --latency-only     # latency of bundle formats 1 vs 2, no training run

``--latency-only`` also times the features graph's onnxruntime call alone on the same samples (its own pass after
each end-to-end pass): the rest of the per-sample CPU time is the SDK's (local head, ``predict_one``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab import btgfl  # noqa: E402
from lab.experiments import get_experiment  # noqa: E402
from lab.rows import merge_rows  # noqa: E402

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # one core: before numpy / torch are imported

import argparse
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_sdk._btfl import BTFLStream
from edge_sdk import load_bundle
from edge_sdk._steps import graph_feeds
from fl_server.export.btfl import export_btfl_client
from fl_server.algorithms.btfl import BTFL
from fl_server.data import load_dataset
from fl_server.engine.simulation import load_state
from fl_server.models import build_model
from fl_server.signing import ManifestSigner

SIGNER = ManifestSigner.generate()  # signs the bundles this benchmark exports: a device loads only what it verifies


def signed(bundle_dir: Path) -> Path:
    SIGNER.sign_bundle(bundle_dir)
    return bundle_dir


def device_stream(bundle_dir: Path, x: np.ndarray, cpu: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stream ``x`` one sample at a time through the bundle: (predicted classes [N], seconds per sample [N]).
    ``cpu`` [N], when given, receives each sample's CPU seconds of this thread (onnxruntime runs on it with one
    intra-op thread): what a sample costs on a core of its own, whatever else the machine is doing.

    Per sample: the features graph (features + global logits, float32), the local head in float64, then
    ``predict_one``, which takes the float32 rows as they come (it converts them itself, exactly)."""
    bundle = load_bundle(bundle_dir, public_key=SIGNER.public_hex)
    sess = bundle.session("features", threads=1)
    state = bundle.weights("btfl")
    local_head = np.ascontiguousarray(state["local_head"], dtype=np.float64)
    local_bias = state.get("local_bias")  # present when the local head is MAP's (fl_server.algorithms.compose)
    # format 1 feeds the weights too; format 2 (frozen) takes x alone. Built once, x replaced per sample
    feed = graph_feeds(sess, {"x": x[:1], **{f"psi.{n}": v for n, v in bundle.weights("psi").items()}})
    outputs = ["features", "global_logits"]
    stream = BTFLStream.from_arrays(state)
    pred = np.empty(len(x), dtype=np.int64)
    secs = np.empty(len(x))
    for i in range(len(x)):
        c0, t0 = time.thread_time(), time.perf_counter()
        feed["x"] = x[i:i + 1]
        z, g = sess.run(outputs, feed)
        local = local_head @ z[0]  # float64 (z is converted exactly)
        if local_bias is not None:
            local += local_bias
        pred[i] = int(stream.predict_one(local, g[0], z[0]).argmax())
        secs[i] = time.perf_counter() - t0
        if cpu is not None:
            cpu[i] = time.thread_time() - c0
    return pred, secs


def onnxruntime_alone(bundle_dir: Path, x: np.ndarray) -> np.ndarray:
    """CPU seconds per sample [N] of the features graph's call alone (same session options and feed as
    :func:`device_stream`): the part of the pipeline that is onnxruntime's."""
    bundle = load_bundle(bundle_dir, public_key=SIGNER.public_hex)
    sess = bundle.session("features", threads=1)
    feed = graph_feeds(sess, {"x": x[:1], **{f"psi.{n}": v for n, v in bundle.weights("psi").items()}})
    outputs = ["features", "global_logits"]
    cpu = np.empty(len(x))
    for i in range(len(x)):
        c0 = time.thread_time()
        feed["x"] = x[i:i + 1]
        sess.run(outputs, feed)
        cpu[i] = time.thread_time() - c0
    return cpu


def seeded_btfl(dataset_name: str, seed: int, data_dir: str | None) -> tuple[BTFL, dict, Any, Any]:
    """(algorithm, state, client 0's artifacts, dataset): the btgfl protocol's BTFL CNN at its seeded init, client
    0's BTFL state from 512 real training samples (two clients of 256). Latency does not depend on the weights'
    values, so this stands in for a training run wherever only the device path's speed is measured."""
    protocol = get_experiment("btgfl").protocols[dataset_name]
    dataset = load_dataset(protocol.dataset, root=data_dir, split="all")
    model = build_model(protocol.model, dataset.x.shape[1:], dataset.num_classes, seed=seed)
    algorithm = BTFL(model, seed=seed, **protocol.method_hp.get("BTFL", {}))
    x_train, parts = torch.from_numpy(dataset.x[:512]), [np.arange(256), np.arange(256, 512)]
    algorithm.attach(x_train, torch.from_numpy(dataset.y[:512]).long(), parts)
    state = algorithm.init_state(torch.float32, torch.device("cpu"))
    return algorithm, state, algorithm.client_artifacts(state, x_train, parts)[0], dataset


def latency_only(args: argparse.Namespace, command: str) -> None:
    """Per-sample latency of the device pipeline alone (no training run needed: latency does not depend on
    the weights' values): the BTFL CNN at its seeded init, client 0's state from real training samples, one
    bundle whose ``features`` graph takes the weights as inputs (format 1) and one with them embedded
    (format 2), both streamed over the same real test samples in one run, alternating passes."""
    algorithm, state, art, dataset = seeded_btfl(args.dataset, args.seed, args.data_dir)
    x = dataset.x[-args.samples:]
    secs: dict[int, list[np.ndarray]] = {1: [], 2: []}
    cpus: dict[int, list[np.ndarray]] = {1: [], 2: []}
    ort_cpus: dict[int, list[np.ndarray]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {fmt: signed(export_btfl_client(algorithm, state["params"], art, Path(tmp) / f"format{fmt}",
                                               frozen=fmt == 2)) for fmt in (1, 2)}
        preds = {}
        for _ in range(args.repeats):
            for fmt, d in dirs.items():
                cpu = np.empty(len(x))
                preds[fmt], s = device_stream(d, x, cpu)
                secs[fmt].append(s)
                cpus[fmt].append(cpu)
                ort_cpus[fmt].append(onnxruntime_alone(d, x))
    agree = float((preds[1] == preds[2]).mean())
    base = {"benchmark": "edge-sdk", "device": f"cpu:1 thread, {platform.machine()}", "command": command,
            "load_average_1min": round(os.getloadavg()[0], 2), "dataset": args.dataset,
            "samples": int(len(x)) * args.repeats, "weights": "seeded init (latency only)",
            "pipeline": "onnxruntime features+global head, numpy local head, BTFLStream.predict_one"}
    rows = []
    for fmt, how in ((1, "graph weights as inputs (format 1)"), (2, "weights embedded (format 2)")):
        us, cpu_us = 1e6 * np.concatenate(secs[fmt]), 1e6 * np.concatenate(cpus[fmt])
        ort_p50 = float(np.percentile(1e6 * np.concatenate(ort_cpus[fmt]), 50))
        rows.append({**base, "what": f"BTFL end-to-end latency per sample, batch 1, btfl_cnn {args.dataset}, {how}",
                     "metric": "cpu_p50_us", "value": round(float(np.percentile(cpu_us, 50)), 1),
                     "onnxruntime_alone_cpu_p50_us": round(ort_p50, 1),
                     "rest_cpu_p50_us": round(float(np.percentile(cpu_us, 50)) - ort_p50, 1),
                     "wall_p50_us": round(float(np.percentile(us, 50)), 1),
                     "wall_p99_us": round(float(np.percentile(us, 99)), 1),
                     "prediction_agreement_format1_vs_2_pct": round(100 * agree, 3)})
        print(f"{how}: CPU p50 {rows[-1]['value']} us (onnxruntime alone {rows[-1]['onnxruntime_alone_cpu_p50_us']} us), "
              f"wall p50 {rows[-1]['wall_p50_us']} us")
    rows[1]["speedup_p50_vs_format1"] = round(rows[0]["value"] / rows[1]["value"], 2)
    merge_rows(args.out, rows, key=("what", "device"))
    print(f"agreement {100 * agree:.2f}%  speed-up (p50) {rows[1]['speedup_p50_vs_format1']}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="fashion_mnist")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default=None, help="a btgfl training run (checkpoint.npz of the last round)")
    ap.add_argument("--latency-only", action="store_true",
                    help="no training run: device latency of format-1 vs format-2 bundles at the model's init")
    ap.add_argument("--samples", type=int, default=2000, help="--latency-only: test samples streamed per pass")
    ap.add_argument("--repeats", type=int, default=3, help="--latency-only: passes per bundle format")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="docs/benchmarks/edge-sdk.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    command = "python benchmarks/btfl_sdk_e2e.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.latency_only:
        return latency_only(args, command)
    if args.run_dir is None:
        ap.error("--run-dir is required (or --latency-only)")
    protocol = get_experiment("btgfl").protocols[args.dataset]
    dataset = load_dataset(protocol.dataset, root=args.data_dir, split="all")
    data = btgfl.build_data(dataset, protocol, args.seed, btgfl.StreamConfig())
    model = build_model(protocol.model, dataset.x.shape[1:], dataset.num_classes, seed=args.seed)
    hyper = {**protocol.method_hp.get("BTFL", {}),
             "body_iterations": btgfl._body_iterations(protocol.local_iterations)}
    algorithm = BTFL(model, seed=args.seed, **hyper)
    state = load_state(Path(args.run_dir) / "checkpoint.npz")
    state = {k: {n: v.float() for n, v in d.items()} if isinstance(d, dict) else d.float() for k, d in state.items()}
    x_all = torch.from_numpy(dataset.x)
    arts = algorithm.client_artifacts(state, x_all, data.fed.train)
    with torch.no_grad():  # the harness's torch path
        xt = torch.from_numpy(data.x_test)
        z_t = torch.cat([algorithm.features(state["params"], xt[s:s + 4096]) for s in range(0, len(xt), 4096)])
        g_all = algorithm.global_head(state["params"], z_t).double().numpy()
    z_all = z_t.double().numpy()
    acc_torch = {c: [] for c in btgfl.COLUMNS}
    acc_sdk = {c: [] for c in btgfl.COLUMNS}
    agree, secs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k, (art, streams) in enumerate(zip(arts, data.streams)):
            bundle_dir = signed(export_btfl_client(algorithm, state["params"], art, Path(tmp) / f"client{k}"))
            for col, idx in streams.items():
                y = data.y_test[idx]
                ref, _ = btgfl._probs_and_mean_e(art, g_all[idx], z_all[idx] @ art.local_head.T, z_all[idx], 1)
                pred, s = device_stream(bundle_dir, data.x_test[idx])
                acc_torch[col].append(float((ref.argmax(1) == y).mean()))
                acc_sdk[col].append(float((pred == y).mean()))
                agree.append(float((pred == ref.argmax(1)).mean()))
                secs.append(s)
            print(f"client {k}: done", flush=True)
    cols_t = {c: 100 * float(np.mean(v)) for c, v in acc_torch.items()}
    cols_s = {c: 100 * float(np.mean(v)) for c, v in acc_sdk.items()}
    avg_t, avg_s = float(np.mean(list(cols_t.values()))), float(np.mean(list(cols_s.values())))
    us = 1e6 * np.concatenate(secs)
    base = {"benchmark": "edge-sdk", "device": f"cpu:1 thread, {platform.machine()}", "command": command,
            "load_average_1min": round(os.getloadavg()[0], 2), "dataset": args.dataset, "seed": args.seed,
            "clients": len(arts), "samples": int(len(us))}
    rows = [
        {**base, "what": f"BTFL parity SDK vs torch, btgfl {args.dataset} seed {args.seed}",
         "metric": "accuracy_diff_points_sdk_minus_torch", "value": round(avg_s - avg_t, 3),
         "accuracy_torch": round(avg_t, 3), "accuracy_sdk": round(avg_s, 3),
         "columns_torch": {c: round(v, 3) for c, v in cols_t.items()},
         "columns_sdk": {c: round(v, 3) for c, v in cols_s.items()},
         "prediction_agreement_pct": round(100 * float(np.mean(agree)), 3)},
        {**base, "what": f"BTFL end-to-end latency per sample, batch 1, btfl_cnn {args.dataset}",
         "metric": "p50_us", "value": round(float(np.percentile(us, 50)), 1),
         "p99_us": round(float(np.percentile(us, 99)), 1), "mean_us": round(float(us.mean()), 1),
         "pipeline": "onnxruntime features+global head, numpy local head, BTFLStream.predict_one"},
    ]
    merge_rows(args.out, rows, key=("what", "device"))
    print(f"torch {avg_t:.2f}%  sdk {avg_s:.2f}%  diff {avg_s - avg_t:+.3f}  agreement {rows[0]['prediction_agreement_pct']}%")
    print(f"latency per sample: p50 {rows[1]['value']} us  p99 {rows[1]['p99_us']} us  ({len(us)} samples)")


if __name__ == "__main__":
    main()
