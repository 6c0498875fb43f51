"""``python -m lab bench ... --stack-seeds``: a method's missing seeds train together in one process, each into its
own run folder and raw record, with the results of its solo run (in float64; float32 rounds differently)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lab.cli import main
from lab.experiments import EXPERIMENTS
from lab.runner import build_simulation, raw_path, run_experiment, run_stacked_seeds, seed_record


def test_stacked_seeds_write_the_records_of_their_solo_runs(tmp_path: Path, data_root: str) -> None:
    exp = EXPERIMENTS["upfl-table1"]
    protocol = replace(exp.protocols["mnist"].quick(), rounds=3)
    run_stacked_seeds(exp, protocol, "mnist", "FedTTA", [0, 1], tmp_path / "results", tmp_path / "runs", "cpu",
                      progress=False, data_root=data_root, command="the command", dtype="float64")
    for seed in (0, 1):
        solo_sim = build_simulation(protocol, "FedTTA", seed, None, "cpu", "vmap", False, data_root, dtype="float64")
        solo = seed_record(protocol, "FedTTA", seed, solo_sim, solo_sim.run())
        stacked = json.loads(raw_path(tmp_path / "results", "upfl-table1", "mnist", "FedTTA", seed).read_text())
        assert stacked["stacked_seeds"] == [0, 1] and stacked["command"] == "the command"
        for key in ("seed", "rounds", "best_round", "val", "test", "curve"):
            assert stacked[key] == solo[key], (seed, key)
        assert (tmp_path / "runs" / "upfl-table1" / "mnist" / "FedTTA" / f"seed{seed}" / "best.npz").exists()


def test_the_cli_stacks_missing_seeds_and_refuses_what_it_cannot(tmp_path: Path, data_root: str,
                                                                capsys: pytest.CaptureFixture) -> None:
    args = ["bench", "upfl-table1", "--quick", "--dataset", "mnist", "--methods", "ODPFL-HN", "--seeds", "2",
            "--stack-seeds", "--device", "cpu", "--no-progress", "--data-dir", str(data_root),
            "--results-dir", str(tmp_path / "results"), "--runs-dir", str(tmp_path / "runs")]
    assert main(args) == 2  # its step is not declared pure (graph_safe): refused, one line
    assert "ODPFL-HN's local step reads Python state" in capsys.readouterr().err
    assert main(["bench", "upfl-hetero", "--quick", "--stack-seeds", "--device", "cpu"]) == 2
    assert "upfl-hetero trains with its own procedure: its seeds cannot be stacked" in capsys.readouterr().err
    assert main([*args[:6], "FedAvg", *args[7:]]) == 0
    records = [json.loads(raw_path(tmp_path / "results", "upfl-table1", "mnist", "FedAvg", s).read_text())
               for s in (0, 1)]
    assert [r["stacked_seeds"] for r in records] == [[0, 1], [0, 1]]
    assert "--stack-seeds" in records[0]["command"]


def test_the_cli_trains_a_seeds_hetero_variants_together(tmp_path: Path, data_root: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    """upfl-hetero's lambda variants of one seed in one process: one raw record per variant, each naming the
    variants it trained with; an experiment whose methods do not share their rounds refuses the flag."""
    assert main(["bench", "upfl-table1", "--quick", "--stack-variants", "--device", "cpu"]) == 2
    assert "upfl-table1's methods cannot train together" in capsys.readouterr().err
    methods = ["HeteroFedTTA (no KD)", "HeteroFedTTA (lambda=1)"]
    assert main(["bench", "upfl-hetero", "--quick", "--dataset", "fashion_mnist", "--methods", *methods, "--seed", "0",
                 "--stack-variants", "--device", "cpu", "--no-progress", "--data-dir", str(data_root),
                 "--results-dir", str(tmp_path / "results"), "--runs-dir", str(tmp_path / "runs")]) == 0
    records = [json.loads(raw_path(tmp_path / "results", "upfl-hetero", "fashion_mnist", m, 0).read_text())
               for m in methods]
    assert [r["stacked_variants"] for r in records] == [methods, methods]
    assert [r["lambda"] for r in records] == [None, 1.0] and all(r["mode"] == "vmap" for r in records)
    assert "--stack-variants" in records[0]["command"]
    assert records[0]["results"] != records[1]["results"]  # each variant's own run
