"""lab/research/probe_family_training.py (the validation-only gap study of the FedTTA family): at the protocol's own
settings its run is the table row's run without the new clients (the same validation curve), the new clients are
never scored, and a changed setting trains with it in its own resumable folder and row."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lab.experiments import get_experiment
from lab.runner import run_seed

SCRIPT = Path(__file__).resolve().parents[2] / "lab" / "research" / "probe_family_training.py"
spec = importlib.util.spec_from_file_location("probe_family_training", SCRIPT)
assert spec and spec.loader
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def _probe(tmp_path: Path, data_root: Path, *extra: str) -> list[dict]:
    argv = ["--method", "FedTTA", "--dataset", "mnist", "--seed", "0", "--quick", "--device", "cpu", "--mode", "loop",
            "--runs-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results"), "--data-dir",
            str(data_root), "--no-progress", *extra]
    assert probe.main(argv) == 0
    return json.loads((tmp_path / "results" / probe.OUT_NAME).read_text())


def test_the_protocols_setting_is_the_table_runs_validation_without_its_new_clients(tmp_path: Path,
                                                                                    data_root: Path) -> None:
    rows = _probe(tmp_path, data_root)
    assert [r["setting"] for r in rows] == ["protocol"] and rows[0]["what"].endswith("(--quick)")
    record = run_seed(get_experiment("upfl-table1").protocols["mnist"].quick(), "FedTTA", 0, tmp_path / "table",
                      device="cpu", mode="loop", progress=False, data_root=str(data_root))
    assert [c["val"] for c in rows[0]["curve"]] == [round(100 * c["val"], 2) for c in record["curve"]]
    assert rows[0]["value"] == round(record["val"], 2) and rows[0]["best_round"] == record["best_round"]
    assert record["test"] is not None  # the table run scores its new clients; the probe never does
    run = tmp_path / "runs" / "probe-family" / "mnist" / "FedTTA" / "protocol-quick" / "seed0"  # not a real run's
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(m.get("test") is None for m in metrics)


def test_a_changed_setting_trains_with_it_in_its_own_folder_and_row(tmp_path: Path, data_root: Path) -> None:
    _probe(tmp_path, data_root, "--rounds", "2")
    rows = _probe(tmp_path, data_root, "--set", "lr=0.5", "--set", "adapt_lr=0.02", "--rounds", "2")
    assert [r["setting"] for r in rows] == ["rounds=2", "adapt_lr=0.02, lr=0.5, rounds=2"]
    changed = rows[1]
    assert changed["hyper"]["lr"] == 0.5 and changed["hyper"]["adapt_lr"] == 0.02 and changed["rounds"] == 2
    assert changed["curve"] != rows[0]["curve"]
    assert (tmp_path / "runs" / "probe-family" / "mnist" / "FedTTA" / "adapt_lr0.02_lr0.5_rounds2-quick" / "seed0"
            / "checkpoint.npz").exists()
    assert "--set lr=0.5 --set adapt_lr=0.02" in changed["command"] and "--no-progress" not in changed["command"]


def test_a_set_without_a_value_is_refused() -> None:
    with pytest.raises(SystemExit, match="--set takes KEY=VALUE, got 'lr'"):
        probe.parse_sets(["lr"])


def test_the_merge_fills_in_the_tables_validation_of_a_lease_row() -> None:
    """A lease call has docs/results aside, so its rows come back without the table's validation; the merge reads it
    from the committed raw record of the same data set, method and seed (never for a --quick row)."""
    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    committed = json.loads((results / "raw" / "upfl-table1" / "mnist" / "FedTTA" / "seed0.json").read_text())["val"]
    row = {"what": "FedTTA mnist seed 0: lr=0.2", "dataset": "mnist", "method": "FedTTA", "seed": 0, "table_val": None}
    assert probe.fill_table_val(row, results)["table_val"] == committed
    quick = {**row, "what": row["what"] + " (--quick)"}
    assert probe.fill_table_val(quick, results)["table_val"] is None
