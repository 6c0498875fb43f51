"""The loopback Flower deployment of the tests and benchmarks (``examples/loopback_flower.py``) with the repository's
app folder, and each node's own Fashion-MNIST data.

Example:
    >>> with LocalDeployment(num_nodes=3, workdir=Path("runs/flower-local")) as dep:  # doctest: +SKIP
    ...     dep.run({"method": "FedAvg", "rounds": 3, "run-dir": "runs/flower-local/run"})
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))  # the loopback deployment lives beside the example that uses it
import loopback_flower as local  # noqa: E402
from loopback_flower import _wait_port as wait_port  # noqa: E402,F401  (the tests' import)
from loopback_flower import free_port  # noqa: E402,F401  (the tests' import)

APP_DIR = EXAMPLES / "flower"  # the app folder `flwr run` takes


def write_node_data(fashion, root: Path, nodes: int = 3, per_node: int = 120,  # type: ignore[no-untyped-def]
                    folders: int = 1) -> tuple[list[str], np.ndarray]:
    """Each node's own Fashion-MNIST samples (disjoint): the first ``folders`` nodes an image folder of PNGs (class
    folders named by label), the others arrays files (float32 NCHW in [0, 1], as the built-in recipe takes them).
    Returns the node-config ``data`` values (relative to ``root``) and each node's sample indices."""
    from PIL import Image

    idx = np.random.default_rng(1).permutation(len(fashion.y))[:nodes * per_node].reshape(nodes, per_node)
    sources = []
    for node, rows in enumerate(idx):
        if node < folders:
            for i in rows:
                folder = root / f"node{node}" / str(int(fashion.y[i]))
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(np.round(fashion.x[i, 0] * 255).astype(np.uint8)).save(folder / f"{i}.png")
            sources.append(f"node{node}")
        else:
            np.savez(root / f"node{node}.npz", x=fashion.x[rows], y=fashion.y[rows])
            sources.append(f"node{node}.npz")
    return sources, idx


class LocalDeployment(local.LocalDeployment):
    """:class:`loopback_flower.LocalDeployment` running the repository's app folder by default."""

    def run(self, run_config: dict[str, Any], app_dir: Path = APP_DIR, timeout: float = 600.0) -> str:
        return super().run(run_config, app_dir, timeout)

    def launch(self, run_config: dict[str, Any], app_dir: Path = APP_DIR, name: str = "run") -> subprocess.Popen:
        return super().launch(run_config, app_dir, name)


def processes_of(flwr_home: Path) -> list[str]:
    """The Flower processes (SuperExecs, ServerApp, ClientApps: flower-superexec's, fl_server.flower.superexec's and
    its forks) whose environment names ``flwr_home`` as its FLWR_HOME (one deployment's; other deployments on this
    machine are left out), each as "pid command" (what outlived a deployment, in a failure's message)."""
    found = subprocess.run(["pgrep", "-f", "superexec|flwr-serverapp|flwr-clientapp"], capture_output=True,
                           text=True).stdout.split()
    mine = []
    for pid in found:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(bytes(1), b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"FLWR_HOME={flwr_home}".encode() in env:
            mine.append(f"{pid} {command[:160]}")
    return mine
