"""FedAvg on MNIST as a Flower user writes it: a self-contained Flower app (flwr, torch and numpy only; it
imports nothing of fl-edge), run on Flower's simulation engine. The peer side of benchmarks/peer_fedavg.py,
which runs it in a venv of its own and gives it the same work as the in-process engine:

* ``--work FILE.npz`` (written by peer_fedavg.py, no pickles): the initial weights (``init_0`` ... in the MLP's
  ``state_dict`` order), each client's training indices into MNIST's training split (``part_indices`` cut at
  ``part_offsets``), and ``rounds``, ``local_iterations``, ``batch_size``, ``lr``, ``seed``;
* ``--data-dir DIR``: MNIST's IDX files under ``DIR/mnist`` (``.gz`` or not), scaled to [0, 1] like the engine.

The ServerApp runs Flower's own ``FedAvg`` strategy (every client every round, weighted by its sample count,
no client-side evaluation); the ClientApp loads the global weights, takes ``local_iterations`` plain SGD steps
of ``batch_size`` on cross-entropy over successive random permutations of its partition, and replies with its
weights. The server's ``evaluate_fn``, which Flower calls before the first round and after every round,
timestamps the rounds and tests the final model on MNIST's t10k set. Writes ``--out`` (JSON).

    python flower_fedavg_app.py --work work.npz --data-dir data --out peer.json --cpus 2
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch import nn

WORK_ENV = "PEER_FEDAVG_WORK"  # how the Ray workers find the work file and the data (set before Ray starts)
DATA_ENV = "PEER_FEDAVG_DATA"
_CACHE: dict[str, object] = {}  # per process: a Ray worker serves many clients, it loads the data once


def net() -> nn.Module:
    """The MLP 784-200-200-10 (ReLU)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
                         nn.Linear(200, 10))


def read_idx(data_dir: str, name: str) -> np.ndarray:
    """One MNIST IDX file as uint8 (images [N, 28, 28], labels [N])."""
    base = Path(data_dir) / "mnist" / name
    path = base if base.exists() else base.with_name(name + ".gz")
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def mnist(data_dir: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = "train" if split == "train" else "t10k"
    x = read_idx(data_dir, f"{prefix}-images-idx3-ubyte").astype(np.float32)[:, None] / np.float32(255.0)
    y = read_idx(data_dir, f"{prefix}-labels-idx1-ubyte").astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def work() -> dict[str, np.ndarray]:
    if "work" not in _CACHE:
        with np.load(os.environ[WORK_ENV], allow_pickle=False) as f:
            _CACHE["work"] = {k: f[k] for k in f.files}
    return _CACHE["work"]  # type: ignore[return-value]


def client_data(pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    if "train" not in _CACHE:
        _CACHE["train"] = mnist(os.environ[DATA_ENV], "train")
    x, y = _CACHE["train"]  # type: ignore[misc]
    w = work()
    idx = torch.from_numpy(w["part_indices"][w["part_offsets"][pid]:w["part_offsets"][pid + 1]])
    return x[idx], y[idx]


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    """Local SGD from the global weights on this node's partition."""
    torch.set_num_threads(1)  # one Ray actor per CPU
    pid = int(context.node_config["partition-id"])
    w = work()
    x, y = client_data(pid)
    model = net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=float(w["lr"]))
    steps, batch = int(w["local_iterations"]), int(w["batch_size"])
    rng = np.random.default_rng([int(w["seed"]), int(msg.content["config"]["server-round"]), pid])
    need = steps * batch
    order = np.concatenate([rng.permutation(len(y)) for _ in range(-(-need // len(y)))])[:need]
    for t in range(steps):
        b = torch.from_numpy(order[t * batch:(t + 1) * batch])
        loss = nn.functional.cross_entropy(model(x[b]), y[b])
        opt.zero_grad()
        loss.backward()
        opt.step()
    reply = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                        "metrics": MetricRecord({"train_loss": float(loss), "num-examples": len(y)})})
    return Message(content=reply, reply_to=msg)


server = ServerApp()
STAMPS: list[float] = []  # perf_counter when evaluate_fn is entered: before round 1, after each round
RESULT: dict[str, object] = {}


@server.main()
def main(grid: Grid, context: Context) -> None:
    w = work()
    clients, rounds = len(w["part_offsets"]) - 1, int(w["rounds"])
    model = net()
    model.load_state_dict({k: torch.from_numpy(w[f"init_{i}"]) for i, k in enumerate(model.state_dict())})
    x_test, y_test = mnist(os.environ[DATA_ENV], "test")

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        STAMPS.append(time.perf_counter())
        if server_round < rounds:
            return None
        model.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            acc = float((model(x_test).argmax(1) == y_test).double().mean())
        RESULT["test_accuracy"] = acc
        return MetricRecord({"accuracy": acc})

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients,
                      min_available_nodes=clients)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
                   train_config=ConfigRecord({}), evaluate_fn=evaluate)


def run(argv: list[str] | None = None) -> None:
    """Run the simulation and write its timings and test accuracy."""
    from flwr.simulation import run_simulation

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpus", type=int, default=2, help="Ray's CPUs: one ClientApp actor per CPU")
    args = ap.parse_args(argv)
    os.environ[WORK_ENV], os.environ[DATA_ENV] = str(Path(args.work).resolve()), str(Path(args.data_dir).resolve())
    here = str(Path(__file__).resolve().parent)  # Ray workers import this module by name
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    torch.set_num_threads(1)
    clients = len(work()["part_offsets"]) - 1
    t0 = time.perf_counter()
    run_simulation(server, client, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": args.cpus}})
    wall = time.perf_counter() - t0
    if "test_accuracy" not in RESULT:
        raise SystemExit("the simulation did not finish its rounds (see its log above)")
    import flwr
    import ray

    out = {"per_round_s": [round(b - a, 4) for a, b in zip(STAMPS, STAMPS[1:])],
           "startup_s": round(STAMPS[0] - t0, 2), "wall_s": round(wall, 2), **RESULT,
           "versions": {"flwr": flwr.__version__, "ray": ray.__version__, "torch": torch.__version__,
                        "numpy": np.__version__, "python": sys.version.split()[0]}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from flower_fedavg_app import run as _run  # the apps by module name, so Ray's workers import, not unpickle, them

    _run()
