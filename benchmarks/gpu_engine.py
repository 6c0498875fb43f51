"""The engine's vmapped round in six variants, side by side in one run: ``eager`` (today's default path without
CUDA graphs: every kernel launched from Python, vmap's grouped convolutions), ``graphed`` (the round replayed as one
CUDA graph, ``RunConfig(cuda_graphs=True)``), ``gemm_graphed`` (graphed, with the clients' convolutions as
gathered patches plus one batched matrix product, ``RunConfig(batched_conv="gemm")``), ``bf16_graphed`` (graphed,
the clients' convolutions in bfloat16, ``RunConfig(batched_conv="bf16")``: other arithmetic, so its float64
difference is bf16's rounding, not a parity check, and the lease script never picks it for rows),
``graphed_stacked`` (graphed, the rounds of ``--stack`` seeds stepped together as one round over all their clients,
:mod:`fl_server.engine.stacked`: what ``python -m lab bench ... --stack-seeds`` runs) and ``gemm_graphed_stacked``
(both: a stacked row on the GEMM path). On a GPU: the UPFL Table-1
Fashion-MNIST round (ConvNet, 50 clients x 20 second-order meta-steps of batch 64) of FedTTA and FedTTA++; on the
CPU, where graphs do not apply, the MNIST MLP FedTTA round.

Per case and variant: seconds per round of one run (median over ``--repeats`` rounds after the first, which records
a graph and is reported apart; a stacked round's seconds divided by its seeds, the cost of a table row's round),
the GPU memory peak of the first round (when a graphed variant records its graph), with every variant's state
resident, the host's kernel launches and the kernels run per round (CUDA profiler), and parity: the server state after
``--parity-rounds`` rounds in float64 against the eager variant's (max abs difference; a stacked variant's first
seed). The row's value is eager seconds over the fastest variant's of the same arithmetic (bf16 aside). Rows merge
into docs/benchmarks/gpu-engine.json by (what, device), each time a part is measured (timings, then parity, then
kernel counts), so that a run cut off keeps what it measured.

    python benchmarks/gpu_engine.py --device cuda            # on a GPU
    python benchmarks/gpu_engine.py --device cuda --tf32     # ... at torch's default precision, as runs go
    python benchmarks/gpu_engine.py --device cpu --repeats 2 # the CPU row
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fl_server.torch_device import describe, pick_device
from fl_server.engine import Simulation
from fl_server.engine.stacked import check_stackable, stacked_round

from timing import sync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.experiments import get_experiment  # noqa: E402
from lab.rows import merge_rows  # noqa: E402
from lab.runner import build_federated, build_simulation  # noqa: E402


VARIANTS = {"eager": {"cuda_graphs": False, "batched_conv": "native"},  # explicit: not $FL_BATCHED_CONV's default
            "graphed": {"cuda_graphs": True, "batched_conv": "native"},
            "gemm_graphed": {"cuda_graphs": True, "batched_conv": "gemm"},
            "bf16_graphed": {"cuda_graphs": True, "batched_conv": "bf16"},
            "graphed_stacked": {"cuda_graphs": True, "batched_conv": "native"},  # with --stack seeds
            "gemm_graphed_stacked": {"cuda_graphs": True, "batched_conv": "gemm"}}  # both, as a stacked row on gemm


class Stacked:
    """Seeds 0..n-1 of a run stepped together, timed and profiled like one Simulation (``run_round``)."""

    def __init__(self, sims: list[Simulation]) -> None:
        check_stackable(sims)
        self.sims, self.device, self.graphed = sims, sims[0].device, sims[0].graphed
        self.server_state = sims[0].server_state

    def run_round(self, round_: int) -> None:
        stacked_round(self.sims, round_, self.graphed)
        self.server_state = self.sims[0].server_state


def make_sim(protocol: Any, method: str, feds: list[Any], device: str, dtype: str, variant: str) -> Any:
    """The variant's runner: one Simulation of seed 0, or a :class:`Stacked` of one per federation in ``feds``."""
    def one(seed: int) -> Simulation:
        return build_simulation(protocol, method, seed, None, device, "vmap", False, None, feds[seed], dtype=dtype,
                                **VARIANTS[variant])
    return Stacked([one(k) for k in range(len(feds))]) if variant.endswith("_stacked") else one(0)


def runs_per_round(sim: Any) -> int:
    return len(sim.sims) if isinstance(sim, Stacked) else 1


def state_diff(a: dict, b: dict) -> float:
    return max(float((a[k][n] - b[k][n]).abs().max()) for k in ("params", "phi") if k in a for n in a[k])


def time_rounds(sims: dict[str, Simulation], repeats: int) -> dict[str, tuple[float, float, float | None]]:
    """Per variant: (first round's seconds, median seconds of the next ``repeats`` rounds, the GPU memory peak of
    the first round in GiB, None off CUDA), the variants' rounds alternating (A B C A B C ...) so that load changes
    on a shared machine hit every variant alike. The peak is the first round's because a graphed variant records
    its graph then (every later round replays it without allocating); it counts every variant's resident state."""
    times: dict[str, list[float]] = {v: [] for v in sims}
    peaks: dict[str, float | None] = {v: None for v in sims}
    for r in range(repeats + 1):
        for v, sim in sims.items():
            sync(sim.device)
            if r == 0 and sim.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(sim.device)
            t0 = time.perf_counter()
            sim.run_round(r)
            sync(sim.device)
            times[v].append(time.perf_counter() - t0)
            if r == 0 and sim.device.type == "cuda":
                peaks[v] = round(torch.cuda.max_memory_allocated(sim.device) / 2**30, 2)
    return {v: (t[0], statistics.median(t[1:]), peaks[v]) for v, t in times.items()}


def launches(sim: Simulation, round_: int) -> dict[str, int]:
    """Host-side launch calls and GPU kernels of one round (torch.profiler; CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sim.run_round(round_)
        sync(sim.device)
    host = {"cudaLaunchKernel": 0, "cuLaunchKernel": 0, "cudaLaunchKernelExC": 0, "cudaGraphLaunch": 0}
    kernels = 0
    for evt in prof.events():
        if evt.name in host:
            host[evt.name] += 1
        elif evt.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in evt.name.lower() \
                and "memset" not in evt.name.lower():
            kernels += 1
    return {"host_kernel_launches": host["cudaLaunchKernel"] + host["cuLaunchKernel"] + host["cudaLaunchKernelExC"],
            "host_graph_launches": host["cudaGraphLaunch"], "gpu_kernels": kernels}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parity-rounds", type=int, default=2, help="rounds compared in float64 (the second replays)")
    ap.add_argument("--methods", nargs="*", default=["FedTTA", "FedTTA++"])
    ap.add_argument("--smoke", action="store_true", help="10 clients, 3 local steps (CI)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="eager (the reference) is always run")
    ap.add_argument("--stack", type=int, default=3, help="seeds stepped together in the *_stacked variants")
    ap.add_argument("--tf32", action="store_true",
                    help="time with torch's default precision, as the engine's runs go: convolutions in TF32 (the "
                         "GEMM variant's too, fl_server/engine/gemm_conv.py), other matrix products in float32; "
                         "default: TF32 off everywhere")
    ap.add_argument("--dataset", choices=["fashion_mnist", "mnist"],
                    help="the UPFL Table-1 row whose round is timed (default: fashion_mnist's ConvNet on a GPU, "
                         "mnist's MLP on the CPU)")
    ap.add_argument("--out", default="docs/benchmarks/gpu-engine.json")
    args = ap.parse_args()
    args.variants = ["eager", *[v for v in args.variants if v != "eager"]]
    device = pick_device(args.device)
    if not args.tf32:  # the same arithmetic in every variant; parity (float64) is about the engine either way
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    dataset = args.dataset or ("fashion_mnist" if device.type == "cuda" else "mnist")
    protocol = get_experiment("upfl-table1").protocols[dataset]
    if args.smoke:
        protocol = replace(protocol, num_clients=10, local_iterations=3)
    feds = [build_federated(protocol, seed) for seed in range(max(1, args.stack))]
    fed = feds[0]
    command = "python benchmarks/gpu_engine.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    for method in args.methods:
        what = (f"{method} round, UPFL Table 1 {dataset} ({protocol.model}, {fed.num_train_clients} clients x "
                f"{protocol.local_iterations} steps of {protocol.batch_size})"
                + (", torch's default precision (TF32 convolutions)" if args.tf32 and device.type == "cuda" else ""))
        row: dict[str, Any] = {"benchmark": "gpu-engine", "what": what, "metric": "speedup"}
        # timings first (float32, as rows run), written at once: a lease may cut the later parts off
        sims = {v: make_sim(protocol, method, feds, str(device), "float32", v) for v in args.variants}
        secs = {}
        for v, (first, median, peak) in time_rounds(sims, args.repeats).items():
            n = runs_per_round(sims[v])
            secs[v] = median / n  # a table row's round
            row[f"{v}_s"] = round(median / n, 4)
            row[f"{v}_first_round_s"] = round(first / n, 4)
            if n > 1:
                row[f"{v}_seeds"], row[f"{v}_round_s"] = n, round(median, 4)
            if peak is not None:
                row[f"{v}_first_round_peak_gib"] = peak
        # the headline compares paths of the same arithmetic; bf16_graphed keeps its own speedup key
        fastest = min((v for v in secs if v not in ("eager", "bf16_graphed")), key=secs.__getitem__, default="eager")
        row.update({"value": round(secs["eager"] / secs[fastest], 2), "fastest": fastest,
                    **{f"{v}_speedup": round(secs["eager"] / secs[v], 2) for v in secs if v != "eager"}})
        row.update({"graphs_used": device.type == "cuda", "repeats": args.repeats, "device": describe(device),
                    "load_average_1min": round(os.getloadavg()[0], 2), "torch": torch.__version__,
                    "command": command})
        merge_rows(args.out, [row])
        # parity in float64: the same rounds in every variant, against the eager one
        exact = {v: make_sim(protocol, method, feds, str(device), "float64", v) for v in args.variants}
        for r in range(args.parity_rounds):
            for sim in exact.values():
                sim.run_round(r)
        for v, sim in exact.items():
            if v != "eager":
                row[f"{v}_max_abs_diff_float64"] = state_diff(exact["eager"].server_state, sim.server_state)
                row[f"{v}_graph_captures_replays"] = [sim.graphed.captures, sim.graphed.replays] \
                    if sim.graphed else None
        del exact
        merge_rows(args.out, [row])
        if device.type == "cuda":  # kernels per round, on the float32 runs timed above
            for v in secs:
                row[f"{v}_launches"] = launches(sims[v], args.repeats + 1)
            merge_rows(args.out, [row])
        del sims
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
