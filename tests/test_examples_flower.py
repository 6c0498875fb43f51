"""examples/flower_devices.py at its smoke size: three SuperNodes, each holding only its own Fashion-MNIST image
folder, train FedTTA and BTFL on Flower; both runs are exported and published to a coordinator of the example's own;
the fourth node's images personalise each bundle on a device process that imports neither torch nor fl_server.
About a minute on a shared 2-core machine (two Flower runs, most of each Flower's 3 s SuperNode polls)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install 'fl-edge[flower]')")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flower_devices_example_trains_publishes_and_a_new_device_personalises(tmp_path: Path,
                                                                               data_root: Path) -> None:
    out = tmp_path / "device.json"
    env = {**os.environ, "FL_DATA_DIR": str(data_root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "flower_devices.py"), "--smoke", "--work",
                           str(tmp_path / "work"), "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for method in ("FedTTA", "BTFL"):
        assert f"{method} on Flower, 3 SuperNodes" in proc.stdout and "3/3 nodes replied" in proc.stdout
        assert json.loads((tmp_path / "work" / f"run-{method}" / "run.json").read_text())["method"] == method
        assert f"{method}: exported and published as bundle" in proc.stdout
    summary = json.loads(out.read_text())
    assert summary["torch_imported"] is False and summary["fl_server_imported"] is False
    results = {r["method"]: r for r in summary["results"]}
    assert set(results) == {"FedTTA", "BTFL"}
    for r in results.values():
        assert r["accuracy_personalized"] > 20.0, r  # chance: 10%
    # FedTTA's declared safeguard (rollback) keeps the received model, so nothing is adapted; BTFL fits its head
    fedtta = results["FedTTA"]
    assert fedtta["steps"] == 0 and fedtta["safeguard"] == "received", fedtta
    assert fedtta["accuracy_personalized"] == fedtta["accuracy_received"]
    assert results["BTFL"]["steps"] >= 1 and results["BTFL"]["safeguard"] is None
