"""Dependency confusion (issue #36, defect 15): installing the coordinator must take the device SDK from this
checkout's ``edge_sdk/`` folder and never ask a package index for it (on PyPI, ``edge-sdk`` is an unrelated
project). pip's own resolver proves it: ``pip install --dry-run --report`` with ``--ignore-installed`` (nothing
installed counts, as in a clean venv) and ``--no-index`` (any name pip wanted from an index would fail)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
SDK_NAME = "fl-edge-sdk"


def _dry_run(requirement: str, report: Path) -> dict:
    """What ``pip install <requirement>`` would install, resolved from scratch and offline (its own
    dependencies left out: they come from an index, and the question is only where the SDK comes from)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index", "--no-deps",
                    "--ignore-installed", "--no-build-isolation", "--report", str(report), requirement],
                   check=True, cwd=REPO, capture_output=True)
    (item,) = json.loads(report.read_text())["install"]
    return item


def test_the_coordinator_takes_the_sdk_from_the_local_path_only(tmp_path: Path) -> None:
    coordinator = _dry_run(str(REPO), tmp_path / "coordinator.json")
    requires = [Requirement(r) for r in coordinator["metadata"]["requires_dist"]]
    names = {canonicalize_name(r.name) for r in requires}
    assert "edge-sdk" not in names  # the unrelated project on PyPI
    (sdk,) = [r for r in requires if canonicalize_name(r.name) == SDK_NAME]
    assert sdk.url == (REPO / "edge_sdk").as_uri() and not sdk.specifier  # a direct reference, not a name
    assert all(r.url is None for r in requires if r is not sdk)  # the others come from an index as usual

    resolved = _dry_run(str(sdk), tmp_path / "sdk.json")  # the requirement exactly as the coordinator states it
    assert resolved["metadata"]["name"] == SDK_NAME
    assert resolved["download_info"] == {"url": (REPO / "edge_sdk").as_uri(), "dir_info": {}}
