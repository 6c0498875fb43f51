"""benchmarks/peer_fedavg.py (docs/benchmarks/peer-fedavg.json): this engine and a self-contained Flower app on
Flower's simulation engine train the same FedAvg work to about the same test accuracy; the peer app imports
nothing of fl-edge."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PEER_APP = REPO / "benchmarks" / "peer" / "flower_fedavg_app.py"


def test_peer_app_imports_nothing_of_ours() -> None:
    tree = ast.parse(PEER_APP.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    roots = {name.split(".")[0] for name in names}
    assert not roots & {"fl_server", "edge_sdk"}, sorted(roots)
    assert {"flwr", "torch", "numpy"} <= roots


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_peer_benchmark_smoke(tmp_path: Path, data_root: Path) -> None:
    """The smoke size (4 clients, 4 rounds of 20 steps) with the peer on this venv's flwr (the full run creates
    a venv of its own): both sides train, are timed, and end within 3 points of each other on MNIST's test set."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs Ray (pip install 'flwr[simulation]')")
    out = tmp_path / "peer.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "peer_fedavg.py"), "--smoke", "--python",
                    sys.executable, "--data-dir", str(data_root), "--out", str(out)],
                   check=True, capture_output=True, timeout=550, cwd=tmp_path)
    [row] = json.loads(out.read_text())
    engine, peer = row["engine"], row["flower_simulation"]
    assert engine["rounds_timed"] == peer["rounds_timed"] == 3
    assert engine["median_s_per_round"] > 0 and peer["median_s_per_round"] > 0 and row["value"] > 0
    assert engine["test_accuracy"] > 0.7 and peer["test_accuracy"] > 0.7, (engine, peer)
    assert abs(row["test_accuracy_diff_points"]) <= 3.0, row
    assert peer["versions"]["flwr"] == "1.42.0"
