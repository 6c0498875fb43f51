"""Vectorised engine (torch.func.vmap over clients) against the per-client loop, on one round of the UPFL
MNIST protocol (50 training clients, tau = 20 local iterations, B = 64): FedAvg (MLP 2x200), FedTTA (MLP
2x200, second-order meta step) and FedAvg with the ConvNet. Parity in float64 and float32, speed ratio
measured in the same run. Rows are merged into docs/benchmarks/vmap-engine.json by (what, device).

    python benchmarks/vmap_engine.py [--device cpu|cuda] [--repeats 3] [--data-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from fl_server.algorithms import build_algorithm
from fl_server.recipes.presets import FEDTTA_HP
from fl_server.data import load_dataset
from fl_server.data.federated import make_federated
from fl_server.torch_device import describe, pick_device
from fl_server.engine import RunConfig, Simulation
from fl_server.models import build_model

from timing import sync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.rows import merge_rows  # noqa: E402

CASES = [  # (label, method, model, hyperparameters)
    ("FedAvg round, MLP 2x200", "FedAvg", "mlp", {"lr": 0.1}),
    ("FedTTA round, MLP 2x200", "FedTTA", "mlp", FEDTTA_HP["mnist"]["FedTTA"]),
    ("FedAvg round, ConvNet", "FedAvg", "convnet", {"lr": 0.1}),
]


# FedTTA's inner step follows g/||g|| (the gradient of the paper's norm loss), whose direction is ill-conditioned
# when ||g|| is small: float32 rounding differences between two correct implementations grow over the local
# iterations. Parity is therefore also recorded after fewer local iterations, where it is at rounding level.
SHORT_PARITY_ITERATIONS = {"FedTTA": (1, 5)}


def make_sim(fed, method: str, model: str, hp: dict, mode: str, dtype: str, device: str,  # type: ignore[no-untyped-def]
             local_iterations: int = 20) -> Simulation:
    alg = build_algorithm(method, build_model(model, (1, 28, 28), 10, seed=0), fed.num_train_clients, **hp)
    return Simulation(alg, fed, RunConfig(rounds=1, seed=0, mode=mode, dtype=dtype, device=device, progress=False,
                                          local_iterations=local_iterations))


def parity(fed, method: str, model: str, hp: dict, dtype: str, device: str, local_iterations: int) -> float:  # type: ignore[no-untyped-def]
    """Max abs difference of the server parameters after one round, vmap against the per-client loop."""
    sims = {m: make_sim(fed, method, model, hp, m, dtype, device, local_iterations) for m in ("vmap", "loop")}
    for s in sims.values():
        s.run_round(0)
    return max_diff({"p": sims["vmap"].server_state["params"]}, {"p": sims["loop"].server_state["params"]})


def time_round(sim: Simulation, repeats: int) -> float:
    """Median wall time of one round (state reset before each), after one warm-up round."""
    start = sim.server_state  # states are never mutated in place
    times = []
    for i in range(repeats + 1):
        sim.server_state = start
        sync(sim.device)
        t0 = time.perf_counter()
        sim.run_round(0)
        sync(sim.device)
        if i:  # first run is the warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k][n] - b[k][n]).abs().max()) for k in a for n in a[k])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="docs/benchmarks/vmap-engine.json")
    ap.add_argument("--cases", nargs="*", type=int, default=None, help="indices into CASES (default: all)")
    args = ap.parse_args()
    device = pick_device(args.device)
    # parity is about the engine, not TF32: cuDNN convolutions default to TF32 on Ampere+ GPUs
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    fed = make_federated(load_dataset("mnist", root=args.data_dir, split="all"), "pathological", 100, seed=0)
    command = "python benchmarks/vmap_engine.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows = []
    for i, (label, method, model, hp) in enumerate(CASES):
        if args.cases is not None and i not in args.cases:
            continue
        diffs = {dtype: parity(fed, method, model, hp, dtype, str(device), 20) for dtype in ("float64", "float32")}
        short = {f"max_abs_diff_{dtype}_{it}_iterations": parity(fed, method, model, hp, dtype, str(device), it)
                 for it in SHORT_PARITY_ITERATIONS.get(method, ()) for dtype in ("float64", "float32")}
        secs = {m: time_round(make_sim(fed, method, model, hp, m, "float32", str(device)), args.repeats)
                for m in ("loop", "vmap")}
        row = {"benchmark": "vmap-engine", "what": label, "metric": "speedup",
               "value": round(secs["loop"] / secs["vmap"], 2), "loop_s": round(secs["loop"], 4),
               "vmap_s": round(secs["vmap"], 4), "max_abs_diff_float64": diffs["float64"],
               "max_abs_diff_float32": diffs["float32"], **short, "clients": fed.num_train_clients,
               "local_iterations": 20, "batch_size": 64, "repeats": args.repeats,
               "device": describe(device), "load_average_1min": round(os.getloadavg()[0], 2), "torch": torch.__version__, "command": command}
        print(json.dumps(row))
        rows.append(row)
    merged = merge_rows(args.out, rows)
    print(f"{'case':<28} {'device':<34} {'loop s':>8} {'vmap s':>8} {'speedup':>8} {'f64 diff':>10}")
    for r in merged:
        print(f"{r['what']:<28} {r['device']:<34} {r['loop_s']:>8} {r['vmap_s']:>8} {r['value']:>8} "
              f"{r['max_abs_diff_float64']:>10.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
