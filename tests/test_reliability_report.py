"""scripts/reliability_report.py renders every docs/reliability/*.json and *.md, whoever wrote them."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "reliability_report.py"


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("reliability_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_renders_a_section_per_file(tmp_path: Path) -> None:
    report = _module()
    src = tmp_path / "reliability"
    src.mkdir()
    records = [{"category": "cache", "case": "artifact | flipped", "outcome": "refetched", "injected": 2, "test": "t"}]
    (src / "faults.json").write_text(json.dumps(report.faults_json(records, {"t": "passed", "u": "failed"})))
    (src / "fuzz.json").write_text(json.dumps([{"target": "join", "cases": 1000, "crashes": 0}]))
    (src / "api.md").write_text("# API checks\n\nEvery route answers 4xx on bad input.\n")
    (src / "broken.json").write_text("{")
    out = report.render(src, tmp_path / "reliability.md").read_text()
    assert [ln for ln in out.splitlines() if ln.startswith("## ")] == [
        "## api (`docs/reliability/api.md`)", "## broken (`docs/reliability/broken.json`)",
        "## faults (`docs/reliability/faults.json`)", "## fuzz (`docs/reliability/fuzz.json`)"]
    assert "### API checks" in out and "Every route answers" in out and "not valid JSON" in out
    assert "| join | 1000 | 0 |" in out and "artifact \\| flipped" in out  # tables, pipes escaped
    assert "- faults_injected: 3" in out and "- tests_failed: 1" in out and "| failed test | u |" in out
    assert "python scripts/reliability_report.py" in out


def test_committed_report_is_the_rendering_of_its_sources(tmp_path: Path) -> None:
    """docs/reliability.md is generated: an edit made there instead of in docs/reliability/ is lost at the next
    render (it happened once), so the committed file must equal a fresh render of the committed sources."""
    docs = SCRIPT.parents[1] / "docs"
    fresh = _module().render(docs / "reliability", tmp_path / "reliability.md").read_text()
    assert (docs / "reliability.md").read_text() == fresh
