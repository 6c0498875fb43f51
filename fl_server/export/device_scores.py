"""What a device gets from a bundle where training cannot score it, measured at export by the torch-free SDK on the
bundle itself over the run's held-out new clients (:func:`fl_server.device_samples.client_samples`).
``fl-server export`` prints these lines (:func:`export_scores`):

* :func:`labeled_score`: a method whose devices personalise on their own labels (``Algorithm.device_labels``: BTFL).
  Training holds no device's labels out, so its record scores the received model (``test_of`` ``"received"``).
  Each new client personalises on a random half of its samples with their labels (:func:`labeled_halves`), as a
  device does with a labeled warm-up window, and predicts the other half as a stream; the received model predicts
  the same half. The DLE is the bundle's training-time one (a device with no coordinator to exchange DLEs with; a
  coordinator's aggregate weighs the uploads at most a few percent against it).
* :func:`int8_cost`: the received model's new-client accuracy with ``forward_int8`` against the float32
  ``forward`` (``--int8``), so that the accuracy of ``open_bundle(..., int8=True)`` is known before a device runs it.
  ``forward_int8`` scales a batch's activations by the batch's own range, so a sample's int8 prediction can change
  with the batch it comes in: each client predicts its own samples as one batch, as its device does; a device
  that predicts one sample at a time can get a few predictions otherwise.

    >>> int8_cost(own_bundle("runs/bundle"))["line"]  # doctest: +SKIP
    'int8: the received model's new-client accuracy 91.02% with forward_int8, 91.10% in float32 ...'
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk import Bundle, UnverifiedSignatureWarning, load_bundle, open_bundle
from fl_server.device_samples import client_samples
from fl_server.recipes import Recipe, RecipeError

INT8_COST = 0.01  # an int8 graph that costs the new clients more than a point is pointed out


def own_bundle(bundle_dir: str | Path, public_key: str | None = None) -> Bundle:
    """The exporter's own bundle, just written: verified against ``public_key`` when it signed it, else loaded
    without the unsigned-bundle warning (which is for a device that receives a bundle, not for its exporter)."""
    if public_key is not None:
        return load_bundle(bundle_dir, public_key=public_key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedSignatureWarning)
        return load_bundle(bundle_dir)


def _accuracy(pred: np.ndarray, y: np.ndarray, offsets: np.ndarray) -> float:
    """The mean over clients of each client's accuracy, as training reports it."""
    hits = np.add.reduceat((pred == y).astype(np.float64), offsets[:-1])
    return float(np.mean(hits / np.diff(offsets)))


def int8_cost(bundle: Bundle, data_dir: str | None = None) -> dict[str, Any]:
    """``float32`` and ``int8`` (the mean over new clients of the received model's accuracy, fractions),
    ``agreement`` (the share of new-client samples both graphs predict alike) and ``line`` (one line for a person,
    a ``note:`` when int8 costs more than a point, :data:`INT8_COST`)."""
    samples = client_samples(bundle.manifest, data_dir)
    x, y, offsets = samples["x"], samples["y"], samples["offsets"]
    fp32 = open_bundle(bundle, method="none").predict(x).argmax(1)
    # forward_int8 quantizes a batch's activations with that batch's own scale (dynamic quantization), so its
    # predictions depend on the batch: each client predicts its own samples, as its device does
    device = open_bundle(bundle, method="none", int8=True)
    int8 = np.concatenate([device.predict(x[lo:hi]).argmax(1) for lo, hi in zip(offsets[:-1], offsets[1:])])
    out: dict[str, Any] = {"float32": _accuracy(fp32, y, offsets), "int8": _accuracy(int8, y, offsets),
                           "agreement": float(np.mean(fp32 == int8))}
    costly = out["float32"] - out["int8"] > INT8_COST + 1e-9
    out["line"] = (f"{'note: ' if costly else ''}int8: the received model's new-client accuracy "
                   f"{100 * out['int8']:.2f}% with forward_int8 (each client's samples as one batch), "
                   f"{100 * out['float32']:.2f}% in float32 "
                   f"({100 * out['agreement']:.1f}% of predictions agree); a device runs it with "
                   f"open_bundle(..., int8=True)")
    return out


def labeled_halves(offsets: np.ndarray, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per client of ``offsets`` (client k holds rows ``offsets[k]:offsets[k + 1]``) with two samples or more: (the
    rows it personalises on, the rows it is scored on), a random half each, drawn in client order from one
    ``np.random.default_rng(seed)``. Random, not the first half: a client's rows keep the data set's order, which
    for an image folder (read class by class) or a partition's sorted indices groups them by class, and a first half
    would learn classes the second half never shows."""
    rng = np.random.default_rng(seed)
    halves = []
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        if hi - lo < 2:
            continue  # a client of one sample has no half to learn from
        rows = lo + rng.permutation(hi - lo)
        halves.append((rows[:(hi - lo) // 2], rows[(hi - lo) // 2:]))
    return halves


def labeled_score(bundle: Bundle, data_dir: str | None = None, recipe: Recipe | None = None) -> dict[str, Any]:
    """``personalised`` and ``received`` (means over new clients of the accuracy on the half of each client's
    samples it is scored on, :func:`labeled_halves`; fractions), ``clients`` and ``line`` (one line for a person). ``recipe``: the run's, where
    the manifest's recipe file is not in the working directory (a coordinator's job)."""
    samples = client_samples(bundle.manifest, data_dir, recipe)
    x, y, offsets = samples["x"], samples["y"], samples["offsets"]
    received = open_bundle(bundle, method="none")
    personalised, kept = [], []
    for learn, score in labeled_halves(offsets):  # once per client at export: each needs its own device
        device = open_bundle(bundle)  # a fresh device per client: its own local head and stream
        device.personalize(x[learn], y[learn])
        personalised.append(float((device.predict(x[score]).argmax(1) == y[score]).mean()))
        kept.append(float((received.predict(x[score]).argmax(1) == y[score]).mean()))
    if not personalised:
        raise ValueError("no new client has two samples or more to split")
    out: dict[str, Any] = {"personalised": float(np.mean(personalised)), "received": float(np.mean(kept)),
                           "clients": len(kept)}
    out["line"] = (f"{bundle.method} on a device: personalised on a labeled random half of each new client's "
                   f"samples, {100 * out['personalised']:.2f}% on the other half ({100 * out['received']:.2f}% with "
                   f"the received model; {len(kept)} new clients, the bundle's training DLE)")
    return out


def export_scores(bundle_dir: str | Path, device_labels: bool, int8: bool, data_dir: str | None = None,
                  public_key: str | None = None) -> list[str]:
    """The lines ``fl-server export`` prints: :func:`labeled_score` when the method's devices personalise on
    labels, :func:`int8_cost` when the bundle ships ``forward_int8``; a line saying why, where the run's data is
    not here to measure on."""
    if not (device_labels or int8):
        return []
    bundle = own_bundle(bundle_dir, public_key)
    lines = []
    for wanted, measure, what in ((device_labels, labeled_score, f"{bundle.method} on a device"),
                                  (int8, int8_cost, "int8")):
        if not wanted:
            continue
        try:
            lines.append(measure(bundle, data_dir)["line"])
        except (ValueError, FileNotFoundError, RecipeError) as exc:  # the run's data is not here
            lines.append(f"{what}: not measured on the new clients ({exc})")
    return lines
