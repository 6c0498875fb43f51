"""A new client personalises a bundle on the device: edge_sdk + numpy only (no torch, no fl_server).

    fl-server device-data runs/bundle --kind clients --out runs/new-clients.npz      # coordinator side
    python examples/personalize_on_device.py --bundle runs/bundle --data runs/new-clients.npz [--public-key HEX]

The bundle (``fl-server export runs/train --out runs/bundle``) is verified before use: its signature against
``--public-key`` (the coordinator's Ed25519 key; without it only the sha256 of every file is checked).
``--data`` holds the held-out new clients of the bundle's own protocol, written on the coordinator's side with
their labels for scoring; a real device would use its own data. ``edge_sdk.open_bundle`` lets the bundle's
method decide: TENT takes entropy steps, FedTTA one adaptation step, FedTTA++ steps with entropy early
stopping, FedICON contrastive steps (Eq. 7) on two augmented views of each image, a bundle without a device step
(FedAvg) predicts as received. Then the method's safeguard rule (``--safeguard``) keeps the received model where
label-free evidence says adapting hurt; each client's line says what it decided. FedTTA, FedTTA++ and FedICON
declare the rule 'rollback', which keeps the received model on every device: ``--safeguard off`` adapts. BTFL learns its local head from
labels: each client personalises on a random labeled half of its samples and is scored on the other half.
ODPFL-HN's model comes from the coordinator's hypernetwork: use examples/stream_inference.py --server URL.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import edge_sdk
from edge_sdk import BundleError, load_bundle

DECIDED = {"personalised": "personalised", "partial": "kept both models partially",
           "received": "kept the received model"}


def accuracy(logits: np.ndarray, y: np.ndarray) -> float:
    return float((logits.argmax(-1) == y).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True, help="bundle directory (fl-server export --out)")
    ap.add_argument("--data", required=True, help="new clients' samples: fl-server device-data BUNDLE --kind clients")
    ap.add_argument("--public-key", default=None,
                    help="hex Ed25519 key the manifest must be signed with (fl-server serve prints it)")
    ap.add_argument("--show", type=int, default=5, help="print this many clients individually")
    ap.add_argument("--safeguard", choices=("bundle", "off"), default="bundle",
                    help="'bundle': the rule the method declared (in the manifest); 'off': always the adapted model")
    args = ap.parse_args()

    try:
        bundle = load_bundle(args.bundle, public_key=args.public_key)
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    m = bundle.manifest
    print(f"bundle {args.bundle}: {bundle.method} on {m.get('dataset', 'your data')} ({m.get('model', 'your model')}), "
          f"{len(m['artifacts'])} artifacts verified"
          f"{', signature checked' if bundle.signed_by else ' (sha256 only: no --public-key, so not who wrote them)'}")
    with np.load(args.data, allow_pickle=False) as arrays:
        x, y, offsets = arrays["x"], arrays["y"], arrays["offsets"]
    received = edge_sdk.open_bundle(bundle, method="none")
    device = edge_sdk.open_bundle(bundle, safeguard=args.safeguard == "bundle")  # each personalize() starts afresh
    rule = device.safeguard
    if rule is not None and rule.keeps_received:
        print(f"{bundle.method}'s safeguard rule '{rule.name}' keeps the received model on every device: nothing is "
              "adapted (--safeguard off adapts)")
    rng = np.random.default_rng(0)  # BTFL's labeled half: at random (a client's rows may come class by class)
    before, after, ms, decided = [], [], [], {}
    for j in range(len(offsets) - 1):
        rows = np.arange(offsets[j], offsets[j + 1])
        learn = score = rows
        if device.needs_labels:
            if len(rows) < 2:
                continue  # a client of one sample has no half to learn from
            rows = rng.permutation(rows)
            learn, score = rows[:len(rows) // 2], rows[len(rows) // 2:]
        before.append(accuracy(received.predict(x[score]), y[score]))
        t0 = time.perf_counter()
        try:
            result = device.personalize(x[learn], y[learn] if device.needs_labels else None)
        except BundleError as exc:  # ODPFL-HN adapting without a coordinator
            print(f"error: {exc}; this example runs without a coordinator: use examples/stream_inference.py "
                  "--server URL", file=sys.stderr)
            return 2
        ms.append(1e3 * (time.perf_counter() - t0))
        after.append(accuracy(device.predict(x[score]), y[score]))
        action = result.safeguard.action if result.safeguard is not None else "personalised"
        decided[action] = decided.get(action, 0) + 1
        if j < args.show:
            kept = "" if result.safeguard is None else f", {DECIDED[action]}"
            print(f"  new client {j:>2}: {len(score):>4} samples  accuracy {100 * before[-1]:5.1f}% -> "
                  f"{100 * after[-1]:5.1f}%  ({result.steps} step(s){kept}, {ms[-1]:.1f} ms on the device)")
    how = ", ".join(f"{DECIDED[a]} on {n}" for a, n in decided.items()) if rule is not None else "no safeguard"
    scored = " (each learns on a labeled random half, scored on the other half)" if device.needs_labels else ""
    print(f"{len(before)} new clients{scored}: mean accuracy {100 * np.mean(before):.2f}% (received model) -> "
          f"{100 * np.mean(after):.2f}% ({device.method} on onnxruntime; {how}), median {np.median(ms):.1f} ms "
          "per client")
    print(f"torch imported: {'torch' in sys.modules}; fl_server imported: {'fl_server' in sys.modules}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
