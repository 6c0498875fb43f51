"""The docs describe the software, not the history of its making: no machine-specific paths and no numbered
work logs ("session 12", "issue 5" as history) in the README, anywhere under docs/ (results notes and
benchmark rows included, since they are rendered into docs/RESULTS.md), or in the code and its comments."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".md", ".txt", ".json", ".log", ".tsv"}
CODE_SUFFIXES = {".py", ".sh"}

FORBIDDEN = {
    "machine-specific path": re.compile(r"(?<![\w.])/(?:work|tmp|root)/"),
    "numbered work log": re.compile(r"\bsessions? #?\d+\b", re.IGNORECASE),
    "issue number as history": re.compile(r"\bissues? #?\d+\b", re.IGNORECASE),
}


def _tracked(*pathspecs: str) -> list[Path]:
    """The files git tracks under ``pathspecs`` (a walk of them when git is unavailable)."""
    try:
        listed = subprocess.run(["git", "ls-files", *pathspecs], cwd=REPO, capture_output=True, text=True,
                                check=True, timeout=60).stdout.split()
        return [REPO / p for p in listed if (REPO / p).is_file()]
    except (OSError, subprocess.SubprocessError):
        roots = [REPO / p for p in pathspecs]
        return [f for r in roots for f in ([r] if r.is_file() else r.rglob("*")) if f.is_file()]


def _doc_files() -> list[Path]:
    """README.md and every text file under docs/."""
    return [p for p in _tracked("README.md", "docs") if p.suffix in TEXT_SUFFIXES or p.name == "README.md"]


def _code_files() -> list[Path]:
    """Every Python and shell file but this test (whose examples are the patterns themselves)."""
    return [p for p in _tracked(".") if p.suffix in CODE_SUFFIXES and p != Path(__file__).resolve()]


def offences(text: str, kinds: tuple[str, ...] = tuple(FORBIDDEN)) -> list[str]:
    """Every forbidden pattern of ``kinds`` in ``text`` as ``"kind at line N: ..."``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind in kinds:
            pattern = FORBIDDEN[kind]
            if (m := pattern.search(line)) is not None:
                found.append(f"{kind} at line {number}: ...{line[max(0, m.start() - 40):m.end() + 40]}...")
    return found


def _assert_clean(files: list[Path], kinds: tuple[str, ...] = tuple(FORBIDDEN)) -> None:
    found = {str(p.relative_to(REPO)): hits for p in files if (hits := offences(p.read_text(errors="replace"), kinds))}
    assert not found, "\n".join(f"{path}: {hit}" for path, hits in found.items() for hit in hits[:5])


def test_patterns_catch_what_they_should() -> None:
    assert offences("run with --data-dir /work/shared/data") and offences("at fixes in session 21 we")
    assert offences("the target of issue 3 (98.0)") and offences("see Session #4")
    assert not offences("one trained store per session; runs/bench/x; ../shared/data; docs/tmp/x")


def test_docs_have_no_machine_paths_or_work_logs() -> None:
    files = _doc_files()
    assert any(p.name == "RESULTS.md" for p in files) and any(p.name == "architecture.md" for p in files)
    _assert_clean(files)


def test_code_and_comments_have_no_machine_paths_or_work_logs() -> None:
    """Code may name the issue a test verifies (a reference, not a log); paths and session logs never."""
    files = _code_files()
    assert any(p.name == "report.py" for p in files)
    _assert_clean(files, ("machine-specific path", "numbered work log"))


REPO_PATH = re.compile(r"(?<![\w/.-])((?:scripts|docs|fl_server|export|edge_sdk|benchmarks|examples|tests)/"
                       r"[\w./-]*\w\.(?:py|sh|md|json|txt|tsv|png|log))")


def test_written_docs_name_only_files_that_exist() -> None:
    """A moved file leaves no stale path in the README or the hand-written docs (RESULTS.md and the research
    page's detail are generated from the result files and the experiment registry)."""
    generated = {REPO / "docs" / "RESULTS.md", REPO / "docs" / "research" / "results-detail.md"}
    written = [p for p in _doc_files() if p.suffix == ".md" and p not in generated]
    missing = [f"{p.relative_to(REPO)}: {m.group(1)}" for p in written for m in REPO_PATH.finditer(p.read_text())
               if not (REPO / m.group(1)).exists()]
    assert not missing, "\n".join(missing)
