"""What the int8 graph costs a device: the received model's new-client accuracy with ``forward_int8`` against the
float32 ``forward``, both run by the torch-free SDK on the bundle itself, over the run's held-out new clients
(:func:`fl_server.device_samples.client_samples`). ``fl-server export --int8`` prints it, so that the accuracy of
``open_bundle(..., int8=True)`` is known before a device runs it.

    >>> int8_cost("runs/bundle")["line"]  # doctest: +SKIP
    'int8: the received model's new-client accuracy 91.02% with forward_int8, 91.10% in float32 ...'
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk import UnverifiedSignatureWarning, load_bundle, open_bundle
from fl_server.device_samples import client_samples

INT8_COST = 0.01  # an int8 graph that costs the new clients more than a point is pointed out


def int8_cost(bundle_dir: str | Path, data_dir: str | None = None) -> dict[str, Any]:
    """``float32`` and ``int8`` (the mean over new clients of the received model's accuracy, fractions),
    ``agreement`` (the share of new-client samples both graphs predict alike) and ``line`` (one line for a person,
    a ``note:`` when int8 costs more than a point, :data:`INT8_COST`)."""
    with warnings.catch_warnings():  # the exporter's own bundle, just written
        warnings.simplefilter("ignore", UnverifiedSignatureWarning)
        bundle = load_bundle(bundle_dir)
    samples = client_samples(bundle.manifest, data_dir)
    x, y, offsets = samples["x"], samples["y"], samples["offsets"]
    fp32 = open_bundle(bundle, method="none").predict(x).argmax(1)
    int8 = open_bundle(bundle, method="none", int8=True).predict(x).argmax(1)
    sizes = np.diff(offsets)

    def accuracy(pred: np.ndarray) -> float:  # mean over clients, as training reports it
        return float(np.mean(np.add.reduceat((pred == y).astype(np.float64), offsets[:-1]) / sizes))

    out = {"float32": accuracy(fp32), "int8": accuracy(int8), "agreement": float(np.mean(fp32 == int8))}
    costly = out["float32"] - out["int8"] > INT8_COST + 1e-9
    out["line"] = (f"{'note: ' if costly else ''}int8: the received model's new-client accuracy "
                   f"{100 * out['int8']:.2f}% with forward_int8, {100 * out['float32']:.2f}% in float32 "
                   f"({100 * out['agreement']:.1f}% of predictions agree); a device runs it with "
                   f"open_bundle(..., int8=True)")
    return out
