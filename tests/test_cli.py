"""The fl-server console script, run as a user would (subprocess), on real data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def fl_server(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fl_server.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=600)


def test_train_on_embedded_digits(tmp_path: Path) -> None:
    out = fl_server("train", "--dataset", "digits", "--method", "TENT", "--rounds", "5", "--out", str(tmp_path),
                    "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "TENT on digits: best val" in out.stdout
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["val"] > 0.3
    assert (tmp_path / "checkpoint.npz").exists() and (tmp_path / "best.npz").exists()


def test_bench_quick_writes_schema_rows(tmp_path: Path, data_root: Path) -> None:
    out = fl_server("bench", "upfl-table1", "--quick", "--dataset", "mnist", "--seeds", "1", "--methods", "FedAvg", "TENT",
                    "--results-dir", str(tmp_path / "res"), "--runs-dir", str(tmp_path / "runs"), "--no-progress",
                    env={"FL_DATA_DIR": str(data_root)})
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "res" / "upfl-table1.json").read_text())
    keys = {"experiment", "dataset", "method", "split", "metric", "mean", "std", "seeds", "paper", "device",
            "wall_s", "command"}
    assert {(r["method"], r["split"]) for r in rows} == {(m, s) for m in ("FedAvg", "TENT") for s in ("val", "test")}
    for r in rows:
        assert keys <= set(r) and r["seeds"] == 1 and 0 <= r["mean"] <= 100
    assert next(r for r in rows if r["method"] == "FedAvg" and r["split"] == "test")["paper"] == 94.69
    # resumable: a second call finds every seed file and trains nothing
    again = fl_server("bench", "upfl-table1", "--quick", "--dataset", "mnist", "--seeds", "1", "--methods", "FedAvg", "TENT",
                      "--results-dir", str(tmp_path / "res"), "--runs-dir", str(tmp_path / "runs"), "--no-progress",
                      env={"FL_DATA_DIR": str(data_root)})
    assert again.returncode == 0 and "FedAvg" in again.stdout


def test_data_info_and_clear_errors(tmp_path: Path, data_root: Path) -> None:
    ok = fl_server("data", "info", "mnist", "--dir", str(data_root))
    assert ok.returncode == 0 and "train: 60000 samples" in ok.stdout
    bad = fl_server("data", "info", "mnist", "--dir", str(tmp_path))
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "fl-server data fetch" in bad.stderr and "Traceback" not in bad.stderr


def test_unknown_method_is_one_clear_line(tmp_path: Path) -> None:
    out = fl_server("train", "--method", "Nope", "--rounds", "1", "--out", str(tmp_path))
    assert out.returncode == 2 and "unknown method 'Nope'" in out.stderr
