"""``python -m lab`` (the results lab's command line), run as a user would (subprocess) from a clone, on real
data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_lab(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m lab ARGS`` with the clone's root on the path (the lab is not installed)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "lab", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {}), "PYTHONPATH": path}, timeout=600)


def test_bench_quick_writes_schema_rows(tmp_path: Path, data_root: Path) -> None:
    out = run_lab("bench", "upfl-table1", "--quick", "--dataset", "mnist", "--seeds", "1", "--methods", "FedAvg", "TENT",
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
    again = run_lab("bench", "upfl-table1", "--quick", "--dataset", "mnist", "--seeds", "1", "--methods", "FedAvg", "TENT",
                    "--results-dir", str(tmp_path / "res"), "--runs-dir", str(tmp_path / "runs"), "--no-progress",
                    env={"FL_DATA_DIR": str(data_root)})
    assert again.returncode == 0 and "FedAvg" in again.stdout
    # --seed runs one chosen seed (e.g. one process per seed); the table aggregates every seed file present
    one = run_lab("bench", "upfl-table1", "--quick", "--dataset", "mnist", "--seed", "1", "--methods", "FedAvg",
                  "--threads", "1", "--results-dir", str(tmp_path / "res"), "--runs-dir", str(tmp_path / "runs"), "--no-progress",
                  env={"FL_DATA_DIR": str(data_root)})
    assert one.returncode == 0, one.stderr
    raw = tmp_path / "res" / "raw" / "upfl-table1" / "mnist"
    assert sorted(p.name for p in (raw / "FedAvg").glob("seed*.json")) == ["seed0.json", "seed1.json"]
    assert sorted(p.name for p in (raw / "TENT").glob("seed*.json")) == ["seed0.json"]
    rows = json.loads((tmp_path / "res" / "upfl-table1.json").read_text())
    assert {r["method"]: r["seeds"] for r in rows} == {"FedAvg": 2, "TENT": 1}
    # the recorded command reproduces the table (every seed), not just the one seed this process ran
    command = next(r["command"] for r in rows if r["method"] == "FedAvg")
    assert command.endswith("--seeds 2") and "--seed 1" not in command and "--threads" not in command
    zero = run_lab("bench", "upfl-table1", "--quick", "--threads", "0", "--no-progress")
    assert zero.returncode == 2 and zero.stderr == "error: --threads must be >= 1, got 0\n", zero.stderr


def test_bench_quick_keeps_its_run_dirs_apart_from_full_runs(tmp_path: Path, data_root: Path) -> None:
    out = run_lab("bench", "upfl-table1", "--quick", "--dataset", "mnist", "--seeds", "1", "--methods", "FedAvg",
                  "--no-progress", env={"FL_DATA_DIR": str(data_root)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "runs/quick/results/upfl-table1.json").exists()
    assert list((tmp_path / "runs/quick/runs").rglob("metrics.jsonl")) and not (tmp_path / "runs/bench").exists()
