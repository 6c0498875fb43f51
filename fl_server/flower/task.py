"""The federated run a Flower app trains, and the in-process engine's pieces each side of it calls.

A run is described by the Flower run config (``[tool.flwr.app.config]`` of the app, ``flwr run --run-config``):
a recipe (a user's recipe file, or a built-in data set's preset recipe, :func:`fl_server.recipes.presets.
builtin_recipe`, with the run config's overrides), a seed and a dtype. Both sides build the same method object
from it; the server never holds data: each SuperNode loads its own training client's partition (``partition-id``
in its ``--node-config``), and only states and the method's messages cross the wire.

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
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from fl_server.algorithms.base import Algorithm, NotApplicable
from fl_server.algorithms.btfl import BTFL
from fl_server.engine.simulation import _EVAL, Simulation, client_batches, client_rng, run_local_steps
from fl_server.functional import State, make_forward, stack, unstack
from fl_server.models.norm import (client_sums, federated_statistics, norm_mode, norm_names, set_statistics,
                                   statistics_arrays)
from fl_server.recipes import Recipe, load_recipe
from fl_server.recipes.presets import builtin_recipe
from fl_server.recipes.run import federate, simulation

# run-config key -> field of the built-in data set's preset recipe (Recipe or Federation) it overrides
_RECIPE_KEYS = {"num-clients": "num_clients", "new-fraction": "new_fraction", "val-fraction": "val_fraction",
                "rounds": "rounds", "local-iterations": "local_iterations", "batch-size": "batch_size",
                "client-fraction": "client_fraction", "partition": "partition", "model": "model",
                "max-samples": "max_samples"}
_KNOWN = {"dataset", "method", "seed", "dtype", "eval-every", "run-dir", "data-dir", "round-timeout", "min-nodes",
          "recipe", *_RECIPE_KEYS}


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
        if cfg.get("recipe"):
            recipe = load_recipe(str(cfg["recipe"]))
        else:
            changes = {field: cfg[key] for key, field in _RECIPE_KEYS.items() if key in cfg and cfg[key] != ""}
            recipe = builtin_recipe(str(cfg.get("dataset", "mnist")), str(cfg.get("method", "FedAvg")), **changes)
        return cls(recipe, int(cfg.get("seed", 0)), dtype, int(cfg.get("eval-every", 0)))

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

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


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
                      round_: int = 0) -> float:
    """Accuracy on the client's validation split, as the engine's ``evaluate_val`` scores one training client:
    after ``personalize`` on the (unlabeled) validation data for test-time methods, else with the method's
    ``val_params`` (the shared model, or one fine-tuned on the client's own training data, e.g. FedICON's head,
    its batches from the client's own generator)."""
    x = torch.from_numpy(data.x_val).to(recipe.torch_dtype)
    y = torch.from_numpy(data.y_val)
    if algorithm.adapts_at_test_time:
        params = algorithm.personalize(server, x)
    else:
        x_tr, y_tr = torch.from_numpy(data.x_train).to(recipe.torch_dtype), torch.from_numpy(data.y_train)

        def trainer(step, states, server_state, ids, iterations, step_at=None):  # type: ignore[no-untyped-def]
            batches = client_batches([np.arange(len(y_tr))], iterations, recipe.batch_size,
                                     np.random.default_rng([recipe.seed, round_, _EVAL, data.partition_id]))
            return run_local_steps(step, states, server_state, x_tr, y_tr, torch.from_numpy(batches), "loop",
                                   step_at=step_at)

        params = algorithm.val_params(server, np.array([data.partition_id]), trainer)
        name, p = next(iter(algorithm.model.named_parameters()))
        if params[name].ndim == p.ndim + 1:  # stacked: this client's own model
            params = unstack(params)[0]
    with torch.no_grad():
        pred = algorithm.predict(params, x).argmax(-1)
    return float((pred == y).double().mean())


def check_supported(algorithm: Algorithm) -> None:
    """Refuse, with the reason, a method whose server step needs what only the clients hold
    (``Algorithm.needs_client_data``): it cannot run on Flower yet."""
    if algorithm.needs_client_data:
        raise NotApplicable(f"{algorithm.name} cannot run on Flower yet: {algorithm.needs_client_data}")
