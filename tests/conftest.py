"""Shared fixtures: the real data in ../shared/data (skip with a clear reason where it is absent), and a
coordinator store with trained bundles for the API tests (trained once per session)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
sys.path.append(str(Path(__file__).resolve().parents[1] / "edge_sdk" / "tests"))  # reliability_log, RFC vectors
if SHARED_DATA.is_dir() and not os.environ.get("FL_DATA_DIR"):
    # code under test that resolves data by itself (harness runs, subprocesses) sees the same files as the
    # fixtures, also when `make test` runs without FL_DATA_DIR (.ci/run sets it)
    os.environ["FL_DATA_DIR"] = str(SHARED_DATA)


def _have(sub: str) -> bool:
    return (SHARED_DATA / sub / "train-images-idx3-ubyte.gz").is_file()


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
