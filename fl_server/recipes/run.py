"""Train a recipe: its clients, its engine run, its run directory; and a finished run's recipe and method again.

>>> from fl_server.recipes import train
>>> from fl_server.recipes.presets import builtin_recipe
>>> record = train(builtin_recipe("digits", "FedAvg", rounds=2), "runs/doc", progress=False)  # doctest: +SKIP
>>> record["best_round"] in (0, 1)  # doctest: +SKIP
True
"""
from __future__ import annotations

import dataclasses
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from edge_sdk import Preprocess
from fl_server.algorithms import Algorithm, build_algorithm
from fl_server.data.federated import (FederatedData, hold_out_validation_clients, make_federated,
                                     natural_federated, random_subset)
from fl_server import rundir
from fl_server.torch_device import describe
from fl_server.diagnostics import run_report
from fl_server.engine import RunConfig, Simulation
from fl_server.models import MODELS, Classifier
from fl_server.recipes.data import DataSpec, new_clients_identity
from fl_server.recipes.errors import RecipeError
from fl_server.recipes.loader import load_recipe
from fl_server.recipes.recipe import Federation, Recipe
from fl_server.recipes.same_run import changed, model_forward


def federate(recipe: Recipe, seed: int = 0, data_root: str | None = None) -> FederatedData:
    """The recipe's clients for ``seed``: its data preprocessed, partitioned (or the data's own client ids),
    new clients and validation drawn from ``seed``."""
    dataset = recipe.data.dataset(recipe.preprocess, data_root)  # type: ignore[arg-type]
    f = recipe.federation
    dataset = random_subset(dataset, f.max_samples, seed)
    if f.partition == "natural":
        fed = natural_federated(dataset, recipe.data.client_ids, f.new_fraction, f.val_fraction, seed)  # type: ignore[arg-type]
    else:
        fed = make_federated(dataset, f.partition or "pathological", f.num_clients, f.new_fraction, f.val_fraction,
                             seed=seed, alpha=f.alpha, public_size=f.public_size)
    if f.val_clients:
        fed = hold_out_validation_clients(fed, f.val_clients)
    if fed.num_train_clients < 1:
        raise RecipeError(f"federation: no training clients ({len(fed.new)} clients, all new); lower new_fraction")
    return fed


def invocation() -> str:
    """The command line of this process (the record of how a run was made)."""
    return " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])


def describe_run(recipe: Recipe, algorithm: Algorithm, fed: FederatedData | None, seed: int) -> dict[str, Any]:
    """``run.json``: what ``fl-server export`` needs to rebuild the model around ``best.npz`` (``recipe``: the
    recipe's ``FILE.py:NAME``, null when it was built in Python), and ``new_clients``: the held-out clients'
    identity (:func:`~fl_server.recipes.data.new_clients_identity`; absent when the clients are not known
    here, a Flower run's), and ``model_forward``: what the model computes (:func:`~fl_server.recipes.same_run.
    model_forward`), by which a resumed or exported run knows its model code unchanged."""
    return {"method": recipe.method, "hyper": dataclasses.asdict(algorithm.hp), "model": recipe.model_name,
            "dataset": recipe.data.name, "input_shape": list(recipe.input_shape), "num_classes": recipe.num_classes,
            "seed": seed, "recipe": recipe.source, "data": recipe.data.describe(),
            "federation": dataclasses.asdict(recipe.federation),
            "preprocess": recipe.preprocess.to_dict(),  # type: ignore[union-attr]
            **({"input_moments": moments} if (moments := recipe.preprocess.moments_dict()) else {}),  # type: ignore[union-attr]
            "model_forward": model_forward(recipe.build_model(seed)),
            **({"new_clients": new_clients_identity(fed)} if fed is not None else {}),
            "command": invocation()}


def simulation(recipe: Recipe, seed: int = 0, run_dir: str | Path | None = None, device: str = "auto",
               mode: str = "auto", progress: bool = True, data_root: str | None = None,
               fed: FederatedData | None = None, test_at_best_only: bool = True, checkpoint_every: int = 10,
               description: dict[str, Any] | None = None, **engine: Any) -> Simulation:
    """The engine run of ``recipe`` for ``seed`` (``run()`` writes ``run.json`` into ``run_dir``). ``fed``: clients
    built by the caller (the bench's protocols that are not a recipe federation); ``description``: extra
    ``run.json`` fields; ``engine``: further :class:`~fl_server.engine.RunConfig` fields (``dtype``,
    ``batch_stream``)."""
    fed = fed if fed is not None else federate(recipe, seed, data_root)
    model = recipe.build_model(seed)
    algorithm = recipe.build_algorithm(model, fed.num_train_clients, seed)
    cfg = RunConfig(rounds=recipe.rounds, local_iterations=recipe.local_iterations, batch_size=recipe.batch_size,
                    client_fraction=recipe.federation.client_fraction, eval_every=recipe.eval_every, seed=seed,
                    mode=mode, device=device, out_dir=str(run_dir) if run_dir else None, progress=progress,
                    test_at_best_only=test_at_best_only, checkpoint_every=checkpoint_every, **engine)
    described = {**describe_run(recipe, algorithm, fed, seed), **(description or {})}
    if run_dir is not None:
        refuse_other_run(Path(run_dir), described)
    return Simulation(algorithm, fed, cfg, described)


def refuse_other_run(run_dir: Path, described: dict[str, Any]) -> None:
    """RecipeError (one line) when ``run_dir`` already holds a run whose preprocessing, new clients or model
    differ from ``described``'s (a recipe edited since): resuming it would report the old run's accuracy for a
    bundle that preprocesses, a split that holds out, or a model that computes, otherwise."""
    path = run_dir / rundir.RUN
    if not path.is_file():
        return
    differs = changed(json.loads(path.read_text()), json.loads(json.dumps(described, default=str)))
    if differs:
        raise RecipeError(f"{run_dir} holds a run trained with other {_WHAT[differs[0]]} than this recipe's; train "
                          f"into another folder (--out), or delete it to start over")


_WHAT = {"preprocess": "preprocessing", "new_clients": "new clients",
         "model_forward": "model code (the same weights compute other outputs)"}


def train(recipe: Recipe, run_dir: str | Path, seed: int = 0, device: str = "auto", progress: bool = True,
          mode: str = "auto", data_root: str | None = None, test_at_best_only: bool = False,
          checkpoint_every: int = 10) -> dict[str, Any]:
    """Train ``recipe`` into ``run_dir`` (resumable; ``fl-server export RUN_DIR`` makes its bundle); returns the
    record: best validation accuracy and round, the new clients' accuracy there (``test``; ``test_of``: "device",
    each new client's model as its device personalises it, or "received", the model a device receives, for a
    method whose devices personalise on labeled data: BTFL), ``received_test`` (the received model's, for a
    method that personalises; :func:`fl_server.diagnostics.adaptation_note`) and ``adaptation_note`` (one line
    when personalising cost a new client more than a point, else None; under a rule that keeps the received model,
    what adapting without it would do on the run's validation data, :func:`fl_server.diagnostics.
    kept_received_note`), ``safeguard`` (the name of the rule a device applies after personalising,
    :attr:`Algorithm.safeguard`, or None; ``"rollback"``: every device keeps the received model, so ``test`` is the
    received model's), wall time, device, and ``warning``: one line when the new clients' predictions collapsed or
    sit at chance (:func:`fl_server.diagnostics.collapse_warning`), else None."""
    sim = simulation(recipe, seed, run_dir, device, mode, progress, data_root, None, test_at_best_only,
                     checkpoint_every)
    result = sim.run()
    # predictions collapsed to one class or at chance (run.json keeps it for export), and what personalising did to
    # each new client against the model it received
    warning, cost = run_report(sim, validation=result.best_val)
    rule, test_of = sim.device_safeguard, "received" if type(sim.algorithm).device_labels else "device"
    rundir.write_run(Path(run_dir), {**rundir.read_run(run_dir), "warning": warning, "best_round": result.best_round,
                                     "new_client_accuracy": result.test_at_best, "test_of": test_of,
                                     "safeguard": None if rule is None else rule.name})
    return {"recipe": recipe.name or recipe.source or recipe.model_name, "dataset": recipe.data.name,
            "method": recipe.method, "seed": seed, "model": recipe.model_name, "rounds": recipe.rounds,
            "best_round": result.best_round, "val": 100 * result.best_val,
            "test": None if result.test_at_best is None else 100 * result.test_at_best,
            "test_of": test_of,
            "received_test": None if cost is None else 100 * cost["received"],
            "adaptation_note": None if cost is None else cost["line"], "warning": warning,
            "safeguard": None if rule is None else rule.name,
            "diverged_round": result.diverged_round,
            "wall_s": round(result.wall_s, 2), "device": describe(sim.device), "mode": sim.mode,
            "hyper": sim.algorithm.hp.__dict__, "eval_every": recipe.eval_every, "host": platform.node(),
            "curve": [{"round": r["round"], "val": r.get("val"), "test": r.get("test")}
                      for r in result.history if "val" in r]}


# ---------------------------------------------------------------------- a finished run, again
def recipe_of_run(run: dict[str, Any], data_root: str | None = None) -> Recipe:
    """The recipe a ``run.json`` (or a bundle's manifest) was trained from: its source file (``"recipe"``) with the
    method and federation the run recorded (a job's or a flag's changes), else the built-in data set
    (``data.builtin``: a user's data named like a built-in one is never taken for it) and zoo model it names, with
    its federation or the bench's ``protocol``."""
    def federation(fed: dict[str, Any]) -> Federation:
        keys = {f.name for f in dataclasses.fields(Federation)}
        return Federation(**{k: v for k, v in fed.items() if k in keys})

    if run.get("recipe"):
        recipe = load_recipe(run["recipe"])
        method = run.get("method", recipe.method)
        return recipe.replace(method=method, hyper=recipe.hyper if method == recipe.method else {},
                              federation=federation(run["federation"]) if run.get("federation") else
                              recipe.federation)
    data = run.get("data") or {}
    if not data.get("builtin") or run.get("model") not in MODELS:  # a user's data or model, built in Python
        raise RecipeError(f"the run of {run.get('dataset')!r} names no recipe file (its recipe was built in Python): "
                          f"pass the recipe in Python (export_run(run_dir, dest, recipe=recipe); "
                          f"device_samples.client_samples(manifest, recipe=recipe)) or train with fl-server train "
                          f"--recipe FILE.py:NAME")
    split = data.get("split") or (run.get("protocol") or {}).get("split", "all")
    return Recipe(model=run["model"], data=DataSpec.builtin(data["builtin"], data_root, split=split),
                  federation=federation(run.get("federation") or run.get("protocol") or {}), method=run["method"],
                  preprocess=Preprocess.from_dict(run["preprocess"]) if run.get("preprocess") else None)


def rebuild(run: dict[str, Any], data_root: str | None = None, num_train_clients: int = 1,
            recipe: Recipe | None = None) -> tuple[Recipe, Classifier, Algorithm]:
    """(recipe, model, method) of a finished run, with its recorded hyperparameters (``fl-server export``);
    ``recipe``: the run's recipe when its run.json names no file (built in Python)."""
    recipe = recipe if recipe is not None else recipe_of_run(run, data_root)
    model = recipe.build_model(run["seed"])
    if list(model.input_shape or ()) != list(run["input_shape"]):  # type: ignore[arg-type]
        raise RecipeError(f"the recipe {run.get('recipe')} now builds inputs {list(model.input_shape or ())}, the "
                          f"run trained on {run['input_shape']}; restore the recipe the run was trained with")
    now = {"preprocess": json.loads(json.dumps(recipe.preprocess.to_dict())),  # type: ignore[union-attr]
           "model_forward": model_forward(model)}
    differs = changed(run, now)
    if differs:  # the recipe was edited after training: the run's weights would be shipped in another pipeline
        key = differs[0]
        shown = "" if key == "model_forward" else f" (run.json: {_brief(run[key])}; the recipe now: {_brief(now[key])})"
        raise RecipeError(f"the recipe's {_WHAT[key]} is not the run's{shown}; restore the recipe the run was trained "
                          f"with, or train again")
    hyper = {k: v for k, v in run["hyper"].items() if not (k == "encoder_model" and v == "recipe")}
    factory = None if isinstance(recipe.model, str) else recipe.model_factory()
    algorithm = build_algorithm(recipe.method, model, num_train_clients, seed=run["seed"], model_factory=factory,
                                **hyper)
    return recipe, model, algorithm


def _brief(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:197] + "..."


def client_data(run: dict[str, Any], data_root: str | None = None, recipe: Recipe | None = None) -> FederatedData:
    """The clients of a finished run (BTFL's export averages the training clients' DLEs)."""
    return federate(recipe if recipe is not None else recipe_of_run(run, data_root), run["seed"], data_root)


__all__ = ["client_data", "federate", "rebuild", "recipe_of_run", "simulation", "train"]
