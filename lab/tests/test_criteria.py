"""The reproduction-status table: verdicts from result rows (met / not met / partial / missing)."""
from __future__ import annotations

import json
from pathlib import Path

from lab.criteria import (CRITERIA, SDK_BENCHMARK, VMAP_BENCHMARK, Criterion, at_least, beats,
                                      sdk_parity, status_section, table_complete, vmap_engine, within)
from lab.report import DETAIL_PAGE, STATUS_PAGE, write_report

REPO = Path(__file__).resolve().parents[2]


def row(method: str, mean: float, seeds: int = 3, dataset: str = "mnist", split: str = "test", **fields) -> dict:
    return {"experiment": "x", "dataset": dataset, "method": method, "split": split, "mean": mean, "std": 0.0,
            "seeds": seeds, "device": "cpu", **fields}


def test_at_least_statuses() -> None:
    check = at_least("x", "mnist", "FedAvg", 92.69)
    assert check({"x": [row("FedAvg", 92.69)]}).status == "met"  # "at or above" includes equality
    assert check({"x": [row("FedAvg", 92.68)]}).status == "not met"
    partial = check({"x": [row("FedAvg", 95.0, seeds=2)]})
    assert partial.status == "partial" and "2 of 3 seeds, passing so far" in partial.measured
    assert check({"x": [row("FedAvg", 95.0, split="val")]}).status == "missing"  # the test split is required
    assert check({}).status == "missing"


def test_beats_margin_strictness_and_fields() -> None:
    rows = [row("A", 96.0), row("B", 93.0)]
    assert beats("x", "mnist", "A", ("B",), margin=3.0)({"x": rows}).status == "met"
    assert beats("x", "mnist", "A", ("B",), margin=3.0, strict=True)({"x": rows}).status == "not met"
    shifted = [row("A", 80.0, shift="s1"), row("B", 79.0, shift="s1"), row("A", 70.0, shift="s3"),
               row("B", 71.0, shift="s3")]
    check = beats("x", "mnist", "A", ("B",), strict=True, fields=({"shift": "s1"}, {"shift": "s3"}))
    verdict = check({"x": shifted})
    assert verdict.status == "not met" and "s3: 70.00 vs B 71.00" in verdict.measured
    assert beats("x", "mnist", "A", ("C",))({"x": rows}).status == "missing"
    # the fewest seeds of any row read decides partial
    assert beats("x", "mnist", "A", ("B",))({"x": [row("A", 96.0), row("B", 93.0, seeds=1)]}).status == "partial"


def test_within_and_table_complete() -> None:
    rows = [row("P", 66.15, column="avg"), row("Q", 66.70, column="avg")]
    assert within("x", "mnist", "P", "Q", 0.5, column="avg")({"x": rows}).status == "not met"
    assert within("x", "mnist", "P", "Q", 0.6, column="avg")({"x": rows}).status == "met"
    check = table_complete("odpfl-dp")  # methods from the experiment registry: FedAvg, ODPFL-HN
    assert check({"odpfl-dp": [row("FedAvg", 1.0)]}).status == "missing"
    verdict = check({"odpfl-dp": [row("FedAvg", 1.0), row("ODPFL-HN", 1.0, seeds=1)]})
    assert verdict.status == "partial" and "so far" not in verdict.measured


def test_status_section_on_the_committed_tables(tmp_path: Path) -> None:
    """Every criterion renders one line from the real docs/results tables; write_report puts it first."""
    tables = {p.stem: json.loads(p.read_text()) for p in sorted((REPO / "docs" / "results").glob("*.json"))}
    text = status_section({k: v for k, v in tables.items() if all("mean" in r for r in v)})
    lines = [line for line in text.splitlines() if line.startswith("| #")]
    assert len(lines) == len(CRITERIA)
    assert all(line.split(" | ")[2].split(" ([why]")[0] in {"met", "not met", "partial", "missing"} for line in lines)
    mnist_fedavg = next(line for line in lines if "Table 1 MNIST: FedAvg" in line)
    fedavg = next(r for r in tables["upfl-table1"]
                  if (r["dataset"], r["method"], r["split"]) == ("mnist", "FedAvg", "test"))
    assert f"{fedavg['mean']:.2f}" in mnist_fedavg
    docs = tmp_path / "docs"
    (docs / "results").mkdir(parents=True)
    (docs / "results" / "upfl-table1.json").write_text(json.dumps([row("FedAvg", 99.0) | {"experiment": "upfl-table1"}]))
    report = write_report(docs).read_text()
    status = (docs / STATUS_PAGE).read_text()
    assert "## Reproduction status" not in report and "## upfl-table1" in report  # the page opens with the tables
    assert "| #2 | UPFL Table 1 MNIST: FedAvg new clients >= paper 94.69 - 2 | met |" in status


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_").replace(" ", "-")


def test_diagnosis_links_resolve_and_show_only_while_not_met() -> None:
    for c in CRITERIA:
        if not c.diagnosis:
            continue
        page, _, anchor = c.diagnosis.partition("#")
        headings, fenced = set(), False
        for line in (REPO / "docs" / page).read_text().splitlines():
            fenced ^= line.startswith("```")  # a '# comment' in a code block is no heading
            if line.startswith("#") and not fenced:
                headings.add(_anchor(line.lstrip("#")))
        assert not anchor or anchor in headings, f"{c.text}: no heading #{anchor} in {page}"
    failing = Criterion(9, "t", at_least("x", "mnist", "A", 5.0), "research/x.md")
    met = Criterion(9, "t", at_least("x", "mnist", "A", 1.0), "research/x.md")
    results = {"x": [row("A", 2.0)]}
    assert "| not met ([why](research/x.md)) |" in status_section(results, [failing])
    assert "| met |" in status_section(results, [met]) and "[why]" not in status_section(results, [met])


def test_criterion_is_a_plain_record() -> None:
    c = Criterion(9, "t", at_least("x", "mnist", "A", 1.0))
    assert c.check({"x": [row("A", 2.0)]}).status == "met"


def test_sdk_parity_reads_the_edge_sdk_rows() -> None:
    def parity(what: str, value: float, **extra) -> dict:
        return {"benchmark": "edge-sdk", "what": what, "metric": "accuracy_diff_points_sdk_minus_torch",
                "value": value, **extra}
    check = sdk_parity("new-client parity SDK vs torch, FedTTA++ mnist")
    rows = [parity("new-client parity SDK vs torch, FedTTA++ mnist seed 0", 0.0),
            parity("new-client parity SDK vs torch, FedTTA++ mnist seed 1", -0.1, protocol_rounds=5),
            parity("new-client parity SDK vs torch, FedTTA++ digits seed 0", 3.0)]  # another data set: not read
    verdict = check({SDK_BENCHMARK: rows})
    assert verdict.status == "met" and "seed 1 (5-round run): -0.100" in verdict.measured
    rows.append(parity("new-client parity SDK vs torch, FedTTA++ mnist seed 2", 0.101))
    assert check({SDK_BENCHMARK: rows}).status == "not met"  # any run outside the tolerance fails
    assert check({}).status == "missing"


def test_vmap_engine_reads_speedup_and_parity_of_its_device() -> None:
    def bench(device: str, value: float, f64: float = 1e-12, f32: float = 1e-8, **short) -> dict:
        return {"benchmark": "vmap-engine", "what": "FedTTA round, MLP 2x200", "metric": "speedup", "value": value,
                "device": device, "max_abs_diff_float64": f64, "max_abs_diff_float32": f32, **short}
    check = vmap_engine("FedTTA round, MLP 2x200", "cuda", 10.0)
    assert check({VMAP_BENCHMARK: [bench("cpu:2 threads", 50.0)]}).status == "missing"  # not a GPU row
    assert check({VMAP_BENCHMARK: [bench("cuda:H200", 9.9)]}).status == "not met"
    assert check({VMAP_BENCHMARK: [bench("cuda:H200", 40.0, f64=2e-10)]}).status == "not met"
    # FedTTA's short-horizon float32 parity replaces the 20-iteration one when the row has it
    short = bench("cuda:H200", 40.0, f32=3e-3, max_abs_diff_float32_5_iterations=4e-8)
    verdict = check({VMAP_BENCHMARK: [short]})
    assert verdict.status == "met" and "float32 diff 4.0e-08 (after 1 and 5 local iterations)" in verdict.measured
    assert check({VMAP_BENCHMARK: [bench("cuda:H200", 40.0, f32=3e-3)]}).status == "not met"


def test_report_feeds_the_edge_sdk_benchmark_to_the_verdicts(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "results").mkdir(parents=True)
    (docs / "benchmarks").mkdir()
    (docs / "benchmarks" / "edge-sdk.json").write_text(json.dumps([
        {"benchmark": "edge-sdk", "what": "new-client parity SDK vs torch, TENT mnist seed 0",
         "metric": "accuracy_diff_points_sdk_minus_torch", "value": 0.5}]))
    write_report(docs)
    report = (docs / STATUS_PAGE).read_text()
    assert "| #7 | edge_sdk new-client parity with torch within 0.1 point: TENT MNIST | not met |" in report
    assert "| #7 | edge_sdk new-client parity with torch within 0.1 point: TENT Fashion-MNIST | missing |" in report


def test_committed_results_md_is_current(tmp_path: Path) -> None:
    """docs/RESULTS.md is what `python -m lab report` writes from the committed tables and benchmarks (a table or
    benchmark committed without regenerating it fails here)."""
    import shutil

    docs = tmp_path / "docs"
    for sub in ("results", "benchmarks"):
        shutil.copytree(REPO / "docs" / sub, docs / sub, ignore=shutil.ignore_patterns("raw"))
    regenerated = write_report(docs).read_text()
    assert regenerated == (REPO / "docs" / "RESULTS.md").read_text(), "run `python -m lab report` and commit docs/RESULTS.md"
    for page in (DETAIL_PAGE, STATUS_PAGE):
        assert (docs / page).read_text() == (REPO / "docs" / page).read_text(), \
            f"run `python -m lab report` and commit docs/{page}"


def test_results_md_is_a_page_a_person_reads() -> None:
    """docs/RESULTS.md stays under 500 lines: one compact table per experiment with each data set's command once;
    every row's note and the probe tables are on the research page, the tracker-keyed checklist on its own."""
    text = (REPO / "docs" / "RESULTS.md").read_text()
    assert len(text.splitlines()) < 500
    assert "## Reproduction status" not in text and "| #" not in text
    assert "## probe:" not in text and "## probe:" in (REPO / "docs" / DETAIL_PAGE).read_text()
    table1 = text[text.index("## upfl-table1"):text.index("## btgfl")]
    assert table1.count("`python -m lab bench upfl-table1 --dataset mnist") == 1  # the command once, not per row
