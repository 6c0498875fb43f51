"""The docs describe the software, not the history of its making: no machine-specific paths and no numbered
work logs ("session 12", "issue 5" as history) in the README or anywhere under docs/ (results notes and
benchmark rows included, since they are rendered into docs/RESULTS.md)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".md", ".txt", ".json", ".log", ".tsv"}

FORBIDDEN = {
    "machine-specific path": re.compile(r"(?<![\w.])/(?:work|tmp|root)/"),
    "numbered work log": re.compile(r"\bsessions? #?\d+\b", re.IGNORECASE),
    "issue number as history": re.compile(r"\bissues? #?\d+\b", re.IGNORECASE),
}


def _doc_files() -> list[Path]:
    """README.md and every text file under docs/ that git tracks (every such file when git is unavailable)."""
    try:
        listed = subprocess.run(["git", "ls-files", "README.md", "docs"], cwd=REPO, capture_output=True, text=True,
                                check=True, timeout=60).stdout.split()
        paths = [REPO / p for p in listed]
    except (OSError, subprocess.SubprocessError):
        paths = [REPO / "README.md", *(REPO / "docs").rglob("*")]
    return [p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name == "README.md")]


def offences(text: str) -> list[str]:
    """Every forbidden pattern in ``text`` as ``"kind: line"``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in FORBIDDEN.items():
            if (m := pattern.search(line)) is not None:
                found.append(f"{kind} at line {number}: ...{line[max(0, m.start() - 40):m.end() + 40]}...")
    return found


def test_patterns_catch_what_they_should() -> None:
    assert offences("run with --data-dir /work/shared/data") and offences("at fixes in session 21 we")
    assert offences("the target of issue 3 (98.0)") and offences("see Session #4")
    assert not offences("one trained store per session; runs/bench/x; ../shared/data; docs/tmp/x")


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_have_no_machine_paths_or_work_logs(path: Path) -> None:
    found = offences(path.read_text(errors="replace"))
    assert not found, f"{path.relative_to(REPO)}:\n" + "\n".join(found[:10])
