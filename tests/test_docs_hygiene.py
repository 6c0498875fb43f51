"""The docs describe the software, not the history of its making: no machine-specific paths and no numbered
work logs ("session 12", "issue 5" as history) in the README, anywhere under docs/ (results notes and
benchmark rows included, since they are rendered into docs/RESULTS.md), or in the code and its comments."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

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


# --- user docs: what a reader of a clone can follow -------------------------------------------------------------
# User docs are the READMEs and every Markdown page under docs/ but docs/research/ (the lab's notes, where work logs
# and machine descriptions belong). The package is the shipped Python of fl_server/, fl_server/export/ and edge_sdk/ (the lab,
# lab/, outside the package, may cite its sources).
README_MAX_LINES = 200
GENERATED_BY_LAB = "docs/RESULTS.md"  # written by `fl-server report`: checked on its own below
HASH = r"[0-9a-f]{7,40}"  # an abbreviated or full commit hash
CODE_HASH = rf"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9]){HASH}"  # in backticks: with a letter, so `20261122` is a seed
USER_DOC_FORBIDDEN = {
    "reference to a file outside the repository": re.compile(r"SPEC\.md|\bSPEC\b|\bseeds/"),
    "tracker number": re.compile(r"(?:^|[\s(\[])#\d+\b|\bissues? #?\d+\b", re.IGNORECASE),
    "commit-hash log": re.compile(rf"`{CODE_HASH}`|^\s*(?:[-*]\s+)?{HASH}\s+\w|\bcommits? {HASH}\b"),
    "machine-specific wording": re.compile(r"\bthis (?:shared )?(?:\d+-core )?(?:machine|host|vm|box)\b"
                                           r"|\b(?:measured|built and run) here\b", re.IGNORECASE),
}
CODE_SPAN = re.compile(r"`[^`]*`")


def user_doc_offences(text: str) -> list[str]:
    """Every forbidden pattern of USER_DOC_FORBIDDEN in ``text`` as ``"kind at line N: ..."``. Quoted program
    output (inline code) may say "this machine" (an error message speaks to its reader); hashes are looked for in
    code too."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in USER_DOC_FORBIDDEN.items():
            target = CODE_SPAN.sub("``", line) if kind == "machine-specific wording" else line
            if (m := pattern.search(target)) is not None:
                found.append(f"{kind} at line {number}: ...{target[max(0, m.start() - 40):m.end() + 40]}...")
    return found


def _user_docs() -> list[Path]:
    docs = [p for p in _tracked("README.md", "edge_sdk/README.md", "examples", "docs") if p.suffix == ".md"]
    return [p for p in docs if "research" not in p.relative_to(REPO).parts
            and p.relative_to(REPO).as_posix() != GENERATED_BY_LAB]


def _package_files() -> list[Path]:
    return [p for p in _tracked("fl_server", "edge_sdk/edge_sdk") if p.suffix == ".py"]


def test_user_doc_patterns_catch_what_they_should() -> None:
    bad = ["see SPEC.md section 2", "(seeds/btfl.txt)", "| #12 | UPFL Table 1 | met |", "as issue 39 asked",
           "measured at commit bc41e83 and", "`961836b` fixed the batcher", "0213424 fresh clone: make run ok",
           "not met on this shared 2-core machine", "Measured here (Docker 20.10)", "This machine reaches Debian"]
    assert all(user_doc_offences(line) for line in bad), [line for line in bad if not user_doc_offences(line)]
    good = ["PKCS#8 private key", "[References](#references)", "`--seed 20261122`", "`color:#222`",
            "sha256 `e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855`",
            "`on this machine: pass --recipe FILE.py:NAME`", "the spec variant", "opset 18 (#steps)"]
    assert not any(user_doc_offences(line) for line in good), [user_doc_offences(line) for line in good]


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference " \
                                      "text to docs/ (cli.md, recipes.md, methods.md, device.md, flower.md)"


def test_user_docs_are_clean() -> None:
    files = _user_docs()
    assert {"README.md", "docs/coordinator.md", "edge_sdk/README.md"} <= {p.relative_to(REPO).as_posix() for p in files}
    found = {str(p.relative_to(REPO)): hits for p in files if (hits := user_doc_offences(p.read_text()))}
    assert not found, "\n".join(f"{path}: {hit}" for path, hits in found.items() for hit in hits[:5])


def test_package_cites_papers_not_files_outside_the_repository() -> None:
    """Docstrings cite a paper by title, venue and arXiv id; a clone has no SPEC.md or seeds/ to look in."""
    files = _package_files()
    assert any(p.name == "fedtta.py" for p in files) and any(p.name == "_fedthe.py" for p in files)
    pattern = USER_DOC_FORBIDDEN["reference to a file outside the repository"]
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_generated_results_page_is_clean() -> None:
    hits = user_doc_offences((REPO / GENERATED_BY_LAB).read_text())
    assert not hits, "\n".join(hits[:10])
