"""lab/research/device_queue.sh and lab/research/merge_device_results.py end to end, on the CPU with the embedded digits:
rows run detached from a copy of the tree, a two-step row runs its steps in turn, a failing row records its
exit code, `status` packs the raw results, and the merge adds them to a docs folder with the table command."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICK = "--dataset digits --seed 0 --quick"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("pgrep") is None,
                                reason="device_queue.sh needs bash and pgrep")


def _env(queue: Path, out: Path) -> dict[str, str]:
    python_dir = str(Path(sys.executable).parent)  # `python3` inside the script must be this interpreter
    return {**os.environ, "QUEUE_DIR": str(queue), "OUT": str(out), "DEVICE": "cpu", "MIN_FREE_MB": "0",
            "PATH": f"{python_dir}:{os.environ['PATH']}"}


def test_queue_runs_rows_and_merge_adds_them(tmp_path: Path) -> None:
    if not (Path(sys.executable).parent / "python3").exists():
        pytest.skip("the interpreter's folder has no python3 for the script to call")
    queue, out = tmp_path / "queue", tmp_path / "out"
    rows = tmp_path / "rows.tsv"
    rows.write_text(f"two\tbench upfl-table1 {QUICK} --methods FedAvg && bench upfl-table1 {QUICK} --methods TENT\n"
                    f"bad\tbench upfl-table1 {QUICK} --methods 'No Such Method'\n")
    env = _env(queue, out)
    start = subprocess.run(["bash", "lab/research/device_queue.sh", "start", str(rows)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert start.returncode == 0, start.stderr
    assert not (queue / "repo" / ".venv").exists() and (queue / "repo" / "fl_server").is_dir()
    deadline = time.monotonic() + 600
    while not all((queue / "done" / n).exists() for n in ("two", "bad")):
        assert time.monotonic() < deadline, (queue / "queue.log").read_text()
        time.sleep(2)
    assert (queue / "done" / "two").read_text().split()[0] == "0"
    assert (queue / "done" / "bad").read_text().split()[0] != "0"  # the unknown method's exit code is kept
    raw = queue / "results" / "raw" / "upfl-table1" / "digits"
    assert (raw / "FedAvg" / "seed0.json").exists() and (raw / "TENT" / "seed0.json").exists()

    status = subprocess.run(["bash", "lab/research/device_queue.sh", "status"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0 and "done two: exit, seconds = 0" in status.stdout
    with tarfile.open(out / "results.tgz") as tar:
        assert "results/raw/upfl-table1/digits/TENT/seed0.json" in tar.getnames()

    docs = tmp_path / "docs"
    merged = subprocess.run([sys.executable, "lab/research/merge_device_results.py", str(out / "results.tgz"),
                             "--docs", str(docs)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    table = json.loads((docs / "results" / "upfl-table1.json").read_text())
    assert {r["method"] for r in table} == {"FedAvg", "TENT"}
    for r in table:  # the table's own command: no queue folders, no single method
        assert "--results-dir" not in r["command"] and "--runs-dir" not in r["command"]
        assert "--methods" not in r["command"] and r["command"].startswith("python -m lab bench upfl-table1")
    assert (docs / "RESULTS.md").exists()


def test_table_command_drops_queue_folders_and_every_method() -> None:
    sys.path.insert(0, str(ROOT / "lab" / "research"))
    from merge_device_results import table_command

    recorded = ("python -m lab bench fedicon-shift --dataset mnist-paper --methods FedAvg FedAvg-FT 'FedICON w/o TTA' "
                "--device cuda --results-dir queue/results --runs-dir queue/runs --seeds 3")
    assert table_command(recorded) == "python -m lab bench fedicon-shift --dataset mnist-paper --device cuda --seeds 3"


def test_merge_aggregates_btgfl_with_its_own_columns(tmp_path: Path) -> None:
    """btgfl's raw records hold stream columns, not the harness's splits: the merge must re-aggregate them with
    btgfl's own aggregation and keep the data sets already in the table."""
    raw = ROOT / "docs" / "results" / "raw" / "btgfl"
    if not (raw / "mnist").is_dir() or not (raw / "fashion_mnist").is_dir():
        pytest.skip("the repository's btgfl raw records are absent")
    docs = tmp_path / "docs"
    shutil.copytree(raw / "mnist", docs / "results" / "raw" / "btgfl" / "mnist")  # already merged earlier
    archive = tmp_path / "rows.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for f in sorted((raw / "fashion_mnist").glob("*/seed0.json")):
            tar.add(f, arcname=f"results/raw/btgfl/fashion_mnist/{f.parent.name}/seed0.json")
    merged = subprocess.run([sys.executable, "lab/research/merge_device_results.py", str(archive), "--docs", str(docs)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    table = json.loads((docs / "results" / "btgfl.json").read_text())
    assert {r["dataset"] for r in table} == {"mnist", "fashion_mnist"}
    record = json.loads((raw / "fashion_mnist" / "BTFL_bs32" / "seed0.json").read_text())
    row = next(r for r in table if r["dataset"] == "fashion_mnist" and r["method"] == "BTFL (bs=32)"
               and r["column"] == "avg")
    assert row["seeds"] == 1 and row["mean"] == round(record["avg"], 2)
