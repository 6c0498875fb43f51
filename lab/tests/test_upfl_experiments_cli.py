"""Quick smoke runs of the UPFL side experiments through the console script (real data): raw seed files,
the aggregated table, the report and the data-size plot."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_lab_cli import run_lab


def _bench(tmp_path: Path, data_root: Path, experiment: str, *methods: str) -> list[dict]:
    args = ["bench", experiment, "--quick", "--seeds", "1", "--results-dir", str(tmp_path / "docs" / "results"),
            "--runs-dir", str(tmp_path / "runs"), "--no-progress"]
    out = run_lab(*args, *(["--methods", *methods] if methods else []), env={"FL_DATA_DIR": str(data_root)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp_path / "docs" / "results" / f"{experiment}.json").read_text())


def _raw(tmp_path: Path, experiment: str) -> list[Path]:
    return sorted((tmp_path / "docs" / "results" / "raw" / experiment).rglob("seed0.json"))


@pytest.mark.slow
def test_concept_shift_quick(tmp_path: Path, data_root: Path) -> None:
    rows = _bench(tmp_path, data_root, "upfl-concept-shift")
    assert {(r["method"], r["split"]) for r in rows} == {(m, s) for m in ("FedAvg", "TENT", "FedTTA", "FedTTA++")
                                                        for s in ("val", "test")}
    assert len(_raw(tmp_path, "upfl-concept-shift")) == 4
    assert all(0 <= r["mean"] <= 100 and r["seeds"] == 1 for r in rows)


@pytest.mark.slow
def test_data_size_quick_and_plot(tmp_path: Path, data_root: Path) -> None:
    rows = _bench(tmp_path, data_root, "upfl-data-size", "FedAvg", "TENT")
    fractions = sorted({r["fraction"] for r in rows if r["split"] == "test"})
    assert fractions == [0.1, 0.25, 0.5, 1.0]
    assert {r["method"] for r in rows} == {"FedAvg", "TENT"} and len(_raw(tmp_path, "upfl-data-size")) == 2
    raw = json.loads(_raw(tmp_path, "upfl-data-size")[0].read_text())
    by_a = {e["fraction"]: e["value"] for e in raw["results"] if e["split"] == "test"}
    assert by_a[1.0] == pytest.approx(raw["test"])  # a = 1 is the plain new-client test
    assert raw["training_run"].startswith("upfl-data-size/")  # the smoke protocol is not upfl-table1's: own folder
    report = run_lab("report", "--docs", str(tmp_path / "docs"))
    assert report.returncode == 0, report.stderr
    png = tmp_path / "docs" / "upfl-data-size.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "docs" / "RESULTS.md").read_text()
    assert "test a=0.1" in text and "![upfl-data-size](upfl-data-size.png)" in text


@pytest.mark.slow
def test_hetero_quick(tmp_path: Path, data_root: Path) -> None:
    rows = _bench(tmp_path, data_root, "upfl-hetero", "HeteroFedTTA (lambda=1)")
    assert {(r["split"], r["group"]) for r in rows} == {(s, g) for s in ("val", "test")
                                                       for g in ("small", "medium", "big", "all")}
    raw = json.loads(_raw(tmp_path, "upfl-hetero")[0].read_text())
    assert raw["lambda"] == 1.0 and raw["public_size"] > 0 and raw["digest_steps"] > 0
    assert all(n_train > 0 and n_new > 0 for n_train, n_new in raw["group_clients"].values())
