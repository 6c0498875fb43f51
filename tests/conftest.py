"""Shared fixtures: the real data in ``$FL_DATA_DIR``, else ../shared/data beside the checkout (skip with a clear
reason where it is absent), and a coordinator store with trained bundles for the API tests (trained once per
session). ``make test-fast`` deselects the tests marked ``slow``: those :data:`SLOW_TESTS` lists and any marked
``@pytest.mark.slow`` in its own file."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BESIDE_CHECKOUT = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SHARED_DATA = Path(os.environ.get("FL_DATA_DIR") or BESIDE_CHECKOUT)  # $FL_DATA_DIR first, as the README says
sys.path.append(str(Path(__file__).resolve().parents[1] / "edge_sdk" / "tests"))  # reliability_log, RFC vectors
if SHARED_DATA.is_dir() and not os.environ.get("FL_DATA_DIR"):
    # code under test that resolves data by itself (harness runs, subprocesses) sees the same files as the
    # fixtures, also when `make test` runs without FL_DATA_DIR (.ci/run sets it)
    os.environ["FL_DATA_DIR"] = str(SHARED_DATA)


def _have(sub: str) -> bool:
    return (SHARED_DATA / sub / "train-images-idx3-ubyte.gz").is_file()


SLOW_TESTS = Path(__file__).with_name("slow_tests.txt")  # node ids of the tests over ~5 s, a line each


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` the tests :data:`SLOW_TESTS` lists (a file, or FILE::test_name with all its parameters)."""
    listed = [line.split("#")[0].strip() for line in SLOW_TESTS.read_text().splitlines()]
    listed = [entry for entry in listed if entry]
    root = Path(str(config.rootpath))
    for entry in listed:
        if not (root / entry.split("::")[0]).is_file():
            raise pytest.UsageError(f"{SLOW_TESTS.name} lists {entry}, which is not a test file here: correct or "
                                    f"remove the line")
    for item in items:
        if any(item.nodeid == e or item.nodeid.startswith((e + "::", e + "[")) for e in listed):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def data_root() -> Path:
    if not _have("mnist"):
        pytest.skip(f"real MNIST not found in {SHARED_DATA} (the shared data folder is absent)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def mnist_all(data_root: Path):  # type: ignore[no-untyped-def]
    from fl_server.data import load_dataset

    return load_dataset("mnist", root=data_root, split="all")


@pytest.fixture(scope="session")
def fashion_all(data_root: Path):  # type: ignore[no-untyped-def]
    from fl_server.data import load_dataset

    if not _have("fashion-mnist"):
        pytest.skip(f"real Fashion-MNIST not found in {SHARED_DATA}")
    return load_dataset("fashion_mnist", root=data_root, split="all")


@pytest.fixture(scope="session")
def trained_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A coordinator store with TENT and ODPFL-HN bundles; copy it (coordinator_proc.start_copy) to serve."""
    from coordinator_proc import train_store

    return train_store(tmp_path_factory.mktemp("trained") / "store")
