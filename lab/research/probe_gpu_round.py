"""Where a UPFL Table-1 Fashion-MNIST FedTTA round spends its GPU time: the top kernels of one eager round (CUDA
profiler), and the round's time with cuDNN's autotuner (benchmark mode) off and on. GPU only.

    python lab/research/probe_gpu_round.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: lab/ is not installed
from lab.experiments import get_experiment  # noqa: E402
from lab.runner import build_federated, build_simulation  # noqa: E402


def round_s(sim, rounds: int = 3) -> float:  # type: ignore[no-untyped-def]
    times = []
    for r in range(rounds + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sim.run_round(r)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe-gpu-round.json")
    args = ap.parse_args()
    protocol = get_experiment("upfl-table1").protocols["fashion_mnist"]
    fed = build_federated(protocol, 0)
    out = {}
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        sim = build_simulation(protocol, "FedTTA", 0, None, "cuda", "vmap", False, None, fed, cuda_graphs=False)
        out[f"round_s_cudnn_benchmark_{bench}"] = round_s(sim)
        print(out, flush=True)
    torch.backends.cudnn.benchmark = False
    sim = build_simulation(protocol, "FedTTA", 0, None, "cuda", "vmap", False, None, fed, cuda_graphs=False)
    sim.run_round(0)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sim.run_round(1)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
    print(table)
    out["top_kernels"] = table
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
