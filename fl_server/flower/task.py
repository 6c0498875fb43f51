"""The federated run a Flower app trains, and the in-process engine's pieces each side of it calls.

A run is described by the Flower run config (``[tool.flwr.app.config]`` of the app, ``flwr run --run-config``):
a recipe (a user's recipe file, or a built-in data set's preset recipe, :func:`fl_server.recipes.presets.
builtin_recipe`, with the run config's overrides), a seed and a dtype. Both sides build the same method object
from it; the server never holds data, and only states and the method's messages cross the wire. A SuperNode
trains on the data it holds (``data`` in its ``--node-config``: an arrays file or an image folder,
:func:`load_node_data`), or, for tests and simulations, on one partition of the recipe's own data set
(``partition-id``, :func:`load_partition`).

The client step is the engine's :func:`~fl_server.engine.simulation.run_local_steps` over the client's own
batch stream (:func:`~fl_server.engine.simulation.client_rng`, the engine's ``batch_stream="per_client"``); the
server calls the method's own ``client_start`` and ``aggregate``. So a Flower run and an in-process run with
``batch_stream="per_client"`` and the same recipe, seed and clients end with the same weights.

Example:
    >>> recipe = FlowerRecipe.from_config({"dataset": "mnist", "method": "FedAvg", "num-clients": 3,
    ...                                    "new-fraction": 0.0, "rounds": 3})
    >>> recipe.recipe.federation.num_clients, recipe.rounds
    (3, 3)
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from fl_server.algorithms.base import CLIENT_FACTS, Algorithm, NotApplicable, declared_safeguard
from fl_server.algorithms.btfl import BTFL
from fl_server.algorithms.odpfl_hn import ODPFLHN
from fl_server.data.partitions import train_val_split
from fl_server.engine.simulation import (RNG_EVAL, Simulation, client_batches, client_rng, run_local_steps,
                                        safeguarded_logits)
from fl_server.functional import State, make_forward, stack, unstack
from fl_server.models.norm import (client_sums, federated_statistics, norm_mode, norm_names, set_statistics,
                                   statistics_arrays)
from fl_server.recipes import DataSpec, Federation, Recipe, RecipeError, load_recipe
from fl_server.recipes.presets import builtin_recipe
from fl_server.recipes.run import federate, simulation

# run-config key -> field of the built-in data set's preset recipe (Recipe or Federation) it overrides
_RECIPE_KEYS = {"num-clients": "num_clients", "new-fraction": "new_fraction", "val-fraction": "val_fraction",
                "rounds": "rounds", "local-iterations": "local_iterations", "batch-size": "batch_size",
                "client-fraction": "client_fraction", "partition": "partition", "model": "model",
                "max-samples": "max_samples"}
_KNOWN = {"dataset", "method", "seed", "dtype", "eval-every", "run-dir", "data-dir", "round-timeout", "min-nodes",
          "min-train-nodes", "recipe", *_RECIPE_KEYS}


_FILE_OWNS = ("dataset", "method", "model")  # what a recipe file sets itself: refused beside one


def recipe_of_config(cfg: Mapping[str, Any]) -> Recipe:
    """The run's recipe: the recipe file ``recipe`` or the preset of ``dataset`` and ``method`` (default mnist,
    FedAvg), with every set (non-empty) key of :data:`_RECIPE_KEYS` applied over it (``rounds=50`` trains 50
    rounds whichever the recipe). Beside a recipe file, ``dataset``, ``method`` and ``model`` are refused (the
    file sets them, and ``fl-server export`` rebuilds the model from it)."""
    changes = {field: cfg[key] for key, field in _RECIPE_KEYS.items() if cfg.get(key, "") != ""}
    if not cfg.get("recipe"):
        return builtin_recipe(str(cfg.get("dataset") or "mnist"), str(cfg.get("method") or "FedAvg"), **changes)
    clash = [key for key in _FILE_OWNS if cfg.get(key, "") != ""]
    if clash:
        raise RecipeError(f"run config: {', '.join(f'{k}={cfg[k]!r}' for k in clash)} beside recipe="
                          f"{cfg['recipe']!r}: the recipe file sets its own {'/'.join(clash)}; drop "
                          f"{'them' if len(clash) > 1 else 'it'} from the run config or edit the file")
    recipe = load_recipe(str(cfg["recipe"]))
    fed_keys = {f.name for f in dataclasses.fields(Federation)}
    fed = {k: v for k, v in changes.items() if k in fed_keys}
    rest = {k: v for k, v in changes.items() if k not in fed_keys}
    if fed:
        rest["federation"] = dataclasses.replace(recipe.federation, **fed)
    return recipe.replace(**rest) if rest else recipe


@dataclass(frozen=True)
class FlowerRecipe:
    """One federated run: its recipe (a user's recipe file, run config ``recipe = "FILE.py[:NAME]"``, the same
    file on every machine, which sets model, data, federation, method and rounds; or the preset recipe of the
    run config's ``dataset`` and ``method`` with its overrides), seed, dtype and validation interval."""

    recipe: Recipe
    seed: int = 0
    dtype: str = "float32"
    eval_every: int = 0  # 0: validate the last round only

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> FlowerRecipe:
        """Build from a Flower run config; an unknown key, data set or method fails here, with its name."""
        unknown = sorted(set(cfg) - _KNOWN)
        if unknown:
            raise ValueError(f"unknown run-config key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KNOWN))}")
        dtype = str(cfg.get("dtype", "float32"))
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype {dtype!r}: use 'float32' or 'float64'")
        return cls(recipe_of_config(cfg), int(cfg.get("seed", 0)), dtype, int(cfg.get("eval-every", 0)))

    @property
    def method(self) -> str:
        return self.recipe.method

    @property
    def rounds(self) -> int:
        return self.recipe.rounds

    @property
    def local_iterations(self) -> int:
        return self.recipe.local_iterations

    @property
    def batch_size(self) -> int:
        return self.recipe.batch_size

    @property
    def client_fraction(self) -> float:
        return self.recipe.federation.client_fraction

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def in_process(self, data_root: str | None = None, mode: str = "loop") -> Simulation:
        """The in-process engine's run of the same recipe, clients and batch draws (``batch_stream="per_client"``):
        what a Flower run of it equals."""
        return simulation(self.recipe, self.seed, None, "cpu", mode, False, data_root, batch_stream="per_client",
                          dtype=self.dtype)

    def build_algorithm(self, num_train_clients: int) -> Algorithm:
        """The method object, with the same initial weights on every side (seeded like the engine's runs)."""
        return self.recipe.build_algorithm(self.recipe.build_model(self.seed), num_train_clients, self.seed)


@dataclass
class ClientData:
    """One training client's own data: training and validation samples (numpy, the data set's scaling)."""

    partition_id: int
    num_partitions: int
    num_classes: int
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray

    local: bool = False  # the node's own data (its client id is the server's, sent with each message)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def placed(self, config: Mapping[str, Any]) -> ClientData:
        """Node-local data as the client the server numbered it (``client-id`` of ``num-clients`` in a message's
        config: its batch stream and its row of the method's state); a partition keeps its own id."""
        if not self.local:
            return self
        return dataclasses.replace(self, partition_id=int(config["client-id"]),
                                   num_partitions=int(config["num-clients"]))


_FEDERATIONS: dict[tuple[str, int, str | None], FederatedData] = {}


def load_partition(recipe: FlowerRecipe, partition_id: int, data_root: str | None = None) -> ClientData:
    """Training client ``partition_id``'s data under the recipe's federation (what a SuperNode of a test or a
    benchmark loads; a user's own ClientApp loads its own data instead). Keeps copies of that client's samples
    only."""
    key = (repr(recipe.recipe), recipe.seed, data_root)
    if key not in _FEDERATIONS:  # one build per process (a simulation's worker serves many clients)
        _FEDERATIONS.clear()
        _FEDERATIONS[key] = federate(recipe.recipe, recipe.seed, data_root)
    fed = _FEDERATIONS[key]
    if not 0 <= partition_id < fed.num_train_clients:
        raise ValueError(f"partition-id {partition_id} out of range: the recipe has {fed.num_train_clients} "
                         "training clients (0 .. K-1)")
    tr, va = fed.train[partition_id], fed.val[partition_id]
    x, y = fed.dataset.x, fed.dataset.y
    return ClientData(partition_id, fed.num_train_clients, fed.dataset.num_classes, x[tr].copy(), y[tr].copy(),
                      x[va].copy(), y[va].copy())


def _node_images(recipe: Recipe, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """An image folder as raw images in the recipe's layout and its labels: each class subfolder is named by the
    recipe's class name (its data's ``classes``) or, when it names none, by the label number 0..K-1. uint8 images
    go to a recipe whose raw images are uint8 as they are, to one whose raw images are floats in [0, 1] (the
    built-in data sets) scaled by 1/255."""
    if any(p.suffix.lower() in (".png", ".jpg", ".jpeg") for p in path.iterdir() if p.is_file()) and \
            not any(p.is_dir() for p in path.iterdir()):
        raise RecipeError(f"node data {path}: images without class subfolders have no labels; a node without "
                          "labels is a new client (it adapts on the device) and cannot train")
    spec = DataSpec.from_image_folder(path)
    names = list(recipe.data.classes or [str(k) for k in range(recipe.num_classes)])
    unknown = [c for c in spec.classes or () if c not in names]
    if unknown:
        raise RecipeError(f"node data {path}: class folder(s) {', '.join(unknown)} are not the recipe's classes; "
                          f"name each folder after one of {', '.join(names)}")
    labels = np.array([names.index(c) for c in spec.classes or ()])[spec.y]
    if isinstance(spec.x, list):
        raise RecipeError(f"node data {path}: its images differ in size; give every image the recipe's size")
    raw, x = recipe.preprocess.raw, spec.x  # type: ignore[union-attr]
    if raw is not None and raw.dtype != "uint8":
        if raw.dtype[:5] != "float" or raw.range != (0.0, 1.0):
            raise RecipeError(f"node data {path}: the recipe takes raw {raw.dtype} images, an image folder holds "
                              "uint8 ones; give the node an arrays file (.npz with x, y) in the recipe's form")
        x = (x / np.float32(255)).astype(raw.dtype)
    layout = recipe.preprocess.layout  # type: ignore[union-attr]
    return (x.transpose(0, 3, 1, 2) if layout == "NCHW" else x), labels


def load_node_data(recipe: FlowerRecipe, source: str | Path) -> ClientData:
    """A SuperNode's own data (``data`` in its ``--node-config``; a relative path is the SuperNode's working
    directory's): an arrays file (``.npz`` with ``x``, raw images as the run's bundle takes them, and ``y``,
    integer labels; never a pickle) or an image folder (one subfolder per class). Checked at load (shapes,
    dtype, labels in range, the recipe's input shape; one line each, :class:`RecipeError`), preprocessed by the
    recipe, then split into training and validation (``val_fraction`` of the recipe's federation) on the node,
    drawn from the run's seed."""
    path = Path(source).expanduser()
    where = f"node data {source}" + ("" if path.is_absolute() else f" ({path.resolve()})")
    r = recipe.recipe
    if path.is_dir():
        x, y = _node_images(r, path)
    elif path.suffix == ".npz" and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as f:
                if "x" not in f.files:
                    raise RecipeError(f"{where}: no array 'x' (the raw images); it holds {', '.join(f.files)}")
                if "y" not in f.files:
                    raise RecipeError(f"{where}: no labels (array 'y'); a node without labels is a new client "
                                      "(it adapts on the device) and cannot train")
                x, y = f["x"], f["y"]
        except RecipeError:
            raise
        except ValueError as exc:  # an object array: a pickle inside, never loaded
            raise RecipeError(f"{where}: unreadable arrays ({exc}); save plain numeric arrays x, y") from None
    else:
        raise RecipeError(f"{where}: no such image folder or arrays file (.npz with x, y)")
    if y.ndim != 1 or y.dtype.kind not in "iu" or len(y) != len(x):
        raise RecipeError(f"{where}: labels must be integers, one per image ({len(x)}), got {y.dtype} "
                          f"{list(y.shape)}")
    if len(y) < 2:
        raise RecipeError(f"{where}: {len(y)} sample(s); a training node needs at least 2 (training and validation)")
    if y.min() < 0 or y.max() >= r.num_classes:
        raise RecipeError(f"{where}: labels in [{int(y.min())}, {int(y.max())}], the recipe has {r.num_classes} "
                          f"classes (0 .. {r.num_classes - 1})")
    if x.dtype.kind not in "uif":
        raise RecipeError(f"{where}: images must be uint8 or float arrays, got {x.dtype}")
    try:
        inputs = r.preprocess.apply(x)  # type: ignore[union-attr]  # checks the raw images' shape and range
    except ValueError as exc:
        raise RecipeError(f"{where}: {exc}") from None
    if tuple(inputs.shape[1:]) != tuple(r.input_shape):
        raise RecipeError(f"{where}: images become model inputs {list(inputs.shape[1:])}, the recipe's model takes "
                          f"{list(r.input_shape)}")
    if not np.isfinite(inputs).all():
        raise RecipeError(f"{where}: NaN or infinite values in the images")
    tr, va = train_val_split(np.arange(len(y)), r.federation.val_fraction, np.random.default_rng(recipe.seed))
    if len(tr) == 0 or len(va) == 0:
        raise RecipeError(f"{where}: {len(y)} samples leave {len(tr)} for training and {len(va)} for validation "
                          f"(val_fraction {r.federation.val_fraction}); give the node more samples")
    y = y.astype(np.int64)
    return ClientData(-1, 0, r.num_classes, inputs[tr], y[tr], inputs[va], y[va], local=True)


_ARRAYS = ("x_train", "y_train", "x_val", "y_val")


def _files_signature(path: Path) -> list[tuple[str, int, int]]:
    """(relative name, size, mtime_ns) of a file, or of every file under a folder: changes when the data does."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    return [(str(p.relative_to(path)) if p != path else p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in files]


def data_key(recipe: FlowerRecipe, source: str | None, partition_id: int | None, data_root: str | None) -> str:
    """What a node's prepared data depends on, hashed: its source (the node's own file or folder, or a partition
    of the data set under ``data_root``) with its files' sizes and times, and the recipe's data fingerprint (data
    set, preprocessing, federation, seed, and the recipe file's own signature where there is one)."""
    r = recipe.recipe
    root = data_root or os.environ.get("FL_DATA_DIR")
    where = Path(source).expanduser().resolve() if source is not None else Path(root).resolve() if root else None
    ident = {"source": str(where), "partition": partition_id, "files": _files_signature(where) if where else [],
             "data": repr(r.data), "preprocess": repr(r.preprocess), "federation": repr(r.federation),
             "seed": recipe.seed, "recipe-file": _files_signature(Path(r.source.split(":")[0])) if r.source else []}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


def node_cache_dir() -> Path:
    """Where a SuperNode keeps its prepared data between messages: ``$FL_FLOWER_CACHE``, else
    ``$XDG_CACHE_HOME/fl-edge/flower`` (default ``~/.cache/fl-edge/flower``)."""
    if os.environ.get("FL_FLOWER_CACHE"):
        return Path(os.environ["FL_FLOWER_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fl-edge" / "flower"


def cached_node_data(recipe: FlowerRecipe, source: str | None, partition_id: int | None,
                     data_root: str | None = None, cache: Path | None = None) -> ClientData:
    """The node's data (:func:`load_node_data` of ``source``, or :func:`load_partition` of ``partition_id``),
    prepared once and kept in ``cache`` (:func:`node_cache_dir`) under :func:`data_key`: Flower starts a fresh
    ClientApp process per message, and later messages read the prepared arrays back instead of loading,
    checking and splitting (or federating the whole data set) again. An unreadable cache file is rebuilt."""
    from fl_server.atomic import atomic_write_npz

    path = (cache or node_cache_dir()) / f"{data_key(recipe, source, partition_id, data_root)}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as f:
                meta = f["meta"]
                return ClientData(int(meta[0]), int(meta[1]), int(meta[2]), *(f[k] for k in _ARRAYS),
                                  local=bool(meta[3]))
        except (OSError, ValueError, KeyError):
            pass  # a partial or foreign file: prepared again below
    if source is not None:
        data = load_node_data(recipe, source)
    else:
        data = load_partition(recipe, int(partition_id or 0), data_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = np.array([data.partition_id, data.num_partitions, data.num_classes, int(data.local)], np.int64)
    atomic_write_npz(path, {"meta": meta, **{k: np.ascontiguousarray(getattr(data, k)) for k in _ARRAYS}})
    return data


def client_train(algorithm: Algorithm, start: State, server: State, data: ClientData, recipe: FlowerRecipe,
                 round_: int) -> State:
    """The client's part of a round: the engine's local steps (reference loop) from ``start`` (this client's row
    of the method's ``client_start``) on the client's own batch stream."""
    dtype = recipe.torch_dtype
    x = torch.from_numpy(data.x_train).to(dtype)
    y = torch.from_numpy(data.y_train)
    batches = client_batches([np.arange(len(data.y_train))], recipe.local_iterations, recipe.batch_size,
                             client_rng(recipe.seed, round_, data.partition_id))
    algorithm.begin_round(server)  # the server ran client_start, not this client's copy of the method
    out = run_local_steps(algorithm.local_step, stack([start]), server, x, y, torch.from_numpy(batches), "loop",
                          step_at=algorithm.local_step_at)
    return unstack(out)[0]


def private_start(algorithm: Algorithm, recipe: FlowerRecipe, data: ClientData) -> State:
    """The client's own entries (``Algorithm.client_private``, e.g. BTFL's local head) before its first round:
    its row of the method's initial server state, drawn on the client like on the engine's server."""
    algorithm.attach(torch.empty(0, *data.input_shape, dtype=recipe.torch_dtype), torch.empty(0, dtype=torch.long),
                     [np.empty(0, np.int64)] * data.num_partitions)
    init = algorithm.init_state(recipe.torch_dtype, torch.device("cpu"))
    start = unstack(algorithm.client_start(init, np.array([data.partition_id])))[0]
    return {k: start[k] for k in algorithm.client_private}


def client_round(algorithm: Algorithm, start: State, server: State, data: ClientData, recipe: FlowerRecipe,
                 round_: int, private: State | None) -> tuple[State, State]:
    """:func:`client_train` with the client's own entries put in before and kept back after:
    (the state sent to the server, the entries the client keeps for its next round)."""
    if algorithm.client_private:
        start = {**start, **(private if private is not None else private_start(algorithm, recipe, data))}
    trained = client_train(algorithm, start, server, data, recipe, round_)
    kept = {k: trained[k] for k in algorithm.client_private}
    return {k: v for k, v in trained.items() if k not in kept}, kept


def client_train_loss(algorithm: Algorithm, trained: State, data: ClientData, recipe: FlowerRecipe) -> float:
    """The round's train loss a client reports: the cross-entropy of its trained model on its own training data."""
    with torch.no_grad():
        logits = algorithm.predict(trained["params"], torch.from_numpy(data.x_train).to(recipe.torch_dtype))
        return float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(data.y_train)))


def client_embedding(algorithm: ODPFLHN, enc: State, data: ClientData, recipe: FlowerRecipe) -> np.ndarray:
    """ODPFL-HN's ClientEncoding: e = g_gamma(D) [E] of the client's training data, all it sends the server."""
    return algorithm.encode(enc, torch.from_numpy(data.x_train).to(recipe.torch_dtype)).numpy()


def client_encoder_grad(algorithm: ODPFLHN, enc: State, grad_e: np.ndarray, data: ClientData,
                        recipe: FlowerRecipe) -> State:
    """ODPFL-HN's ClientBackprop: gamma's gradient (d g_gamma(D) / d gamma)^T grad_e for the server's dL/de."""
    x = torch.from_numpy(data.x_train).to(recipe.torch_dtype)
    return algorithm.encoder_backprop(enc, x, torch.from_numpy(grad_e))


_SUM_PARTS = ("sum", "sumsq", "count")  # a layer's entries of a client's upload (fl_server.models.norm.Sums)


def client_bn_sums(algorithm: Algorithm, server: State, data: ClientData,
                   recipe: FlowerRecipe) -> dict[str, np.ndarray]:
    """A batch-normalised model: the sums of every layer's input over the client's training samples with the sent
    weights (the engine's :func:`~fl_server.models.norm.client_sums`), as ``<layer>.sum`` / ``.sumsq`` /
    ``.count``: its upload for the population statistics (:func:`statistics_from_uploads`)."""
    model = algorithm.model
    forward = make_forward(model)
    sums = client_sums(model, lambda xb: forward(server["params"], xb),
                       torch.from_numpy(data.x_train).to(recipe.torch_dtype))
    return {f"{name}.{part}": value.numpy().reshape(-1) for name, layer in zip(norm_names(model), sums)
            for part, value in zip(_SUM_PARTS, layer)}


def statistics_from_uploads(algorithm: Algorithm, uploads: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The server's side: the population statistics from every training client's :func:`client_bn_sums`, added
    up as the engine's finalize adds them (:func:`~fl_server.models.norm.federated_statistics`); set on the
    model and returned as ``device.npz``'s ``stats``."""
    model = algorithm.model
    federated_statistics(model, [[[torch.from_numpy(u[f"{name}.{part}"]).reshape(() if part == "count" else -1)
                                   for part in _SUM_PARTS] for name in norm_names(model)] for u in uploads])
    return statistics_arrays(model)


@contextlib.contextmanager
def population_statistics(model: torch.nn.Module, stats: Mapping[str, np.ndarray] | None) -> Iterator[None]:
    """Run a block with ``stats`` (``device.npz``'s ``stats``) as the population statistics and every batch-normalised
    layer in population mode, as the engine's finalize runs (``Simulation.device_semantics``); no-op without."""
    if not stats:
        yield
        return
    set_statistics(model, dict(stats))
    with norm_mode(model, "population"):
        yield


def client_btfl_upload(algorithm: BTFL, server: State, data: ClientData, recipe: FlowerRecipe,
                       stats: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """BTFL: the client's local DLE [D, L] and mean feature with the final global features, a batch-normalised
    model normalising by the run's population statistics ``stats`` (its upload for ``BTFL.finalize_from_uploads``)."""
    with population_statistics(algorithm.model, stats):
        return algorithm.local_upload(server["params"], torch.from_numpy(data.x_train).to(recipe.torch_dtype))


def client_validation(algorithm: Algorithm, server: State, data: ClientData, recipe: FlowerRecipe,
                      round_: int = 0, own: State | None = None, stats: Mapping[str, np.ndarray] | None = None
                      ) -> torch.Tensor:
    """The predicted classes of the client's validation split, as the engine's ``evaluate_val`` scores one
    training client: after ``personalize`` on the (unlabeled) validation data and the method's declared safeguard
    (the device's rule, :func:`~fl_server.engine.simulation.safeguarded_logits`) for test-time methods, else with
    the method's ``val_params`` (the shared model, or one fine-tuned on the client's own training data, e.g.
    FedICON's head, its batches from the client's own generator). ``own``: the client's own rows of the per-client
    server state (``Algorithm.per_client_keys``, one row each, e.g. MAP's HPM), row 0 of a one-client server state.
    ``stats``: a batch-normalised model's population statistics of the server weights over the run's clients
    (``FederatedRun.validation_statistics``): the shared model and every personalisation are scored as the
    bundle's device runs them (the engine's ``Simulation.device_semantics``); per-client models normalise by
    their own batches, as in the engine."""
    if own:
        server = {**server, **own}
    if algorithm.adapts_at_test_time:
        with population_statistics(algorithm.model, stats):
            return _personalised_predictions(algorithm, server, data, recipe)
    x_tr, y_tr = torch.from_numpy(data.x_train).to(recipe.torch_dtype), torch.from_numpy(data.y_train)

    def trainer(step, states, server_state, ids, iterations, step_at=None):  # type: ignore[no-untyped-def]
        batches = client_batches([np.arange(len(y_tr))], iterations, recipe.batch_size,
                                 np.random.default_rng([recipe.seed, round_, RNG_EVAL, data.partition_id]))
        return run_local_steps(step, states, server_state, x_tr, y_tr, torch.from_numpy(batches), "loop",
                               step_at=step_at)

    params = algorithm.val_params(server, np.array([0 if own else data.partition_id]), trainer)
    name, p = next(iter(algorithm.model.named_parameters()))
    if params[name].ndim == p.ndim + 1:  # stacked: this client's own model
        return client_predictions(algorithm, unstack(params)[0], data, recipe)
    with population_statistics(algorithm.model, stats):  # the shared model, as its device runs it
        return client_predictions(algorithm, params, data, recipe)


def _personalised_predictions(algorithm: Algorithm, server: State, data: ClientData,
                              recipe: FlowerRecipe) -> torch.Tensor:
    """A test-time method's validation predictions: ``personalize`` on the (unlabeled) validation split, its
    adaptation steps normalising by the method's rule (``Algorithm.adapt_norm``), then the method's declared
    safeguard, as the engine's ``Simulation.personalized_predictions`` predicts for a client."""
    x = torch.from_numpy(data.x_val).to(recipe.torch_dtype)
    rule = declared_safeguard(algorithm)
    if rule is not None and rule.keeps_received:  # the device adapts nothing (Device.personalize)
        return client_predictions(algorithm, server["params"], data, recipe)
    with norm_mode(algorithm.model, algorithm.adapt_norm):
        params = algorithm.personalize(server, x)
    if rule is None:
        return client_predictions(algorithm, params, data, recipe)
    with torch.no_grad():  # the device's safeguard, as the engine's evaluate_val applies it
        received, adapted = algorithm.predict(server["params"], x), algorithm.predict(params, x)
    return safeguarded_logits(algorithm, rule, server, params, x, received, adapted).argmax(-1)


def client_predictions(algorithm: Algorithm, params: State, data: ClientData, recipe: FlowerRecipe) -> torch.Tensor:
    """The classes the model ``params`` predicts for the client's validation split (ODPFL-HN: the model the
    server's hypernetwork generated from the client's embedding)."""
    with torch.no_grad():
        return algorithm.predict(params, torch.from_numpy(data.x_val).to(recipe.torch_dtype)).argmax(-1)


def validation_metrics(pred: torch.Tensor, data: ClientData) -> dict[str, float | int]:
    """A validation reply's metrics: the accuracy of ``pred`` on the client's validation split, its size, the
    class it predicts most with that class's share of its predictions and of its labels (what the server's
    collapse check reads; not the histograms, which would tell the label mix)."""
    counts = np.bincount(pred.cpu().numpy(), minlength=data.num_classes)
    top = int(counts.argmax()) if counts.sum() else 0
    n = max(len(data.y_val), 1)
    return {"accuracy": float((pred == torch.from_numpy(data.y_val)).double().mean()) if len(pred) else 0.0,
            "num-examples": len(data.y_val), "top-class": top,
            "top-share": float(counts[top] / counts.sum()) if counts.sum() else 0.0,
            "top-label-share": float(np.count_nonzero(data.y_val == top) / n)}


def client_facts(names: Sequence[str], data: ClientData) -> dict[str, list[int]]:
    """What the run's method knows of each client's data (``Algorithm.client_facts``, named in the query's
    ``facts``), computed on the client from its training labels: all the query reply says of its data."""
    unknown = [name for name in names if name not in CLIENT_FACTS]
    if unknown:
        raise ValueError(f"query: unknown client fact(s) {', '.join(unknown)}; this node computes "
                         f"{', '.join(CLIENT_FACTS)} (update fl-edge on the node)")
    return {name: CLIENT_FACTS[name].compute(data.y_train, data.num_classes) for name in names}


def check_supported(algorithm: Algorithm) -> None:
    """Refuse, with the reason, a method that cannot train with its clients on their own machines
    (``Algorithm.client_data_need``: e.g. a server step that needs more of the clients' data than its declared
    ``client_facts``, which the clients send)."""
    need = algorithm.client_data_need()
    if need:
        raise NotApplicable(f"{algorithm.name} cannot run on Flower: {need}")
