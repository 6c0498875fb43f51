"""Peer benchmark: the same FedAvg work in this engine and in Flower's simulation engine, one run.

Work: MNIST's 60,000 training images, iid over ``--clients`` clients (this engine's partition, seed 0), the MLP
784-200-200-10 from the same initial weights, ``--rounds`` rounds of every client taking ``--local-iterations``
plain SGD steps (lr ``--lr``) of ``--batch-size`` on cross-entropy, the server averaging weighted by sample
count; test accuracy of the final model on MNIST's t10k set. Each side draws its own batches (successive
random permutations of a client's partition, different generators), so the two accuracies are close, not equal.

* This engine: the ``upfl-table1`` MNIST protocol changed to that work, :class:`~fl_server.engine.Simulation`
  in ``--mode`` (vmap: all clients stepped in one call), torch on ``--cpus`` threads.
* ``--cpus`` (default 1) cores per side: on a shared machine a torch with two threads stalls whenever another
  process holds one of the cores (its threads wait for each other), while single-threaded Ray actors only slow
  down; one core each compares the engines, not the machine's load.
* The peer: ``benchmarks/peer/flower_fedavg_app.py``, a self-contained Flower app (Flower's ``FedAvg``
  strategy, a plain torch loop in the ClientApp; it imports nothing of fl-edge) run by
  ``flwr.simulation.run_simulation`` with ``--cpus`` Ray actors of one torch thread each, in a venv of its own
  that this script creates under ``--venv`` (flwr[simulation] and torch pinned: PEER_PINS; torch is installed
  first, on its own, so that pip does not pick a CUDA build for flwr's sake). ``--python`` runs the peer with
  another interpreter instead (CI's smoke run: this venv, whose ``flower`` extra has the same pins).

Seconds per round are medians over the rounds after the first (round 1 warms up: Ray's actors, allocations,
vmap tracing); the peer's rounds are timestamped by the server's ``evaluate_fn`` (Flower calls it after every
round). Rows merged into ``--out`` by (what, device).

    python benchmarks/peer_fedavg.py                       # docs/benchmarks/peer-fedavg.json
    python benchmarks/peer_fedavg.py --smoke --python "$(command -v python)" --out runs/peer-smoke.json  # CI
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_server.data import load_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.experiments import get_experiment  # noqa: E402
from lab.rows import merge_rows  # noqa: E402
from lab.runner import build_federated, build_simulation  # noqa: E402

PEER_APP = Path(__file__).resolve().parent / "peer" / "flower_fedavg_app.py"
PEER_PINS = ("torch==2.13.0", "flwr[simulation]==1.42.0")  # torch first, alone (see the module docstring)


def peer_python(venv: Path, torch_index_url: str | None) -> tuple[Path, float | None]:
    """The peer venv's interpreter, creating the venv first when it lacks the pins: (python, seconds spent
    creating it, None when it was already there)."""
    python, stamp = venv / "bin" / "python", venv / ".peer-pins"
    if python.exists() and stamp.exists() and stamp.read_text() == "\n".join(PEER_PINS):
        return python, None
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, PEER_PINS[0], *(["--index-url", torch_index_url] if torch_index_url else [])], check=True)
    subprocess.run([*pip, *PEER_PINS[1:]], check=True)
    stamp.write_text("\n".join(PEER_PINS))
    return python, time.perf_counter() - t0


def median_after_first(seconds: list[float]) -> dict[str, Any]:
    timed = seconds[1:]
    return {"median_s_per_round": round(statistics.median(timed), 4), "rounds_timed": len(timed),
            "per_round_s": [round(s, 4) for s in seconds]}


def engine_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """This engine's rounds; writes the peer's work file (initial weights, partition, hyperparameters)."""
    base = get_experiment("upfl-table1").protocols["mnist"]
    protocol = dataclasses.replace(base, partition="iid", num_clients=args.clients, new_fraction=0.0,
                                   val_fraction=0.0, split="train", rounds=args.rounds, method_rounds={},
                                   local_iterations=args.local_iterations, batch_size=args.batch_size,
                                   method_hp={"FedAvg": {"lr": args.lr}})
    fed = build_federated(protocol, args.seed, args.data_dir)
    sim = build_simulation(protocol, "FedAvg", args.seed, None, device="cpu", mode=args.mode, progress=False,
                           data_root=args.data_dir, fed=fed, batch_stream="per_client", dtype="float32")
    init = [v.detach().numpy().copy() for v in sim.server_state["params"].values()]
    offsets = np.cumsum([0] + [len(t) for t in fed.train])
    np.savez(work, **{f"init_{i}": a for i, a in enumerate(init)}, part_indices=np.concatenate(fed.train),
             part_offsets=offsets, rounds=args.rounds, local_iterations=args.local_iterations,
             batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    seconds = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        sim.run_round(r)
        seconds.append(time.perf_counter() - t0)
    test = load_dataset("mnist", root=args.data_dir, split="test")
    with torch.no_grad():
        logits = sim.algorithm.predict(sim.server_state["params"], torch.from_numpy(test.x))
    acc = float((logits.argmax(1).numpy() == test.y).mean())
    return {"mode": sim.mode, "torch_threads": torch.get_num_threads(), **median_after_first(seconds),
            "test_accuracy": round(acc, 4)}


def peer_run(python: Path, work: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # nothing of ours
    cmd = [str(python), str(PEER_APP), "--work", str(work), "--data-dir", str(args.data_dir), "--out", str(out),
           "--cpus", str(args.cpus)]
    proc = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=args.peer_timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the peer run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    peer = json.loads(out.read_text())
    return {**median_after_first(peer.pop("per_round_s")), "test_accuracy": round(peer.pop("test_accuracy"), 4),
            **peer}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5, help=">= 2: the first round is not timed")
    ap.add_argument("--local-iterations", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1, help="UPFL Table 4's FedAvg lr on MNIST")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpus", type=int, default=1,
                    help="cores per side: torch threads here, Ray actors (one torch thread each) there")
    ap.add_argument("--mode", default="vmap", choices=("vmap", "loop"), help="this engine's client stepping")
    ap.add_argument("--venv", default=".peer-venv", help="the peer's venv (created when missing)")
    ap.add_argument("--python", default=None, help="run the peer with this interpreter instead of --venv's")
    ap.add_argument("--torch-index-url", default=None,
                    help="where the peer venv's torch comes from (e.g. https://download.pytorch.org/whl/cpu)")
    ap.add_argument("--peer-timeout", type=float, default=1800)
    ap.add_argument("--smoke", action="store_true", help="4 clients, 4 rounds of 20 steps (CI)")
    ap.add_argument("--data-dir", default=os.environ.get("FL_DATA_DIR"))
    ap.add_argument("--out", default="docs/benchmarks/peer-fedavg.json")
    args = ap.parse_args()
    if not args.data_dir:
        raise SystemExit("error: --data-dir (or FL_DATA_DIR) must point at the MNIST files")
    if args.smoke:
        args.clients, args.rounds, args.local_iterations = 4, 4, 20
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (the first round is not timed)")
    torch.set_num_threads(args.cpus)
    load = [round(v, 2) for v in os.getloadavg()]  # a shared machine: others' work too
    venv_s = None
    if args.python:
        python = Path(args.python)
    else:
        python, venv_s = peer_python(Path(args.venv), args.torch_index_url)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work.npz"
        engine = engine_run(args, work)
        peer = peer_run(python, work, args, Path(tmp) / "peer.json")
    ratio = peer["median_s_per_round"] / engine["median_s_per_round"]
    row = {
        "benchmark": "peer-fedavg", "what": "seconds per FedAvg round, this engine vs Flower's simulation engine, "
        f"same work (MNIST iid, MLP 2x200, {args.clients} clients x {args.local_iterations} steps of "
        f"{args.batch_size})" + (" (smoke)" if args.smoke else ""),
        "device": f"cpu ({os.cpu_count()} cores, {args.cpus} used per side), {platform.machine()}",
        "command": " ".join(["python", "benchmarks/peer_fedavg.py", *map(shlex.quote, sys.argv[1:])]),
        "load_average_at_start": load, "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
        "metric": "flower_over_engine_s_per_round", "value": round(ratio, 2),
        "work": {"clients": args.clients, "rounds": args.rounds, "local_iterations": args.local_iterations,
                 "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "runs": 1},
        "engine": engine, "flower_simulation": peer,
        "peer_interpreter": "this venv (--python)" if args.python else f"own venv ({', '.join(PEER_PINS)})",
        "peer_venv_created_s": None if venv_s is None else round(venv_s, 1),
        "test_accuracy_diff_points": round(100 * (peer["test_accuracy"] - engine["test_accuracy"]), 2),
    }
    merge_rows(args.out, [row], key=("what", "device"))
    print(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
