"""The GPU lease script (lab/research/gpu_engine_session.sh) dry-run on the CPU at smoke size, so that it cannot rot
between leases: a row of two stacked seeds trains, and its results and best states come back packed in $OUT (what
a cut-off row's checkpoints become: lab/tests/test_lease_checkpoints.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STACKED = "bench upfl-table1 --dataset mnist --methods FedAvg --seed 1 --seed 2 --stack-seeds"


def _session(tmp_path: Path, data_root: Path, rows: str, budget_s: int, extra: str) -> tuple[Path, str]:
    (tmp_path / "rows.tsv").write_text(rows)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "NO_TESTS": "1", "FL_BATCHED_CONV": "native", "DEVICE": "cpu",
           "EXTRA_ARGS": extra, "ROWS": "dry", "ROWS_FILE": str(tmp_path / "rows.tsv"),
           "QUEUE_DIR": str(tmp_path / "queue"), "CKPT_DIR": str(tmp_path / "ckpt"), "BUDGET_S": str(budget_s),
           "FL_DATA_DIR": str(data_root), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "lab/research/gpu_engine_session.sh"], cwd=REPO, env=env, check=True, timeout=600,
                   capture_output=True)
    return out, (out / "log.txt").read_text()


def test_a_stacked_row_trains_and_comes_back_packed(tmp_path: Path, data_root: Path) -> None:
    out, log = _session(tmp_path, data_root, f"dry\t{STACKED}\n", 300, "--quick --mode vmap")
    assert "row dry done" in log and log.rstrip().endswith("done"), log
    assert log.count("row dry: bench") == 1, log  # a row without && is one step, run once
    with tarfile.open(out / "rows.tgz") as tar:
        names = tar.getnames()
    for seed in (1, 2):
        assert f"results/raw/upfl-table1/mnist/FedAvg/seed{seed}.json" in names, names
    assert (out / "best-states.tgz").exists() and not list(out.glob("ckpt-*"))

