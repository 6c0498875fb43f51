"""``make test-fast`` skips only what ``make test`` skips: deselecting the slow tests never turns another test
into a skip, and a skip says what the machine lacks (CUDA, an extra, the data). The one way the lanes parted was
a test module that found MNIST by its own path beside the checkout instead of ``$FL_DATA_DIR``: run from a
checkout elsewhere it skipped 68 tests. No test file spells the data folder's path without reading
``$FL_DATA_DIR`` first (the conftest's ``data_root`` fixture does; use it)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_DIRS = (REPO / "tests", REPO / "edge_sdk" / "tests", REPO / "lab" / "tests")
EXEMPT = {Path(__file__).resolve(), REPO / "tests" / "test_docs_hygiene.py"}  # their data paths are samples
DATA_PATH = re.compile(r"""["']shared["']\s*/\s*["']data["']|["'][^"'\n]*shared/data""")


def _ignores_fl_data_dir(source: str) -> bool:
    """Whether ``source`` builds the shared data folder's path and never reads ``$FL_DATA_DIR``."""
    return DATA_PATH.search(source) is not None and "FL_DATA_DIR" not in source


def test_the_scan_sees_a_data_path_that_ignores_fl_data_dir() -> None:
    hardcoded = 'MNIST = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist"\n'
    assert _ignores_fl_data_dir(hardcoded) and _ignores_fl_data_dir('ROOT = Path("../shared/data/mnist")\n')
    assert not _ignores_fl_data_dir('DATA = Path(os.environ.get("FL_DATA_DIR") or BESIDE / "shared" / "data")\n')
    assert not _ignores_fl_data_dir("def mnist(data_root):  # ../shared/data through the fixture\n")


def test_no_test_finds_the_data_past_fl_data_dir() -> None:
    files = [p for d in TEST_DIRS for p in sorted(d.rglob("*.py"))]
    assert REPO / "tests" / "conftest.py" in files
    offenders = [str(p.relative_to(REPO)) for p in files if p not in EXEMPT and _ignores_fl_data_dir(p.read_text())]
    assert offenders == [], "take the data_root fixture (tests/conftest.py: $FL_DATA_DIR first) instead"
