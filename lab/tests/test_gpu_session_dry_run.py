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



def test_a_gap_probe_row_trains_and_its_row_merges(tmp_path: Path, data_root: Path) -> None:
    """A research script's row (the gap study's validation-only probe) runs with the lease's flags, its finished run
    sends no checkpoint back, and the merge adds its row to the docs folder's probe file with a clean command."""
    import json

    row = "dry\tlab/research/probe_family_training.py --method FedTTA --dataset mnist --seed 0 --rounds 2\n"
    out, log = _session(tmp_path, data_root, row, 300, "--quick --mode loop")
    assert "row dry done" in log and log.count("row dry: lab/research/probe_family_training.py") == 1, log
    with tarfile.open(out / "rows.tgz") as tar:
        assert "results/fedtta-family-gap-probe.json" in tar.getnames()
    assert not list(out.glob("ckpt-*"))  # finished: nothing to resume
    docs = tmp_path / "docs"
    merged = subprocess.run([sys.executable, "lab/research/merge_device_results.py", str(out / "rows.tgz"), "--docs",
                             str(docs), "--store", str(tmp_path / "store")], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert merged.returncode == 0, merged.stderr
    rows = json.loads((docs / "results" / "fedtta-family-gap-probe.json").read_text())
    assert [r["setting"] for r in rows] == ["rounds=2"] and rows[0]["run"].startswith("probe-family/mnist/FedTTA/")
    assert "--results-dir" not in rows[0]["command"] and "--runs-dir" not in rows[0]["command"]
    assert rows[0]["command"].startswith("python lab/research/probe_family_training.py --method FedTTA")
