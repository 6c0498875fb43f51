"""Distribution metadata: both wheels build without setuptools' license-deprecation banner, carry the
Apache-2.0 LICENSE, and the device SDK's wheel passes ``twine check --strict`` (readme, classifiers, URLs); the
coordinator's wheel holds the product only: no results lab, test fixture or test deployment."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


def _wheel(project: Path, out: Path) -> tuple[Path, str]:
    """Build ``project``'s wheel (no deps, the venv's setuptools: offline) into ``out``; (wheel, build log). It
    builds from a copy of the source tree: an in-tree build leaves a ``build/`` folder whose stale modules (a
    package since moved or deleted) would go into the next wheel built from the checkout."""
    ignore = shutil.ignore_patterns(".git", ".venv", ".peer-venv", "build", "runs", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".hypothesis")
    source = out / "source"
    shutil.copytree(REPO, source, ignore=ignore, symlinks=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(source / project.relative_to(REPO))], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], proc.stdout + proc.stderr


def test_license_files_are_apache_2() -> None:
    for path in (REPO / "LICENSE", REPO / "edge_sdk" / "LICENSE"):
        text = path.read_text()
        assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text, path
        assert "END OF TERMS AND CONDITIONS" in text, path


def test_edge_sdk_wheel_passes_twine_check(tmp_path: Path) -> None:
    wheel, log = _wheel(REPO / "edge_sdk", tmp_path)
    assert "deprecated" not in log.lower(), [line for line in log.splitlines() if "deprecated" in line.lower()]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta and "Classifier: " in meta and "Project-URL: " in meta
    assert "Description-Content-Type: text/markdown" in meta and "torch" not in meta.split("\n\n")[0]
    check = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheel)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "PASSED" in check.stdout, check.stdout + check.stderr


def test_coordinator_wheel_ships_the_product_only_with_license_and_docs_assets(tmp_path: Path) -> None:
    wheel, log = _wheel(REPO, tmp_path)
    assert "deprecated" not in log.lower(), [line for line in log.splitlines() if "deprecated" in line.lower()]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    for asset in ("swagger-ui/swagger-ui-bundle.js", "swagger-ui/swagger-ui.css", "swagger-ui/LICENSE",
                  "redoc/redoc.standalone.js", "redoc/LICENSE"):
        assert f"fl_server/service/static/{asset}" in names, asset
    packages = {n.split("/")[0] for n in names if not n.startswith("fl_edge-")}
    assert packages == {"fl_server"}, packages  # no lab/, tests/, benchmarks/, examples/
    modules = {n for n in names if n.endswith(".py")}
    leaked = {n for n in modules if "/bench/" in n or n.endswith(("sdk_fixture.py", "flower/local.py", "conftest.py"))
              or "/test_" in n}  # the harness, the SDK's test fixture, the loopback test deployment, tests
    assert not leaked, sorted(leaked)
    assert {"fl_server/cli.py", "fl_server/flower/task.py", "fl_server/export/run.py"} <= modules
