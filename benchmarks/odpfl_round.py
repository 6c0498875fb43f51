"""Where an ODPFL-HN round of the UPFL Table-1 protocol spends its time, and what reusing client_start's
embeddings in aggregate saves: one round of the Fashion-MNIST protocol (50 training clients, ConvNet target,
tau = 20 local iterations, B = 64), timed in parts, with aggregate run both ways on the same client states in
the same run (its update is bit-identical either way; tests/test_odpfl_hn.py); and the encoder's passes, one per
client against the clients' sets concatenated with segment pooling (equal to 1e-12 in float64,
tests/test_odpfl_hn.py; the row decides ENCODE_CHUNK_SAMPLES per device type). Rows are merged into
docs/benchmarks/odpfl-round.json by (what, device).

    python benchmarks/odpfl_round.py [--dataset fashion_mnist] [--device cpu] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fl_server.torch_device import describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.experiments import get_experiment  # noqa: E402
from lab.rows import merge_rows  # noqa: E402
from lab.runner import build_simulation  # noqa: E402


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="fashion_mnist", help="a upfl-table1 protocol")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--repeats", type=int, default=2, help="aggregate timings per way, alternated (min kept)")
    ap.add_argument("--out", default="docs/benchmarks/odpfl-round.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    protocol = get_experiment("upfl-table1").protocols[args.dataset]
    sim = build_simulation(protocol, "ODPFL-HN", 0, None, device=args.device, progress=False,
                           data_root=args.data_dir)
    alg, server = sim.algorithm, sim.server_state
    ids, dev = sim.select_clients(0), sim.device
    states, t_start = timed(lambda: alg.client_start(server, ids), dev)
    cached = alg._round_embeddings
    states, t_local = timed(lambda: sim.local_train(alg.local_step, states, server, ids, sim.cfg.local_iterations,
                                                    np.random.default_rng(0)), dev)
    reuse, fresh = [], []
    for _ in range(args.repeats):  # alternated, so that load changes on a shared machine hit both ways alike
        alg._round_embeddings = cached
        reuse.append(timed(lambda: alg.aggregate(server, ids, states, sim.train_sizes[ids]), dev)[1])
        alg._round_embeddings = None  # what aggregate did before the reuse: embed every client again
        fresh.append(timed(lambda: alg.aggregate(server, ids, states, sim.train_sizes[ids]), dev)[1])
    t_reuse, t_fresh = min(reuse), min(fresh)
    before, after = t_start + t_local + t_fresh, t_start + t_local + t_reuse
    row = {"benchmark": "odpfl-round", "what": f"ODPFL-HN round, upfl-table1 {args.dataset}",
           "metric": "round speedup from reusing the embeddings", "value": round(before / after, 3),
           "round_s_before": round(before, 2), "round_s_after": round(after, 2),
           "client_start_s": round(t_start, 2), "local_training_s": round(t_local, 2),
           "aggregate_fresh_embeddings_s": round(t_fresh, 2), "aggregate_reused_embeddings_s": round(t_reuse, 2),
           "repeats": args.repeats, "clients": len(ids), "samples": int(sum(len(sim.fed.train[i]) for i in ids)),
           "local_iterations": sim.cfg.local_iterations, "batch_size": sim.cfg.batch_size,
           "device": describe(sim.device), "load_average_1min": round(os.getloadavg()[0], 2),
           "torch": torch.__version__,
           "command": "python benchmarks/odpfl_round.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    rows = [row, encoder_pass_row(alg, server, ids, sim, args)]
    for r in rows:
        print(json.dumps(r))
    merge_rows(args.out, rows)
    return 0


def encoder_pass_row(alg: Any, server: dict, ids: np.ndarray, sim: Any, args: argparse.Namespace) -> dict:
    """The encoder's two passes per round, one pass per client against the clients' sets concatenated with
    segment pooling (chunks of 8,192 samples): the embeddings of every training client (validation) and the
    selected clients' summed ClientBackprop (aggregate), through the same functions with the chunk budget
    (odpfl_hn.ENCODE_CHUNK_SAMPLES) set either way. Alternated, min of ``repeats``."""
    from fl_server.algorithms import odpfl_hn

    enc, dev = server["enc"], sim.device
    every = np.arange(len(sim.fed.train))
    grad_e = torch.randn(len(ids), alg.hp.embed_dim, generator=torch.Generator().manual_seed(0)).to(
        device=dev, dtype=next(iter(enc.values())).dtype)
    default = odpfl_hn.ENCODE_CHUNK_SAMPLES.get(dev.type, 0)
    budgets = {"per_client": 0, "concat": 8192}
    times: dict[str, list[float]] = {f"{part}_{way}": [] for part in ("embed", "backprop") for way in budgets}
    for _ in range(args.repeats):
        for way, budget in budgets.items():
            odpfl_hn.ENCODE_CHUNK_SAMPLES[dev.type] = budget
            times[f"embed_{way}"].append(timed(lambda: alg.embed_clients(enc, every), dev)[1])
            times[f"backprop_{way}"].append(timed(lambda: alg.clients_encoder_backprop(enc, ids, grad_e), dev)[1])
    odpfl_hn.ENCODE_CHUNK_SAMPLES[dev.type] = default
    best = {k: min(v) for k, v in times.items()}
    return {"benchmark": "odpfl-round", "what": f"ODPFL-HN encoder passes, upfl-table1 {args.dataset}",
            "metric": "speedup of concatenated passes (8,192-sample chunks) over one pass per client "
                      "(embed all + backprop selected)",
            "value": round((best["embed_per_client"] + best["backprop_per_client"])
                           / (best["embed_concat"] + best["backprop_concat"]), 3),
            **{f"{k}_s": round(v, 3) for k, v in best.items()}, "default_chunk_samples": default,
            "repeats": args.repeats, "embedded_clients": len(every), "backprop_clients": len(ids),
            "device": describe(dev), "load_average_1min": round(os.getloadavg()[0], 2), "torch": torch.__version__,
            "command": "python benchmarks/odpfl_round.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])}


if __name__ == "__main__":
    sys.exit(main())
