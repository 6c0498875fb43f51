"""Phase-specialised local steps (``Algorithm.local_step_at``) against the counter-read step they replace, in
one run: one round's local training of the selected clients, the two variants' calls alternating.

- BTFL (btgfl protocol: 20 clients, 48 steps of B = 32, BTFL CNN): a local-head step (1 in 6) skips the
  backward through the features that its zero weight discarded;
- MAP and MAP (code) (map-incomplete paper protocol: 20 of 100 clients, E = 5 epochs, MLP 2x512): a stage-1
  step skips the inherited private model's (teacher's) forward.

``identical`` records that both variants give the same client states bit for bit. Rows are merged into
docs/benchmarks/phase-steps.json by (what, device).

    python benchmarks/phase_steps.py [--device cpu|cuda] [--repeats 3] [--data-dir DIR] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from fl_server.torch_device import describe
from fl_server.functional import State, to_numpy_flat

from timing import interleaved_median_ms, run_fields, sync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.experiments import get_experiment  # noqa: E402
from lab.map_incomplete import build_map_simulation  # noqa: E402
from lab.rows import merge_rows  # noqa: E402
from lab.runner import build_simulation  # noqa: E402

CASES = [("BTFL round, btgfl fashion_mnist", "btgfl", "fashion_mnist", "BTFL"),
         ("MAP round, map-incomplete fashion_mnist-paper", "map-incomplete", "fashion_mnist-paper", "MAP"),
         ("MAP (code) round, map-incomplete fashion_mnist-paper", "map-incomplete", "fashion_mnist-paper",
          "MAP (code)")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="docs/benchmarks/phase-steps.json")
    ap.add_argument("--smoke", action="store_true", help="CI-sized protocols (Protocol.quick): a run check, "
                                                         "not a measurement")
    args = ap.parse_args()
    rows = []
    for label, experiment, dataset, method in CASES:
        protocol = get_experiment(experiment).protocols[dataset]
        if args.smoke:
            protocol = protocol.quick()
        build = build_map_simulation if experiment == "map-incomplete" else build_simulation
        sim = build(protocol, method, 0, None, device=args.device, progress=False, data_root=args.data_dir)
        alg, server = sim.algorithm, sim.server_state
        ids = sim.select_clients(0)
        start = alg.client_start(server, ids)
        iterations = sim.cfg.local_iterations

        def train(step_at):  # type: ignore[no-untyped-def]
            def run() -> State:
                out = sim.local_train(alg.local_step, start, server, ids, iterations, np.random.default_rng(0), step_at)
                sync(sim.device)
                return out
            return run

        variants = {"phased": train(alg.local_step_at), "counter": train(None)}
        phased, counter = to_numpy_flat(variants["phased"]()), to_numpy_flat(variants["counter"]())
        identical = phased.keys() == counter.keys() and all(np.array_equal(phased[k], counter[k]) for k in phased)
        ms = interleaved_median_ms(variants, args.repeats, warmup=1)
        row = {"benchmark": "phase-steps", "what": label, "metric": "speedup",
               "value": round(ms["counter"] / ms["phased"], 3), "phased_s": round(ms["phased"] / 1e3, 3),
               "counter_s": round(ms["counter"] / 1e3, 3), "identical": identical, "clients": len(ids),
               "local_iterations": iterations, "batch_size": protocol.batch_size, "mode": sim.mode,
               **run_fields(describe(sim.device), args.repeats)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    merge_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
