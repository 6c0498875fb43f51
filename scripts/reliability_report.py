"""Reliability report: run the fault-injection and bad-input tests, record what each injected and what
happened, and render ``docs/reliability.md`` from every ``docs/reliability/*.json`` and ``*.md``.

    python scripts/reliability_report.py            # run the checks, write faults.json + bad-inputs.json, render
    python scripts/reliability_report.py --render   # only render docs/reliability.md from what is there

The tests append one JSON line per passed case to ``$FL_RELIABILITY_LOG`` (edge_sdk/tests/reliability_log.py);
a failed test leaves no line and is listed as not survived. Other files in docs/reliability/ (e.g. fuzz.json,
api.md from other checks) are rendered too: one section per file.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "reliability"
FAULT_TESTS = ["tests/test_faults.py", "tests/test_edge_client.py", "edge_sdk/tests/test_signed_bundles.py",
               "tests/test_update_channel.py", "tests/test_tls.py"]
BAD_INPUT_TESTS = ["edge_sdk/tests/test_bad_inputs.py"]
COMMAND = "python scripts/reliability_report.py"


def run_tests(paths: list[str], log: Path, junit: Path) -> dict[str, str]:
    """Run pytest on ``paths`` with the reliability log on; returns {test id: passed|failed|skipped}."""
    env = {**os.environ, "FL_RELIABILITY_LOG": str(log), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "edge_sdk"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *paths],
                   cwd=REPO, env=env, check=False)
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        status = "failed" if case.find("failure") is not None or case.find("error") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = status
    return outcomes


def _records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def faults_json(records: list[dict[str, Any]], outcomes: dict[str, str]) -> dict[str, Any]:
    cases = [{"category": r["category"], "fault": r["case"], "injected": r["injected"], "survived": r["injected"],
              "outcome": r["outcome"], "test": r["test"]} for r in records]
    failed = sorted(t for t, s in outcomes.items() if s == "failed")
    cases += [{"category": "failed test", "fault": t, "injected": 1, "survived": 0, "outcome": "FAILED", "test": t}
              for t in failed]
    return {"generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": COMMAND,
            "summary": {"faults_injected": sum(c["injected"] for c in cases),
                        "survived": sum(c["survived"] for c in cases), "cases": len(cases),
                        "tests_passed": sum(s == "passed" for s in outcomes.values()), "tests_failed": len(failed),
                        "lost_or_half_written": 0 if not failed else None,
                        "tests": FAULT_TESTS},
            "cases": cases}


def bad_inputs_json(records: list[dict[str, Any]], outcomes: dict[str, str]) -> dict[str, Any]:
    cases = [{"runner": r.get("runner", ""), "input": r["case"], "outcome": r["outcome"]} for r in records]
    failed = sorted(t for t, s in outcomes.items() if s == "failed")
    cases += [{"runner": "?", "input": t, "outcome": "FAILED (unexpected behaviour)"} for t in failed]
    errors = sum(c["outcome"].startswith("ValueError") for c in cases)
    return {"generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": COMMAND,
            "summary": {"inputs_tried": len(cases), "clear_value_errors": errors,
                        "defined_behaviour": len(cases) - errors - len(failed), "unexpected": len(failed),
                        "runners": sorted({c["runner"] for c in cases}), "tests": BAD_INPUT_TESTS},
            "cases": cases}


# ------------------------------------------------------------------ rendering
def _cell(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v)
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 240 else text[:237] + "..."


def _table(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return out


def render_json(data: Any) -> list[str]:
    """Any JSON: a list of objects is a table; an object's scalars are a list, its lists of objects tables."""
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return _table(data)
    if not isinstance(data, dict):
        return ["```json", json.dumps(data, indent=1)[:5000], "```"]
    out: list[str] = []
    for key, value in data.items():
        if isinstance(value, (dict, list)) and out and out[-1] != "":
            out.append("")  # a paragraph break before a block
        if isinstance(value, dict):
            out += [f"**{key}**", ""] + [f"- {k}: {_cell(v)}" for k, v in value.items()] + [""]
        elif isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            out += [f"**{key}** ({len(value)})", ""] + _table(value) + [""]
        else:
            out.append(f"- {key}: {_cell(value)}")
    return out


def _demote(md: str) -> list[str]:
    return [("##" + line) if line.startswith("#") else line for line in md.splitlines()]


def render(out_dir: Path = OUT, target: Path | None = None) -> Path:
    target = target or out_dir.parent / "reliability.md"
    lines = ["# Reliability", "",
             "Generated by `python scripts/reliability_report.py` (runs the checks, then renders) or "
             "`python scripts/reliability_report.py --render` (renders what is in `docs/reliability/`). One section "
             "per file of `docs/reliability/`: faults injected into real processes and what survived them "
             "(`faults.json`), bad input tried on every device runner and the outcome (`bad-inputs.json`), and "
             "whatever other checks put there.", "",
             "Run with the development environment: `PYTHONPATH=$PWD:$PWD/edge_sdk FL_DATA_DIR=../shared/data "
             "OMP_NUM_THREADS=1 .venv/bin/python scripts/reliability_report.py`.", ""]
    files = sorted(p for p in out_dir.glob("*") if p.suffix in (".json", ".md"))
    for path in files:
        lines += [f"## {path.stem} (`docs/reliability/{path.name}`)", ""]
        if path.suffix == ".md":
            lines += _demote(path.read_text()) + [""]
            continue
        try:
            lines += render_json(json.loads(path.read_text())) + [""]
        except json.JSONDecodeError as exc:
            lines += [f"(not valid JSON: {exc})", ""]
    if not files:
        lines.append("No results yet: run the command above.")
    target.write_text("\n".join(lines).rstrip() + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render", action="store_true", help="only render docs/reliability.md")
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    status = 0
    if not args.render:
        with tempfile.TemporaryDirectory() as tmp:
            for name, tests, build in (("faults", FAULT_TESTS, faults_json),
                                       ("bad-inputs", BAD_INPUT_TESTS, bad_inputs_json)):
                log, junit = Path(tmp) / f"{name}.jsonl", Path(tmp) / f"{name}.xml"
                outcomes = run_tests(tests, log, junit)
                data = build(_records(log), outcomes)
                (OUT / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
                print(f"{name}: {json.dumps(data['summary'])}")
                status |= int(any(s == "failed" for s in outcomes.values()))
    print(f"wrote {render()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
