"""CI profile of the API fuzzing (tests/api_fuzz.py): a few hundred schemathesis cases against a real
coordinator process, with a fixed seed. The long profile is ``scripts/fuzz_api.py``."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api_fuzz import NO_LIMITS, fuzz_coordinator
from coordinator_proc import ADMIN, Coordinator, start_copy

pytestmark = pytest.mark.timeout(600)
EXAMPLES = int(os.environ.get("FL_FUZZ_EXAMPLES", "12"))  # per operation and mode


@pytest.fixture(scope="module")
def server(trained_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    coord = start_copy(trained_store, tmp_path_factory.mktemp("fuzz") / "store", env=NO_LIMITS)
    yield coord
    coord.stop()


def test_fuzz_ci_profile(server: Coordinator) -> None:
    report = fuzz_coordinator(server.url, ADMIN, max_examples=EXAMPLES, seed=0)
    print(f"fuzz CI profile: {sum(report.cases.values())} cases, {len(report.failures)} failures, "
          f"{report.seconds:.1f} s")
    assert not report.failures, "\n\n".join(report.failures)
    paths = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    assert set(report.cases) == {f"{m.upper()} {p}" for p, ops in paths.items() for m in ops}  # all exercised
    assert sum(report.cases.values()) >= 10 * EXAMPLES
    assert (report.server_5xx, report.jobs_created) == (0, 0)  # the server's own count agrees
