"""The ``upfl-data-size`` protocol (UPFL Sec. 4.4, Fig. 3): new clients keep a fraction a of their data.

Training is the Table 1 protocol, untouched; only each new client's unlabeled set -- what it adapts on and
is tested on -- shrinks to round(a * n) samples. The subsets are nested (the a = 0.1 set lies inside the
a = 0.25 set, ...: one seeded permutation per client, its first round(a * n) samples), so the curve
compares the same clients with less and less information. One training run serves every fraction: the
best-validation model is personalized on each subset in turn. The training run lives in the folder of
``options["train_runs"]`` (``upfl-table1``) when that experiment trains the very same protocol, so whichever
of the two runs first trains and the other resumes its finished checkpoint (fingerprint-checked by the engine).
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from lab.protocol import Protocol
from lab.runner import build_federated, build_simulation, seed_record
from fl_server.data.federated import FederatedData
from fl_server.data.partitions import subsample


FRACTIONS: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)


def new_client_subsets(new: list[np.ndarray], fraction: float, seed: int) -> list[np.ndarray]:
    """Each new client's first round(fraction * n) samples of a per-client permutation seeded by (seed, j):
    nested across fractions, independent of the training draws."""
    return [subsample(idx, fraction, np.random.default_rng([seed, 0xDA7A, j])) for j, idx in enumerate(new)]


def _training_dir(protocol: Protocol, run_dir: Path | None) -> Path | None:
    """``<runs>/<train_runs>/<dataset>/<method>/seedK`` for ``<runs>/upfl-data-size/<dataset>/<method>/seedK``
    when that experiment's protocol (``options["train_protocol"]``) trains the same (full or --quick); else
    ``run_dir`` itself."""
    shared, other = protocol.options.get("train_runs"), protocol.options.get("train_protocol")
    if run_dir is None or not shared:
        return run_dir
    strip = lambda p: replace(p, options={}, note="")  # noqa: E731  (neither changes the training)
    if other is None or strip(protocol) not in (strip(other), strip(other.quick())):
        return run_dir
    return run_dir.parents[3] / shared / run_dir.parents[1].name / run_dir.parent.name / run_dir.name


def run_data_size_seed(protocol: Protocol, method: str, seed: int, run_dir: Path | None, device: str = "auto",
                       mode: str = "auto", progress: bool = True, data_root: str | None = None,
                       fed: FederatedData | None = None) -> dict[str, Any]:
    """Train (or reuse) one run, then the new-client accuracy at every fraction on the best-validation model."""

    fed = fed if fed is not None else build_federated(protocol, seed, data_root)
    sim = build_simulation(protocol, method, seed, _training_dir(protocol, run_dir), device, mode, progress,
                           data_root, fed)
    record = seed_record(protocol, method, seed, sim, sim.run())
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = [{"split": "val", "value": record["val"]}]
    sizes: dict[str, float] = {}
    for a in protocol.options.get("fractions", FRACTIONS):
        subsets = new_client_subsets(fed.new, a, seed)
        accs = sim.personalized_accuracies(subsets, sim.best_state)
        results.append({"split": "test", "fraction": a, "value": 100 * float(np.mean(accs))})
        sizes[str(a)] = float(np.mean([len(s) for s in subsets]))
    return {**record, "results": results, "samples_per_client": sizes,
            "wall_s": round(record["wall_s"] + time.perf_counter() - t0, 2),
            # where under the runs directory (<experiment>/<dataset>/<method>/seedK): no machine's path
            "training_run": "/".join(sim.out_dir.parts[-4:]) if sim.out_dir else None}
