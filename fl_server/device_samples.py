"""Device-side data, prepared on the coordinator's side: a small ``.npz`` of samples a device example reads
with numpy alone (the device examples import only ``edge_sdk``).

    fl-server device-data http://127.0.0.1:8000 --method TENT --kind stream --out runs/device-stream.npz
    fl-server device-data runs/bundle --kind clients --out runs/new-clients.npz

The samples belong to the bundle's own run: held-out *new* clients the training never saw, as *raw* images (the
device applies the manifest's ``preprocess``). Labels are for scoring only. The manifest names the recipe file or
built-in data set, the federation and the seed, from which the clients are rebuilt
(:func:`fl_server.recipes.run.recipe_of_run`, :func:`~fl_server.recipes.run.federate`), and ``new_clients``, the
run's own new clients' fingerprint (:func:`~fl_server.recipes.data.new_clients_identity`): the rebuilt new clients
must match it, else nothing is written (a changed recipe file or other data would make a different split, whose
"new" clients hold training samples).

* ``stream`` (examples/stream_inference.py): one new client's warm-up window (``warm_x``, ``warm_y``) and a
  stream in three phases (``stream_x``, ``stream_y``, ``stream_phase``): the client's own unseen samples; its
  samples under an image corruption; samples of classes the client never had.
* ``clients`` (examples/personalize_on_device.py): every new client's samples, ``x``, ``y`` and
  ``offsets`` (client k holds rows ``offsets[k]:offsets[k + 1]``), in the data set's order: an image folder's
  class by class, so draw a warm-up window at random, not the first rows.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fl_server.data.corruptions import corrupt
from fl_server.data.datasets import load_dataset
from fl_server.data.federated import FederatedData, subset_indices
from fl_server.recipes import Recipe
from fl_server.recipes.data import new_clients_identity
from fl_server.recipes.loader import split_source
from fl_server.recipes.run import federate, recipe_of_run

PHASES = ("in-distribution", "corrupted", "external classes")


def run_recipe(manifest: dict[str, Any], data_dir: str | None = None, recipe: Recipe | None = None) -> Recipe:
    """The recipe of the run behind a bundle: ``recipe`` when given (a recipe built in Python: the manifest then
    names no recipe file), else the one its manifest names, rebuilt from the working directory."""
    if "seed" not in manifest or not (manifest.get("federation") or manifest.get("protocol")):
        raise ValueError("this bundle's manifest does not say how its clients were made (no seed / federation): "
                         "give the device your own samples instead")
    source = manifest.get("recipe")  # FILE.py:NAME (a bundle names no folder), in the working directory
    if recipe is None and source and not split_source(source)[0].is_file():
        raise ValueError(f"the bundle's recipe {source} is not found (a bundle names it FILE.py:NAME, relative to "
                         f"the working directory): run from the folder that holds it or pass "
                         f"--recipe PATH/FILE.py:NAME")
    return recipe if recipe is not None else recipe_of_run(manifest, data_dir)


def bundle_clients(manifest: dict[str, Any], data_dir: str | None = None,
                   recipe: Recipe | None = None) -> tuple[FederatedData, np.ndarray]:
    """(the clients of the run behind a bundle, its new clients checked against the manifest's ``new_clients``;
    the raw images their indices point into). ``recipe``: the run's recipe, needed only when it was built in
    Python (the manifest then names no recipe file)."""
    recipe = run_recipe(manifest, data_dir, recipe)
    recorded = manifest.get("new_clients")
    if not isinstance(recorded, dict):
        raise ValueError("this bundle's manifest does not identify its run's new clients (no new_clients): a Flower "
                         "run holds none out (its clients are the SuperNodes'), so give the device your own samples; "
                         "a bundle exported before the record was kept: export its run again (fl-server export "
                         "RUN_DIR --out BUNDLE)")
    seed = int(manifest["seed"])
    fed = federate(recipe, seed, data_dir)
    rebuilt = new_clients_identity(fed)
    if rebuilt != recorded:
        raise ValueError(f"the new clients rebuilt from {recipe.source or 'the recipe'} and the data (seed {seed}) "
                         f"are not the run's ({rebuilt['clients']} clients / {rebuilt['samples']} samples, sha256 "
                         f"{rebuilt['sha256'][:12]}; the run held out {recorded.get('clients')} / "
                         f"{recorded.get('samples')}, {str(recorded.get('sha256'))[:12]}): the recipe file or the "
                         f"data (--data-dir) changed since training, and a different split would hand out training "
                         f"samples; restore them or give the device your own samples")
    data = recipe.data
    if data.builtin_name:  # built-in data sets are float32 NCHW in [0, 1] as loaded: that is what a device gets
        raw = load_dataset(data.builtin_name, root=data_dir or data.data_dir, split=data.split).x
    elif isinstance(data.x, list):
        raise ValueError("the recipe's images differ in size: give the device your own samples instead")
    else:
        raw = np.asarray(data.x)
    return fed, raw[subset_indices(len(raw), recipe.federation.max_samples, seed)]  # the clients' index space


def stream_samples(manifest: dict[str, Any], client: int = 0, warmup: int = 32, per_phase: int = 200,
                   corruption: str = "gaussian_noise", severity: int = 3, seed: int = 0,
                   data_dir: str | None = None, recipe: Recipe | None = None) -> dict[str, np.ndarray]:
    """New client ``client``'s warm-up window and three-phase stream (module docstring; ``recipe``: as for
    :func:`bundle_clients`)."""
    recipe = run_recipe(manifest, data_dir, recipe)
    if not recipe.data.builtin_name:  # the corruptions are defined on a built-in set's float NCHW images in [0, 1]
        raise ValueError("the corrupted phase needs a built-in data set (float grayscale or RGB images); use --kind "
                         "clients")
    fed, x = bundle_clients(manifest, data_dir, recipe)
    if not 0 <= client < len(fed.new):
        raise ValueError(f"client must be in [0, {len(fed.new)}), got {client}")
    y = fed.dataset.y
    rng = np.random.default_rng(seed)
    own = rng.permutation(fed.new[client])
    if len(own) < warmup + 2:
        raise ValueError(f"client {client} has {len(own)} samples; need more than the warm-up's {warmup}")
    n = min(per_phase, len(own) - warmup)
    ind = own[warmup:warmup + n]
    shifted = rng.choice(own, size=n, replace=len(own) < n)
    pool = np.concatenate([c for k, c in enumerate(fed.new) if k != client])
    pool = pool[~np.isin(y[pool], np.unique(y[own]))]
    ext = rng.choice(pool, size=n, replace=False)
    return {"warm_x": x[own[:warmup]].astype(np.float32), "warm_y": y[own[:warmup]],
            "stream_x": np.concatenate([x[ind], corrupt(x[shifted], corruption, severity, seed), x[ext]]
                                       ).astype(np.float32),
            "stream_y": np.concatenate([y[ind], y[shifted], y[ext]]), "stream_phase": np.repeat(np.arange(3), n),
            "phases": np.array(PHASES), "client": np.array(client)}


def client_samples(manifest: dict[str, Any], data_dir: str | None = None,
                   recipe: Recipe | None = None) -> dict[str, np.ndarray]:
    """Every new client's samples (module docstring; ``recipe``: as for :func:`bundle_clients`)."""
    fed, raw = bundle_clients(manifest, data_dir, recipe)
    idx = np.concatenate(fed.new)
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in fed.new])])
    return {"x": raw[idx], "y": fed.dataset.y[idx], "offsets": offsets}


def write_samples(out: Path, arrays: dict[str, np.ndarray]) -> Path:
    """Write ``arrays`` as an ``.npz`` (plain arrays: a device reads it with ``allow_pickle=False``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    return out
