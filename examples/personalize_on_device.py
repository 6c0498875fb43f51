"""A new client personalises a downloaded bundle on the device: onnxruntime + numpy only, no torch.

    python examples/personalize_on_device.py --bundle runs/bundle [--public-key HEX] [--data-dir DIR] [--show 5]

The bundle (``fl-server export runs/train --out runs/bundle``) is verified before use: its signature against
``--public-key`` (the coordinator's Ed25519 key; without it only the sha256 of every file is checked). The example rebuilds the
run's held-out new clients from the bundle's protocol to have real unlabeled data with labels for scoring;
a real device would use its own data. TENT bundles take one entropy step per client (as in training's
evaluation); FedTTA bundles take one adaptation step, FedTTA++ steps with entropy early stopping.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from edge_sdk.bundle import BundleError, load_bundle
from edge_sdk.personalize import Personalizer
from fl_server.data import load_dataset
from fl_server.data.federated import make_federated


def accuracy(logits: np.ndarray, y: np.ndarray) -> float:
    return float((logits.argmax(-1) == y).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True, help="bundle directory (fl-server export --out)")
    ap.add_argument("--public-key", default=None,
                    help="hex Ed25519 key the manifest must be signed with (fl-server serve prints it)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--show", type=int, default=5, help="print this many clients individually")
    args = ap.parse_args()

    try:
        bundle = load_bundle(args.bundle, public_key=args.public_key)
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    m = bundle.manifest
    proto = m.get("federation") or m["protocol"]  # how the training clients were made (older bundles: protocol)
    print(f"bundle {args.bundle}: {bundle.method} on {m['dataset']} ({m['model']}), "
          f"{len(m['artifacts'])} artifacts verified"
          f"{', signature checked' if bundle.signed_by else ''}")
    fed = make_federated(load_dataset(m["dataset"], root=args.data_dir), proto["partition"], proto["num_clients"],
                         proto["new_fraction"], proto["val_fraction"], seed=m["seed"], alpha=proto["alpha"])
    personalizer = Personalizer(bundle)
    before, after, ms = [], [], []
    for j, idx in enumerate(fed.new):
        x, y = fed.dataset.x[idx], fed.dataset.y[idx]
        before.append(accuracy(personalizer.predict(x), y))
        t0 = time.perf_counter()
        result = personalizer.personalize(x)
        ms.append(1e3 * (time.perf_counter() - t0))
        after.append(accuracy(personalizer.predict(x, result.weights), y))
        if j < args.show:
            print(f"  new client {j:>2}: {len(idx):>4} samples  accuracy {100 * before[-1]:5.1f}% -> "
                  f"{100 * after[-1]:5.1f}%  ({result.steps} step(s), {ms[-1]:.1f} ms on the device)")
    print(f"{len(fed.new)} new clients: mean accuracy {100 * np.mean(before):.2f}% (received model) -> "
          f"{100 * np.mean(after):.2f}% ({personalizer.kind} on onnxruntime), median {np.median(ms):.1f} ms per client")
    print(f"torch imported: {'torch' in sys.modules}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
