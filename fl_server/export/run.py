"""Export a finished run into a device bundle, from its run directory alone: ``run.json`` (how to rebuild the
model), ``best.npz`` (the best-validation state) and ``device.npz`` (what the run's finalize step computed from
the clients' data: population statistics, BTFL's global DLE). No data set is read here."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from fl_server.export.btfl import export_btfl_run
from fl_server.export.bundle import export_specs, write_bundle
from fl_server.export.quantize import freeze_weights, quantize_int8
from fl_server.export.steps import device_specs
from fl_server import rundir
from fl_server.algorithms.btfl import BTFL
from fl_server.diagnostics import NONFINITE_FIX, describe_nonfinite, nonfinite_weights
from fl_server.models.norm import BATCH_NORM_RULE, set_statistics, stat_norms
from fl_server.recipes import Recipe
from fl_server.recipes.run import rebuild
from fl_server.signing import ManifestSigner


def export_run(run_dir: str | Path, dest: str | Path, int8: bool = False, data_root: str | None = None,
               signer: ManifestSigner | None = None, recipe: Recipe | None = None, freeze: bool = True) -> Path:
    """Build the method's device graphs around the best-validation weights of ``run_dir``; write a bundle whose
    manifest records the method's device step (:func:`fl_server.export.bundle.write_bundle`). ``int8``: also ship
    ``forward_int8``, the received model frozen and dynamically quantized (plain inference). ``data_root``: where a
    built-in data set lives (the recipe names it; nothing is read). ``signer``: sign the manifest
    (``manifest.sig``). ``recipe``: the run's recipe, needed only when it was built in Python (run.json then names
    no recipe file to rebuild the model from). A batch-normalised model ships the run's population statistics
    (``stats``) and the device's rule (``batch_norm``, :data:`fl_server.models.norm.BATCH_NORM_RULE`), by which
    training evaluated its new clients. A best state with NaN or infinite weights (a diverged run) is refused.
    ``freeze`` (default): the weights the device step never changes are constants of its graph, which refers to
    them in the bundle's weights (faster steps, each weight stored once: :func:`fl_server.export.steps.device_specs`).

    >>> export_run("runs/mnist-TENT", "runs/bundle")  # doctest: +SKIP
    PosixPath('runs/bundle')
    """
    run = rundir.read_run(run_dir)
    recipe, model, algorithm = rebuild(run, data_root, recipe=recipe)
    preprocess = json.loads(json.dumps(recipe.preprocess.to_dict()))  # type: ignore[union-attr]
    device = rundir.read_device(run_dir)
    extra = {"model": run["model"], "dataset": run["dataset"], "seed": run["seed"],
             "input_shape": run["input_shape"], "num_classes": run["num_classes"], "preprocess": preprocess,
             **{k: run[k] for k in ("recipe", "federation", "protocol", "data", "new_clients", "model_forward",
                                    "input_moments") if run.get(k) is not None}}
    best = rundir.load_best(run_dir)
    diverged = nonfinite_weights(best)
    if diverged:
        raise ValueError(f"{run_dir}: the run's best state is not finite ({describe_nonfinite(diverged)}): training "
                         f"diverged, so no bundle is written; train again and {NONFINITE_FIX}")
    missing = [name for name in type(algorithm).finalize_weights if name not in device]
    if missing:
        raise ValueError(f"{run_dir}: device.npz lacks {', '.join(missing)} (the run's finalize step writes them); "
                         "train the run again with this version")
    if stat_norms(model):
        if "stats" not in device:
            raise ValueError(f"{run_dir}: the model is batch-normalised but device.npz holds no population "
                             "statistics (a run trained before this version): train it again with this version")
        if int8:
            raise ValueError("--int8 is not available for batch-normalised models")
        set_statistics(model, device["stats"])
        extra["batch_norm"] = dict(BATCH_NORM_RULE)
    if isinstance(algorithm, BTFL):
        if int8:
            raise ValueError("--int8 is not available for BTFL bundles")
        return export_btfl_run(algorithm, best, device, dest, extra, signer)
    state = {k: {n: v.float() for n, v in d.items()} for k, d in best.items()
             if k in algorithm.device_weights}
    specs = device_specs(algorithm, state, freeze)  # forward and the method's device step (Algorithm.device_step)
    weights = {k: {n: v.numpy() for n, v in d.items()} for k, d in state.items()}
    weights.update(device)  # stats, and any finalize weights of the method
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        graphs = export_specs(specs, Path(tmp))
        if int8:
            frozen = freeze_weights(graphs["forward"], weights["params"], Path(tmp) / "forward_frozen.onnx")
            graphs["forward_int8"] = quantize_int8(frozen, Path(tmp) / "forward_int8.onnx")
        return write_bundle(dest, graphs, weights, run["method"], run["hyper"], extra=extra, signer=signer)
