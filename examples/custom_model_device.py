"""The device of examples/custom_model.py: edge_sdk + numpy only (no torch, no fl_server), raw images in.

    python examples/custom_model_device.py --server URL --public-key HEX --data device.npz --methods TENT FedTTA

For each method: join the coordinator, download the bundle and check its signature against the pinned key
(``edge_sdk.EdgeClient``), ``edge_sdk.open_bundle`` it, personalise on an unlabeled warm-up window of raw uint8
images (the bundle's manifest carries the preprocessing, which the device applies), then stream the remaining
images one at a time. Labels (``y`` in the .npz) only score the predictions.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import edge_sdk


def run(client: edge_sdk.EdgeClient, method: str, x: np.ndarray, y: np.ndarray, warmup: int) -> dict:
    """One method on the device: (accuracy of the received and the personalised model, timings)."""
    info = client.join(method)
    device = edge_sdk.open_bundle(client.download(info.manifest, method=method), client=client)
    received = edge_sdk.open_bundle(device.bundle, method="none")
    t0 = time.perf_counter()
    adapted = device.personalize(x[:warmup])  # raw uint8 NHWC: the manifest's preprocessing is applied here
    personalize_ms = 1e3 * (time.perf_counter() - t0)
    stream, labels = x[warmup:], y[warmup:]
    t0 = time.perf_counter()
    predictions = np.array([int(logits.argmax()) for logits in device.stream(stream)])
    per_image_ms = 1e3 * (time.perf_counter() - t0) / len(stream)
    return {"method": device.method, "bundle_id": info.manifest["bundle_id"], "steps": adapted.steps,
            "safeguard": None if adapted.safeguard is None else adapted.safeguard.message,  # e.g. kept the received
            "preprocess": device.bundle.manifest.get("preprocess"),
            "accuracy_received": round(100 * float((received.predict(stream).argmax(1) == labels).mean()), 2),
            "accuracy_personalized": round(100 * float((predictions == labels).mean()), 2),
            "personalize_ms": round(personalize_ms, 2), "stream_ms_per_image": round(per_image_ms, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True)
    ap.add_argument("--public-key", required=True, help="the coordinator's signing key (hex), pinned")
    ap.add_argument("--data", required=True, help=".npz with raw images x (uint8 NHWC) and labels y")
    ap.add_argument("--methods", nargs="+", default=["TENT", "FedTTA"])
    ap.add_argument("--warmup", type=int, default=64, help="unlabeled images to personalise on")
    ap.add_argument("--cache", default="device-cache")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with np.load(args.data, allow_pickle=False) as arrays:
        x, y = arrays["x"], arrays["y"]
    results = []
    with edge_sdk.EdgeClient(args.server, cache_dir=args.cache, public_key=args.public_key) as client:
        for method in args.methods:
            r = run(client, method, x, y, args.warmup)
            results.append(r)
            print(f"device, {r['method']}: personalised on {args.warmup} raw images in {r['personalize_ms']:.1f} ms "
                  f"({r['steps']} step(s){'' if r['safeguard'] is None else '; ' + r['safeguard']}); streamed "
                  f"{len(x) - args.warmup} raw images at "
                  f"{r['stream_ms_per_image']:.3f} ms each: accuracy {r['accuracy_received']:.1f}% (received) -> "
                  f"{r['accuracy_personalized']:.1f}% (personalised)", flush=True)
    summary = {"results": results, "torch_imported": "torch" in sys.modules,
               "fl_server_imported": "fl_server" in sys.modules}
    print(f"torch imported: {summary['torch_imported']}; fl_server imported: {summary['fl_server_imported']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
