"""The compact tables of docs/RESULTS.md (lab.summary), on the committed result tables."""
from __future__ import annotations

import json
from pathlib import Path

from lab.summary import MAX_SPLIT_COLUMNS, lead, summary_section, table_command

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _table(name: str) -> list[dict]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def test_one_command_per_data_set_covers_every_method_and_the_most_seeds() -> None:
    rows = [r for r in _table("upfl-table1") if r["dataset"] == "mnist"]
    assert len({r["command"] for r in rows}) > 1  # recorded per method (--methods X) and per device
    assert table_command("upfl-table1", rows) == "python -m lab bench upfl-table1 --dataset mnist --seeds 3"
    cuda = [r for r in _table("btgfl") if r["dataset"] == "fashion_mnist-paper"]  # every row ran with --device cuda
    assert table_command("btgfl", cuda) == "python -m lab bench btgfl --dataset fashion_mnist-paper --device cuda --seeds 1"


def test_summary_cells_and_layout() -> None:
    rows = _table("upfl-table1")
    text = summary_section("upfl-table1", rows, "UPFL Table 1: 100 clients (Sec. 4.1). Reading the rows: more.")
    assert "UPFL Table 1: 100 clients (Sec. 4.1). Every row" in text and "Reading the rows" not in text
    fedavg = next(r for r in rows if (r["dataset"], r["method"], r["split"]) == ("mnist", "FedAvg", "test"))
    line = next(ln for ln in text.splitlines() if ln.startswith("| mnist | FedAvg |"))
    assert f"{fedavg['mean']:.2f} +- {fedavg['std']:.2f} (paper {fedavg['paper']:.2f})" in line
    assert sum(ln.startswith("- ") for ln in text.splitlines()) == len({r["dataset"] for r in rows})
    assert "python -m lab bench" not in text.split("| dataset |")[1]  # no command inside the table

    one_seed = summary_section("btgfl", [r for r in _table("btgfl") if r["seeds"] == 1])
    assert " +- " not in one_seed.split("| dataset |")[1]  # a single run shows its value, no spread


def test_wide_tables_are_transposed_and_detail_rows_left_out() -> None:
    dp = _table("odpfl-dp")
    assert len({(r["split"], r.get("setting")) for r in dp}) > MAX_SPLIT_COLUMNS
    text = summary_section("odpfl-dp", dp)
    assert "| dataset | split | seeds | FedAvg | ODPFL-HN |" in text
    assert "| fashion_mnist | test: \\|D\\|=100, eps=1 |" in text
    assert "diverged" not in text  # every seed of the committed rows trained
    # a seed whose training diverged (the aggregate's diverged_seeds, from its record's warning or diverged_round):
    # every cell of its method says so, the other method's do not
    marked = summary_section("odpfl-dp", [{**r, "diverged_seeds": [0]} if r["method"] == "ODPFL-HN" else r
                                          for r in dp])
    line = next(ln for ln in marked.splitlines() if ln.startswith("| fashion_mnist | test: \\|D\\|=100, eps=1 |"))
    assert line.endswith("(diverged: seed 0) |")
    assert "diverged" not in next(ln for ln in marked.splitlines() if "global model" in ln)

    shift = summary_section("fedicon-shift", _table("fedicon-shift"))
    assert "test covariate-s5" in shift and "contrast-5" not in shift and "tta_lr" not in shift
    assert len(shift.splitlines()) < 120
    # the -noproj variant changes only FedICON: its baselines' lines equal mnist's and are named, not repeated
    assert "| mnist | FedAvg |" in shift and "| mnist-noproj | FedAvg |" not in shift
    assert "| mnist-noproj | FedICON |" in shift and "mnist-noproj FedAvg = mnist; " in shift


def test_only_equal_numbers_collapse_a_line() -> None:
    row = {"experiment": "x", "method": "FedAvg", "split": "test", "metric": "accuracy", "mean": 90.0, "std": 0.5,
           "seeds": 3, "paper": None, "device": "cpu", "command": "python -m lab bench x --dataset a --seeds 3"}
    rows = [{**row, "dataset": "a"}, {**row, "dataset": "b"}, {**row, "dataset": "c", "mean": 90.01}]
    text = summary_section("x", rows)
    assert "| a | FedAvg |" in text and "| b | FedAvg |" not in text and "| c | FedAvg |" in text
    assert "not repeated: b FedAvg = a." in text


def test_lead_keeps_abbreviations_inside_the_first_sentence() -> None:
    assert lead("UPFL concept shift (Sec. 4.5, App. F): 1,000 samples. Then more.") == \
        "UPFL concept shift (Sec. 4.5, App. F): 1,000 samples."
    assert lead("No full stop followed by a capital here") == "No full stop followed by a capital here"


def test_a_summary_object_shows_its_first_table_and_keeps_the_rest_for_the_research_page() -> None:
    from lab.report import benchmark_section, benchmark_tables

    series = json.loads((RESULTS.parent / "benchmarks" / "coordinator-load-series.json").read_text())
    tables = benchmark_tables(series)
    assert list(tables) == [" (variants)", " (runs)"] and len(tables[" (runs)"]) == len(series["runs"])
    text = benchmark_section("coordinator-load-series (variants)", tables[" (variants)"])
    assert "| before-raw | - | - | runs=3," in text and "| command |" not in text  # no empty columns
    assert benchmark_tables([{"what": "a"}]) == {"": [{"what": "a"}]}
    assert benchmark_tables({"what": "a", "value": 1}) == {"": [{"what": "a", "value": 1}]}


def test_a_seed_whose_record_says_it_diverged_is_named_by_its_rows(tmp_path: Path) -> None:
    """The aggregate marks a method's rows with the seeds whose record carries a warning (weights not finite) or a
    diverged_round; the other method's rows carry nothing."""
    import shutil

    from lab.experiments import get_experiment
    from lab.runner import aggregate

    raw = tmp_path / "raw" / "odpfl-dp"
    shutil.copytree(RESULTS / "raw" / "odpfl-dp", raw)
    seed0 = raw / "fashion_mnist" / "ODPFL-HN" / "seed0.json"
    seed0.write_text(json.dumps({**json.loads(seed0.read_text()), "diverged_round": 24}))
    rows = aggregate(get_experiment("odpfl-dp"), tmp_path)
    assert {tuple(r.get("diverged_seeds", ())) for r in rows if r["method"] == "ODPFL-HN"} == {(0,)}
    assert all("diverged_seeds" not in r for r in rows if r["method"] == "FedAvg")


def test_a_seed_that_trained_to_chance_is_named_by_its_rows(tmp_path: Path) -> None:
    """odpfl-dirichlet-noise's seed 1, trained before the protocol clipped the clients' local steps, collapsed
    with finite weights (validation 14.3% on ten classes; its three rows are kept as this test's data): the
    aggregate names it on its method's rows, the table's cells say so, and a seed just above chance is not
    named."""
    import shutil

    from lab.experiments import get_experiment
    from lab.runner import aggregate

    raw = tmp_path / "raw" / "odpfl-dirichlet-noise"
    shutil.copytree(Path(__file__).parent / "data" / "odpfl-dirichlet-noise-unclipped", raw)
    rows = aggregate(get_experiment("odpfl-dirichlet-noise"), tmp_path)
    hn = [r for r in rows if r["method"] == "ODPFL-HN"]
    assert hn and {tuple(r.get("chance_seeds", ())) for r in hn} == {(1,)}
    assert all("chance_seeds" not in r for r in rows if r["method"] != "ODPFL-HN")
    line = next(ln for ln in summary_section("odpfl-dirichlet-noise", rows).splitlines() if "| ODPFL-HN |" in ln)
    assert "(at chance: seed 1)" in line
    seed1 = raw / "fashion_mnist-a1" / "ODPFL-HN" / "seed1.json"
    seed1.write_text(json.dumps({**json.loads(seed1.read_text()), "val": 15.01}))  # chance 10% + 5 points
    assert all("chance_seeds" not in r for r in aggregate(get_experiment("odpfl-dirichlet-noise"), tmp_path))
