"""Run experiment rows seed by seed. One result file per (experiment, dataset, method, seed) under
``<results>/raw/``, skipped when present (and refused when it ran with other hyperparameters or rounds than the
protocol now sets), so a long table accumulates over several sessions; the table
``<results>/<experiment>.json`` is aggregated from whatever seeds are done."""
from __future__ import annotations

import dataclasses
import importlib
import json
import platform
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fl_server.algorithms import ALGORITHMS
from lab.protocol import Experiment, Protocol, protocol_recipe
from lab.rows import invocation, write_atomic
from fl_server.data import load_dataset
from fl_server.data.datasets import NUM_CLASSES
from fl_server.diagnostics import CHANCE_MARGIN
from fl_server.data.federated import (FederatedData, hold_out_validation_clients, make_federated,
                                     random_subset, rotation_concept_shift)
from fl_server.torch_device import describe
from fl_server.engine import Simulation
from fl_server.engine.simulation import RunResult
from fl_server.engine.stacked import run_stacked
from fl_server.recipes.run import simulation


def build_federated(protocol: Protocol, seed: int, data_root: str | None = None) -> FederatedData:
    """The protocol's clients: ``partition="rotation"`` is UPFL App. F's concept shift (``options["n_samples"]``
    samples, rotated per client); ``options["public_size"]`` holds a public set out of every client;
    ``options["val_clients"]`` moves that many training clients out of training into client-level validation;
    ``options["max_samples"]`` first keeps that many random samples of the split (smoke profiles)."""
    dataset = load_dataset(protocol.dataset, root=data_root, split=protocol.split)
    dataset = random_subset(dataset, protocol.options.get("max_samples", 0), seed)
    if protocol.partition == "rotation":
        return rotation_concept_shift(dataset, seed, n_samples=protocol.options.get("n_samples", 1000),
                                      num_clients=protocol.num_clients, val_fraction=protocol.val_fraction)
    fed = make_federated(dataset, protocol.partition, protocol.num_clients, protocol.new_fraction,
                         protocol.val_fraction, seed=seed, alpha=protocol.alpha,
                         public_size=protocol.options.get("public_size", 0))
    if count := protocol.options.get("val_clients"):
        fed = hold_out_validation_clients(fed, count)
    return fed


def build_simulation(protocol: Protocol, method: str, seed: int, run_dir: Path | None, device: str = "auto",
                     mode: str = "auto", progress: bool = True, data_root: str | None = None,
                     fed: FederatedData | None = None, test_at_best_only: bool = True,
                     checkpoint_every: int = 10, **engine: Any) -> Simulation:
    """The engine run of one method and seed under ``protocol``, built from its recipe
    (:func:`~lab.protocol.protocol_recipe`; ``run()`` writes ``run.json`` into ``run_dir``).
    ``engine``: further :class:`~fl_server.engine.RunConfig` fields (``dtype``, ``batch_stream``)."""
    fed = fed if fed is not None else build_federated(protocol, seed, data_root)
    recipe = protocol_recipe(protocol, method, data_root)
    engine.setdefault("safeguard", False)  # the papers' methods, without the device's safeguard
    return simulation(recipe, seed, run_dir, device, mode, progress, data_root, fed, test_at_best_only,
                      checkpoint_every, description=protocol_description(protocol), **engine)


def own_simulation(protocol: Protocol, method: str, seed: int, run_dir: Path | None, fed: FederatedData,
                   device: str = "auto", mode: str = "auto", progress: bool = True, data_root: str | None = None,
                   checkpoint_every: int = 10, engine: dict[str, Any] | None = None, **changes: Any) -> Simulation:
    """The engine run of an experiment with its own procedure (shift, map_incomplete, hetero, odpfl, btgfl),
    built from the recipe of ``method`` (an engine method) under ``protocol`` with ``changes`` (Recipe fields:
    ``model``, ``hyper``, ``local_iterations``). Such experiments train every method for the protocol's
    ``rounds``, validate every ``eval_every`` rounds and test the new clients at every validation, as they did
    before they built through recipes (same fingerprints, so their checkpoints resume). ``engine``: further
    RunConfig fields (``dtype``).

    >>> from lab.experiments import get_experiment
    >>> protocol = get_experiment("map-incomplete").protocols["fashion_mnist"]
    >>> sim = own_simulation(protocol, "MAP", 0, None, build_federated(protocol, 0))  # doctest: +SKIP
    """
    if protocol.method_rounds:
        raise ValueError("an experiment with its own procedure has no per-method round budgets (method_rounds)")
    recipe = protocol_recipe(protocol, method, data_root, **{"rounds": protocol.rounds,
                                                             "eval_every": protocol.eval_every, **changes})
    return simulation(recipe, seed, run_dir, device, mode, progress, data_root, fed, test_at_best_only=False,
                      checkpoint_every=checkpoint_every, description=protocol_description(protocol),
                      safeguard=False, **(engine or {}))  # the papers' methods, without the device's safeguard


def protocol_description(protocol: Protocol) -> dict[str, Any]:
    """The ``run.json`` fields of a run under ``protocol`` besides its recipe's."""
    return {"dataset": protocol.dataset, "protocol": dataclasses.asdict(protocol), "command": invocation()}


def seed_record(protocol: Protocol, method: str, seed: int, sim: Simulation, result: RunResult) -> dict[str, Any]:
    """The raw result record of a finished engine run."""
    return {
        "dataset": protocol.dataset, "method": method, "seed": seed, "model": protocol.model,
        "rounds": protocol.rounds_for(method), "best_round": result.best_round,
        "val": 100 * result.best_val,
        "test": None if result.test_at_best is None else 100 * result.test_at_best,
        "wall_s": round(result.wall_s, 2), "device": describe(sim.device), "mode": sim.mode,
        "hyper": sim.algorithm.hp.__dict__, "protocol_note": protocol.note_for(method),
        "eval_every": protocol.eval_every_for(method), "host": platform.node(),
        "curve": [{"round": r["round"], "val": r.get("val"), "test": r.get("test")}
                  for r in result.history if "val" in r],
        **({"batched_conv": sim.cfg.batched_conv} if sim.cfg.batched_conv != "native" else {}),
        **({"diverged_round": result.diverged_round} if result.diverged_round is not None else {}),
    }


def run_seed(protocol: Protocol, method: str, seed: int, run_dir: Path | None, device: str = "auto",
             mode: str = "auto", progress: bool = True, data_root: str | None = None,
             fed: FederatedData | None = None, test_at_best_only: bool = True,
             checkpoint_every: int = 10) -> dict[str, Any]:
    """Train and evaluate one method on one seed; returns the raw result record."""
    sim = build_simulation(protocol, method, seed, run_dir, device, mode, progress, data_root, fed,
                           test_at_best_only, checkpoint_every)
    return seed_record(protocol, method, seed, sim, sim.run())


def safe_name(method: str) -> str:
    """Method name as a folder name ("FedTTA++" -> "FedTTApp", "BTFL (bs=32)" -> "BTFL_bs32")."""
    return method.replace("+", "p").replace("/", "_").replace(" ", "_").translate(str.maketrans("", "", "()="))


def raw_path(results_dir: Path, experiment: str, dataset: str, method: str, seed: int) -> Path:
    return results_dir / "raw" / experiment / dataset / safe_name(method) / f"seed{seed}.json"


def seed_list(seeds: int | Sequence[int]) -> list[int]:
    """``3`` -> seeds 0, 1, 2; an explicit list (``python -m lab bench --seed 2``) is kept as given."""
    return list(range(seeds)) if isinstance(seeds, int) else list(seeds)


def method_defaults(method: str) -> dict[str, Any]:
    """The defaults of ``method``'s hyperparameter dataclass (JSON values), {} for an unknown method."""
    config = getattr(ALGORITHMS.get(method), "Config", None)
    if config is None:
        return {}
    out = {}
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = json.loads(json.dumps(f.default, default=str))
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = json.loads(json.dumps(f.default_factory(), default=str))
    return out


def refuse_stale(result: Path, protocol: Protocol, method: str) -> None:
    """A result file is reused only if it ran with the protocol's current hyperparameters for its method
    and its number of rounds; otherwise the table would silently mix settings. A hyperparameter the record
    lacks (a field added after the run) counts as the field's default. Raises ValueError naming what changed."""
    record = json.loads(result.read_text())
    recorded, defaults = record.get("hyper", {}), method_defaults(method)
    changed = {}
    for key, value in protocol.method_hp.get(method, {}).items():
        want = json.loads(json.dumps(value))
        got = recorded[key] if key in recorded else defaults.get(key)
        if got != want:
            changed[key] = (got, want)
    if "rounds" in record and record["rounds"] != protocol.rounds_for(method):
        changed["rounds"] = (record["rounds"], protocol.rounds_for(method))
    if changed:
        what = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(f"{result} ran with other hyperparameters than the protocol now sets ({what}); move it "
                         f"(and its run folder) away to rerun that seed")


def run_experiment(exp: Experiment, datasets: list[str], methods: list[str], seeds: int | Sequence[int],
                   results_dir: Path, runs_dir: Path, quick: bool = False, device: str = "auto",
                   mode: str = "auto", progress: bool = True, data_root: str | None = None,
                   command: str = "", stack_seeds: bool = False, stack_variants: bool = False) -> list[dict]:
    """Run every missing (dataset, method, seed) and rewrite the aggregated table.

    ``seeds`` is a count (seeds 0..n-1) or explicit seed numbers, so that seeds can run as separate
    processes or sessions; the table is aggregated from every raw seed file present either way.
    ``stack_seeds``: a method's missing seeds train together in this process (:func:`run_stacked_seeds`);
    ``stack_variants``: a seed's missing methods train together (the experiment's ``variants_fn``)."""
    if stack_seeds and (exp.runner is not None or exp.run_fn is not None):
        raise ValueError(f"{exp.name} trains with its own procedure: its seeds cannot be stacked (--stack-seeds is "
                         "for experiments whose rows are plain engine runs, e.g. upfl-table1)")
    if stack_variants and exp.variants_fn is None:
        raise ValueError(f"{exp.name}'s methods cannot train together (--stack-variants is for experiments whose "
                         "variants share their round shapes, e.g. upfl-hetero)")
    if exp.runner is not None:  # an experiment with its own protocol (e.g. btgfl)
        return getattr(_runner_module(exp), exp.runner.split(":")[1])(
            exp, datasets, methods, seeds, results_dir, runs_dir, quick, device, mode, progress, data_root, command)
    for dataset in datasets:
        if dataset not in exp.protocols:
            raise ValueError(f"{exp.name} has no protocol for {dataset!r}; choose from {', '.join(exp.protocols)}")
    protocols = {d: exp.protocols[d].quick() if quick else exp.protocols[d] for d in datasets}
    if exp.run_fn is None:  # rows of run_seed record their hyperparameters: refuse stale ones before training
        for dataset, protocol in protocols.items():
            for seed in seed_list(seeds):
                for method in methods:
                    if (out := raw_path(results_dir, exp.name, dataset, method, seed)).exists():
                        refuse_stale(out, protocol, method)
    if stack_seeds:
        for dataset, protocol in protocols.items():
            for method in methods:
                missing = [seed for seed in seed_list(seeds)
                           if not raw_path(results_dir, exp.name, dataset, method, seed).exists()]
                if missing:
                    run_stacked_seeds(exp, protocol, dataset, method, missing, results_dir, runs_dir, device, mode,
                                      progress, data_root, command)
        return aggregate(exp, results_dir, command)
    for dataset, protocol in protocols.items():
        for seed in seed_list(seeds):
            fed = None
            if stack_variants and exp.variants_fn is not None:
                missing = [m for m in methods if not raw_path(results_dir, exp.name, dataset, m, seed).exists()]
                if missing:
                    fed = build_federated(protocol, seed, data_root)
                    records = exp.variants_fn(protocol, missing, seed,
                                              [run_path(runs_dir, exp.name, dataset, m, seed) for m in missing],
                                              device, mode, progress, data_root, fed)
                    for method, record in zip(missing, records):
                        write_record(raw_path(results_dir, exp.name, dataset, method, seed),
                                     {**record, "command": command})
            for method in methods:
                out = raw_path(results_dir, exp.name, dataset, method, seed)
                if out.exists():
                    continue
                fed = fed if fed is not None else build_federated(protocol, seed, data_root)
                record = (exp.run_fn or run_seed)(protocol, method, seed, run_path(runs_dir, exp.name, dataset,
                                                                                   method, seed),
                                                  device, mode, progress, data_root, fed)
                write_record(out, {**record, "command": command})
    return aggregate(exp, results_dir, command)


def run_path(runs_dir: Path, experiment: str, dataset: str, method: str, seed: int) -> Path:
    """The run folder of one (experiment, dataset, method, seed): checkpoints, metrics, best state."""
    return runs_dir / experiment / dataset / safe_name(method) / f"seed{seed}"


def write_record(out: Path, record: dict[str, Any]) -> None:
    """A raw result record, written atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(record, indent=1))


def run_stacked_seeds(exp: Experiment, protocol: Protocol, dataset: str, method: str, seeds: list[int],
                      results_dir: Path, runs_dir: Path, device: str = "auto", mode: str = "auto",
                      progress: bool = True, data_root: str | None = None, command: str = "", **engine: Any) -> None:
    """``method``'s ``seeds`` under ``protocol`` trained together (:func:`fl_server.engine.stacked.run_stacked`:
    one vmapped round over every seed's clients; each seed's own run folder, checkpoints and raw record). Each
    seed's run equals its solo run in float64; in float32 the grouped kernels round differently and training
    amplifies that, so a stacked seed is its solo run with other rounding (as on another GPU). ``mode`` "auto"
    means vmap here, which stacking needs; ``engine``: further RunConfig fields (``dtype``)."""
    sims = [build_simulation(protocol, method, seed, run_path(runs_dir, exp.name, dataset, method, seed), device,
                             "vmap" if mode == "auto" else mode, progress, data_root, **engine) for seed in seeds]
    for seed, sim, result in zip(seeds, sims, run_stacked(sims)):
        write_record(raw_path(results_dir, exp.name, dataset, method, seed),
                     {**seed_record(protocol, method, seed, sim, result), "stacked_seeds": seeds, "command": command})


def aggregate_experiment(exp: Experiment, results_dir: Path, command: str = "") -> list[dict]:
    """``exp``'s table from its raw seed files by the aggregation that wrote it: an experiment with its own runner
    (btgfl, whose records hold stream columns) has its own ``aggregate`` in the runner's module."""
    if exp.runner is not None:
        return _runner_module(exp).aggregate(exp, results_dir, command)
    return aggregate(exp, results_dir, command)


def _runner_module(exp: Experiment) -> Any:
    """The module of ``exp.runner`` ("module:function")."""
    return importlib.import_module(exp.runner.split(":")[0])  # type: ignore[union-attr]


def aggregate(exp: Experiment, results_dir: Path, command: str = "") -> list[dict]:
    """Rows in the DESIGN.md schema from every raw seed file of ``exp`` (the harness's own record schema)."""
    rows: list[dict] = []
    base = results_dir / "raw" / exp.name
    for dataset in exp.protocols:
        for method in _methods_present(exp, base / dataset):
            records = [json.loads(p.read_text()) for p in sorted((base / dataset / method[1]).glob("seed*.json"))]
            for fields, values in _groups(records):
                split = fields["split"]
                rows.append({
                    "experiment": exp.name, "dataset": dataset, "method": method[0], **fields,
                    "metric": "accuracy", "mean": round(float(np.mean(values)), 2),
                    "std": round(float(np.std(values, ddof=1)) if len(values) > 1 else 0.0, 2),
                    "seeds": len(values), "paper": exp.paper.get((dataset, method[0], fields.get("shift", split))),
                    "device": ", ".join(sorted({r["device"] for r in records})),
                    "wall_s": round(float(np.mean([r["wall_s"] for r in records])), 1),
                    "rounds": records[0]["rounds"],
                    "best_round": [r["best_round"] for r in records],
                    "note": records[0].get("protocol_note", ""),
                    "command": records[-1].get("command") or command,  # the last seed's covers all
                    # seeds whose training diverged (weights not finite): a diverged run's numbers
                    **({"diverged_seeds": bad} if (bad := [r["seed"] for r in records if r.get("warning")
                                                           or r.get("diverged_round") is not None]) else {}),
                    **({"chance_seeds": low} if (low := chance_seeds(records, exp.protocols[dataset].dataset))
                       else {}),
                })
    out = results_dir / f"{exp.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(rows, indent=1) + "\n")
    return rows


def chance_seeds(records: list[dict], dataset: str, key: str = "val") -> list[int]:
    """The seeds whose training collapsed with finite weights: the run's validation accuracy (``key``, in
    percent: the training clients' split, or held-out validation clients) at chance (at most 1/C + 5 points, the product's rule,
    :func:`fl_server.diagnostics.collapse_warning`). Judged on validation, never on the new clients' test."""
    ceiling = 100 * (1 / NUM_CLASSES[dataset] + CHANCE_MARGIN)
    return [r["seed"] for r in records if r.get(key) is not None and r[key] <= ceiling]


def _groups(records: list[dict]) -> list[tuple[dict[str, Any], list[float]]]:
    """(row fields, per-seed values): from each record's ``results`` list (entries of fields + "value")
    when present, else its ``val`` and ``test``."""
    if not any("results" in r for r in records):
        return [({"split": s}, vals) for s in ("val", "test")
                if (vals := [r[s] for r in records if r.get(s) is not None])]
    groups: dict[tuple, list[float]] = {}
    for r in records:
        for entry in r.get("results", []):
            key = tuple((k, v) for k, v in entry.items() if k != "value")
            groups.setdefault(key, []).append(entry["value"])
    return [(dict(key), vals) for key, vals in groups.items()]


def _methods_present(exp: Experiment, folder: Path) -> list[tuple[str, str]]:
    if not folder.exists():
        return []
    found = {p.name for p in folder.iterdir() if p.is_dir()}
    names = [(m, safe_name(m)) for m in (*exp.methods, *exp.optional_methods)]
    return [n for n in names if n[1] in found]
