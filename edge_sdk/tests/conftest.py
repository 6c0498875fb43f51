"""The SDK's own tests run in a venv with only ``pip install ./edge_sdk`` (plus pytest): no torch.

Bundles and torch reference outputs come from ``python edge_sdk/tests/sdk_fixture.py DIR`` (run with the
coordinator's environment), named by ``EDGE_SDK_FIXTURE=DIR``; in the full development environment the fixture
is built on the fly instead."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SHARED_DATA = Path(os.environ.get("FL_DATA_DIR")  # $FL_DATA_DIR first, as tests/conftest.py reads it
                   or Path(__file__).resolve().parents[2].parent / "shared" / "data")


@pytest.fixture(scope="session")
def sdk_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("EDGE_SDK_FIXTURE")
    if given:
        path = Path(given)
        if not (path / "reference.npz").is_file():
            pytest.fail(f"EDGE_SDK_FIXTURE={given} holds no reference.npz; run "
                        f"`python edge_sdk/tests/sdk_fixture.py {given}`")
        return path
    if importlib.util.find_spec("torch") is None:
        pytest.skip("no EDGE_SDK_FIXTURE given and no torch here to build one "
                    "(python edge_sdk/tests/sdk_fixture.py DIR)")
    from sdk_fixture import make_sdk_fixture  # beside this file (torch, fl_server)

    root = str(SHARED_DATA) if (SHARED_DATA / "mnist").is_dir() else None
    return make_sdk_fixture(tmp_path_factory.mktemp("sdk-fixture"), root)
