"""The unseen-domain experiment (issue #39): its data (upsampled 8x8 digits, two-class new clients, the
corruptions at severities 3 and 5), a --quick smoke run through the console script, and the device SDK's
safeguard default against the committed table's validation rows."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.safeguard import DEFAULT_THRESHOLD
from fl_server.data import load_dataset
from fl_server.data.corruptions import corrupt
from fl_server.data.domains import two_class_clients, upsampled_digits
from fl_server.data.shifts import resize

from lab.experiments import get_experiment
from lab.unseen import PERSONALISING, THRESHOLDS, chosen_threshold, summarise
from test_lab_cli import run_lab

TABLE = Path(__file__).resolve().parents[2] / "docs" / "results" / "unseen-domain.json"


def test_upsampled_digits_shape_and_range() -> None:
    d = upsampled_digits()
    assert d.x.shape == (1797, 1, 28, 28) and d.x.dtype == np.float32 and d.y.shape == (1797,)
    assert d.x.min() >= 0.0 and d.x.max() <= 1.0 and d.x.max() > 0.9
    assert sorted(np.unique(d.y)) == list(range(10))
    # the same images: resized back to 8x8 they match the originals
    small = load_dataset("digits", split="all")
    back = resize(d.x, (8, 8))
    assert np.corrcoef(back.ravel(), small.x.ravel())[0, 1] > 0.95 and np.array_equal(d.y, small.y)


def test_two_class_clients() -> None:
    y = np.repeat(np.arange(10), 60)
    clients = two_class_clients(y, 8, 100, np.random.default_rng(0))
    assert len(clients) == 8
    for c in clients:
        assert len(c) == 100 and len(np.unique(c)) == 100
        labels, counts = np.unique(y[c], return_counts=True)
        assert len(labels) == 2 and counts.tolist() == [50, 50]
    with pytest.raises(ValueError, match="fewer than the 50 a client needs"):
        two_class_clients(np.repeat(np.arange(10), 40), 1, 100, np.random.default_rng(0))


def test_corruption_severities_on_mnist(mnist_all) -> None:  # type: ignore[no-untyped-def]
    x = mnist_all.x[:64]
    opts = get_experiment("unseen-domain").protocols["mnist"].options
    assert tuple(opts["severities"]) == (3, 5)
    assert not set(opts["val_corruptions"]) & set(opts["test_corruptions"])  # validation never sees a test type
    for name in (*opts["test_corruptions"], *opts["val_corruptions"]):
        d3 = np.abs(corrupt(x, name, 3, 0) - x).mean()
        d5 = np.abs(corrupt(x, name, 5, 0) - x).mean()
        assert 0 < d3 < d5, name  # severity 5 moves the images further than severity 3


def test_summarise_and_threshold_choice() -> None:
    clients = [{"received": 0.9, "personalised": 0.5, "disagreement": 0.4},
               {"received": 0.6, "personalised": 0.8, "disagreement": 0.1}]
    s = summarise(clients, 0.2)  # the first client is kept at its received model
    assert s["personalised"] == pytest.approx(65) and s["safeguard"] == pytest.approx(85)
    assert s["worse"] == 50 and s["safeguard_worse"] == 0 and s["kept"] == 50
    rows = [{"method": "TENT", "shift": "val-mean", "measure": "safeguard", "threshold": t, "mean": m}
            for t, m in ((0.1, 80.0), (0.3, 82.0), (1.0, 82.0))]
    assert chosen_threshold(rows, ("TENT",)) == 1.0  # a tie goes to the threshold that intervenes less


def test_default_threshold_is_chosen_on_validation() -> None:
    rows = json.loads(TABLE.read_text())
    assert {r["seeds"] for r in rows} == {3}
    assert DEFAULT_THRESHOLD == chosen_threshold(rows, PERSONALISING)
    assert DEFAULT_THRESHOLD in THRESHOLDS


@pytest.mark.slow
def test_unseen_domain_quick(tmp_path: Path, data_root: Path) -> None:
    args = ["bench", "unseen-domain", "--quick", "--seeds", "1", "--dataset", "mnist", "--methods", "FedAvg",
            "TENT", "--results-dir", str(tmp_path / "docs" / "results"), "--runs-dir", str(tmp_path / "runs"),
            "--no-progress"]
    out = run_lab(*args, env={"FL_DATA_DIR": str(data_root)})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "docs" / "results" / "unseen-domain.json").read_text())
    by = {(r["method"], r["shift"], r["measure"], r["threshold"]): r["mean"] for r in rows}
    for shift in ("clean", "digits", "gaussian_noise-5", "covariate-s5", "impulse_noise-5", "val-mean"):
        assert ("TENT", shift, "personalised", None) in by, shift
        assert {("TENT", shift, "safeguard", t) in by for t in THRESHOLDS} == {True}, shift
    # FedAvg does not adapt: personalised = received, nobody made worse, the safeguard never intervenes
    assert by[("FedAvg", "digits", "personalised", None)] == by[("FedAvg", "digits", "received", None)]
    assert by[("FedAvg", "digits", "worse", None)] == 0
    assert by[("FedAvg", "digits", "kept", DEFAULT_THRESHOLD)] == 0
    # the safeguard at threshold 1 never keeps the received model: it equals personalisation
    assert by[("TENT", "digits", "safeguard", 1.0)] == by[("TENT", "digits", "personalised", None)]
    # TENT and FedAvg receive the same model (TENT evaluates the FedAvg run)
    assert by[("TENT", "clean", "received", None)] == by[("FedAvg", "clean", "received", None)]
    report = run_lab("report", "--docs", str(tmp_path / "docs"))
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "docs" / "RESULTS.md").read_text()  # the compact table: method x condition
    assert "**mnist**" in text and "| method | clean | digits |" in text and "\n| TENT | " in text
    detail = (tmp_path / "docs" / "research" / "results-detail.md").read_text()  # every measure, per condition
    assert "### mnist: new clients (test)" in detail and "| digits | TENT |" in detail
