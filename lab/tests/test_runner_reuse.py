"""The runner reuses a seed's result file only if it ran with the protocol's current hyperparameters."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from lab.experiments import EXPERIMENTS
from lab.runner import raw_path, refuse_stale, run_experiment

REPO = Path(__file__).resolve().parents[2]
FEDAVG_DIR1 = REPO / "docs/results/raw/odpfl-dirichlet/fashion_mnist-a1/FedAvg/seed0.json"


def _place(tmp_path: Path, hyper_lr: float) -> Path:
    out = raw_path(tmp_path / "results", "odpfl-dirichlet", "fashion_mnist-a1", "FedAvg", 0)
    out.parent.mkdir(parents=True)
    shutil.copy(FEDAVG_DIR1, out)
    record = json.loads(out.read_text())
    record["hyper"]["lr"] = hyper_lr
    out.write_text(json.dumps(record))
    return out


def _run(tmp_path: Path) -> list[dict]:
    return run_experiment(EXPERIMENTS["odpfl-dirichlet"], ["fashion_mnist-a1"], ["FedAvg"], [0],
                          tmp_path / "results", tmp_path / "runs", device="cpu", progress=False)


def test_a_result_with_the_protocols_hyperparameters_is_reused(tmp_path: Path) -> None:
    _place(tmp_path, EXPERIMENTS["odpfl-dirichlet"].protocols["fashion_mnist-a1"].method_hp["FedAvg"]["lr"])
    rows = _run(tmp_path)  # nothing trains: the seed is done
    assert not (tmp_path / "runs").exists()
    test_row = next(r for r in rows if r["method"] == "FedAvg" and r["split"] == "test")
    recorded = json.loads(FEDAVG_DIR1.read_text())["test"]
    assert test_row["seeds"] == 1 and abs(test_row["mean"] - recorded) < 0.006  # the table rounds to 2 places


def test_a_result_with_other_hyperparameters_is_refused(tmp_path: Path) -> None:
    stale = _place(tmp_path, 0.3)
    with pytest.raises(ValueError, match=r"seed0.json ran with other hyperparameters than the protocol now sets "
                                         r"\(lr: 0.3 -> 0.1\); move it"):
        _run(tmp_path)
    assert stale.exists() and not (tmp_path / "runs").exists()


def test_a_hyperparameter_the_record_lacks_counts_as_its_default(tmp_path: Path) -> None:
    """A record written before a field existed ran with that field's default: FedAvg's lr default is the
    protocol's 0.1, so the record without it is reused; with the protocol at another value it is refused."""
    out = _place(tmp_path, 0.1)
    record = json.loads(out.read_text())
    del record["hyper"]["lr"]
    out.write_text(json.dumps(record))
    assert _run(tmp_path)[0]["seeds"] == 1 and not (tmp_path / "runs").exists()
    exp = EXPERIMENTS["odpfl-dirichlet"]
    protocol = exp.protocols["fashion_mnist-a1"]
    changed = dataclasses.replace(protocol, method_hp={**protocol.method_hp, "FedAvg": {"lr": 0.05}})
    with pytest.raises(ValueError, match=r"\(lr: 0.1 -> 0.05\)"):
        refuse_stale(out, changed, "FedAvg")


def test_a_result_with_another_number_of_rounds_is_refused(tmp_path: Path) -> None:
    out = _place(tmp_path, 0.1)
    record = json.loads(out.read_text())
    record["rounds"] = 250
    out.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"\(rounds: 250 -> 500\); move it"):
        _run(tmp_path)


def test_every_committed_seed_row_matches_its_protocol() -> None:
    """Each committed raw row of the harness's own runs (experiments without a run_fn or runner of their own)
    ran with the hyperparameters and rounds its protocol sets now: the tables are not stale."""
    checked = 0
    for exp in EXPERIMENTS.values():
        if exp.run_fn is not None or exp.runner is not None:
            continue
        for dataset, protocol in exp.protocols.items():
            for method in (*exp.methods, *exp.optional_methods):
                for seed_file in sorted(raw_path(REPO / "docs/results", exp.name, dataset, method, 0).parent
                                        .glob("seed*.json")):
                    refuse_stale(seed_file, protocol, method)
                    checked += 1
    assert checked > 20
