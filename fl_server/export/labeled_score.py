"""What a device of a method that personalises on its own labels (``Algorithm.device_labels``: BTFL) gets from a bundle,
which training cannot score (it holds no device's labels out; its record's ``test_of`` is ``"received"``). Each of
the run's held-out new clients (:func:`fl_server.device_samples.client_samples`) personalises on the first half of
its samples with their labels, as a device does with a labeled warm-up window, and predicts the other half as a
stream; the received model predicts the same half. Both run in the torch-free SDK on the bundle, with the bundle's
training-time DLE (a device with no coordinator to exchange DLEs with; a coordinator's aggregate weighs the uploads
at most a few percent against it). ``fl-server export`` prints it for such a bundle.

    >>> labeled_score("runs/btfl-bundle")["line"]  # doctest: +SKIP
    'BTFL on a device: personalised on the labeled first half of each new client's samples, 71.3% on the other half ...'
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk import UnverifiedSignatureWarning, load_bundle, open_bundle
from fl_server.device_samples import client_samples


def labeled_score(bundle_dir: str | Path, data_dir: str | None = None) -> dict[str, Any]:
    """``personalised`` and ``received`` (means over new clients of the accuracy on the second half of each
    client's samples, fractions), ``clients`` and ``line`` (one line for a person)."""
    with warnings.catch_warnings():  # the exporter's own bundle, just written
        warnings.simplefilter("ignore", UnverifiedSignatureWarning)
        bundle = load_bundle(bundle_dir)
    samples = client_samples(bundle.manifest, data_dir)
    x, y, offsets = samples["x"], samples["y"], samples["offsets"]
    received = open_bundle(bundle, method="none")
    personalised, kept = [], []
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        half = lo + (hi - lo) // 2
        if half == lo or half == hi:
            continue  # a client of one sample has no half to learn from
        device = open_bundle(bundle)  # a fresh device per client: its own local head and stream
        device.personalize(x[lo:half], y[lo:half])
        personalised.append(float((device.predict(x[half:hi]).argmax(1) == y[half:hi]).mean()))
        kept.append(float((received.predict(x[half:hi]).argmax(1) == y[half:hi]).mean()))
    if not personalised:
        raise ValueError("no new client has two samples or more to split")
    out = {"personalised": float(np.mean(personalised)), "received": float(np.mean(kept)), "clients": len(kept)}
    out["line"] = (f"{bundle.method} on a device: personalised on the labeled first half of each new client's "
                   f"samples, {100 * out['personalised']:.2f}% on the other half ({100 * out['received']:.2f}% with "
                   f"the received model; {len(kept)} new clients, the bundle's training DLE)")
    return out
