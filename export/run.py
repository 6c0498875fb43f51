"""Export a finished run (``run.json`` + ``best.npz`` in its run directory) into a device bundle."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from export.btfl import export_btfl_run
from export.bundle import export_specs, write_bundle
from export.quantize import freeze_weights, quantize_int8
from export.steps import device_specs
from fl_server import rundir
from fl_server.algorithms.btfl import BTFL
from fl_server.functional import make_forward
from fl_server.models.norm import calibrate, statistics, stat_norms
from fl_server.recipes import Recipe
from fl_server.recipes.run import client_data, rebuild
from fl_server.signing import ManifestSigner

BTFL_DLE_FILE = "btfl_dle.npz"  # a Flower BTFL run's global DLE, uploaded by its clients (fl_server.flower)


BATCH_NORM_RULE = {"statistics": "federated", "min_batch": 16, "small_batch": "running", "ema_momentum": 0.1}


def export_run(run_dir: str | Path, dest: str | Path, int8: bool = False, data_root: str | None = None,
               signer: ManifestSigner | None = None, recipe: Recipe | None = None,
               batch_norm: dict | None = None) -> Path:
    """Build the method's device graphs around the best-validation weights of ``run_dir``; write a bundle.
    ``int8``: also ship ``forward_int8``, the received model frozen and dynamically quantized (plain inference).
    ``data_root``: where the run's data set lives (BTFL re-reads the training clients' data for their DLEs).
    ``signer``: sign the manifest (``manifest.sig``). ``recipe``: the run's recipe, needed only when it was built
    in Python (run.json then names no recipe file to rebuild the model from).
    ``batch_norm``: overrides of :data:`BATCH_NORM_RULE` for a batch-normalised model (the manifest's
    ``batch_norm`` entry, ``edge_sdk.batchnorm``); its population statistics are the federated ones of the
    final weights over the run's training clients (re-read from ``data_root``), shipped as ``stats``."""
    run = rundir.read_run(run_dir)
    recipe, model, algorithm = rebuild(run, data_root, recipe=recipe)
    extra = {"model": run["model"], "dataset": run["dataset"], "seed": run["seed"],
             "input_shape": run["input_shape"], "num_classes": run["num_classes"],
             "preprocess": recipe.preprocess.to_dict(),  # type: ignore[union-attr]
             **{k: run[k] for k in ("recipe", "federation", "protocol", "data") if run.get(k) is not None}}
    if isinstance(algorithm, BTFL):
        if int8:
            raise ValueError("--int8 is not available for BTFL bundles")
        uploaded = None
        dle_file = Path(run_dir) / BTFL_DLE_FILE
        if dle_file.is_file():  # a Flower run: the clients' DLE uploads, averaged by the server
            with np.load(dle_file, allow_pickle=False) as f:
                uploaded = (f["global_dle"], int(f["dle_clients"][0]))
        return export_btfl_run(algorithm, rundir.load_best(run_dir), run, dest, extra, data_root, signer, recipe,
                               uploaded)
    state = {k: {n: v.float() for n, v in d.items()} for k, d in rundir.load_best(run_dir).items()
             if k in algorithm.device_weights}
    if stat_norms(model):
        if int8:
            raise ValueError("--int8 is not available for batch-normalised models")
        fed = client_data(run, data_root, recipe)
        x, forward = torch.from_numpy(fed.dataset.x).float(), make_forward(model)
        calibrate(model, lambda xb: forward(state["params"], xb),
                  (x[torch.as_tensor(t[i:i + 256])] for t in fed.train for i in range(0, len(t), 256)))
        extra["batch_norm"] = {**BATCH_NORM_RULE, **(batch_norm or {})}
    specs = device_specs(algorithm, state)  # forward and the method's device step (Algorithm.device_step)
    weights = {k: {n: v.numpy() for n, v in d.items()} for k, d in state.items()}
    if stat_norms(model):
        weights["stats"] = {n: v.float().numpy() for n, v in statistics(model).items()}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        graphs = export_specs(specs, Path(tmp))
        if int8:
            frozen = freeze_weights(graphs["forward"], weights["params"], Path(tmp) / "forward_frozen.onnx")
            graphs["forward_int8"] = quantize_int8(frozen, Path(tmp) / "forward_int8.onnx")
        return write_bundle(dest, graphs, weights, run["method"], run["hyper"], extra=extra, signer=signer)
