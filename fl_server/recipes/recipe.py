"""The recipe: model + data + federation + method + hyperparameters + rounds + preprocessing, checked when built.

>>> from fl_server.recipes import DataSpec, Federation, Recipe
>>> recipe = Recipe(model="mlp", data=DataSpec.builtin("digits"), federation=Federation(num_clients=20),
...                 method="tent", rounds=3)
>>> recipe.method, recipe.input_shape
('TENT', (1, 8, 8))
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch

from edge_sdk import Preprocess
from fl_server.algorithms import ALGORITHMS, Algorithm, build_algorithm
from fl_server.data.federated import PARTITIONS
from fl_server.models import Classifier
from fl_server.recipes.data import DataSpec
from fl_server.recipes.errors import RecipeError, RecipeWarning
from fl_server.recipes.model import ModelSpec, build_classifier, check_classifier

@dataclass(frozen=True)
class Federation:
    """How the data is spread over clients. ``partition``: ``"natural"`` (the data's own ``client_ids``, the
    default when it has them) or one of pathological / dirichlet (needs ``alpha``) / iid / incomplete over
    ``num_clients``; ``new_fraction`` of the clients never train (they adapt at test time); each training
    client keeps ``val_fraction`` of its samples for validation; ``val_clients`` moves that many training
    clients out of training into client-level validation; ``client_fraction`` of the training clients train
    each round; ``public_size`` samples are held out of every client (HeteroFedTTA's public set);
    ``max_samples`` > 0 first keeps that many random samples of the data (smoke runs)."""

    partition: str | None = None
    num_clients: int = 100
    new_fraction: float = 0.5
    val_fraction: float = 0.15
    alpha: float | None = None
    val_clients: int = 0
    client_fraction: float = 1.0
    public_size: int = 0
    max_samples: int = 0

    def __post_init__(self) -> None:
        if self.partition is not None and self.partition not in (*PARTITIONS, "natural"):
            raise RecipeError(f"federation: unknown partition {self.partition!r}; choose natural (the data's "
                              f"client_ids) or one of {', '.join(PARTITIONS)}")
        if self.partition == "dirichlet" and (self.alpha is None or not self.alpha > 0):
            raise RecipeError(f"federation: the dirichlet partition needs alpha > 0 (e.g. Federation("
                              f"partition='dirichlet', alpha=0.5)), got {self.alpha!r}")
        if not (isinstance(self.num_clients, int) and self.num_clients >= 2):
            raise RecipeError(f"federation: num_clients must be an integer >= 2, got {self.num_clients!r}")
        if not 0.0 <= self.new_fraction < 1.0:
            raise RecipeError(f"federation: new_fraction must be in [0, 1), got {self.new_fraction!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise RecipeError(f"federation: val_fraction must be in [0, 1), got {self.val_fraction!r}")
        if not 0.0 < self.client_fraction <= 1.0:
            raise RecipeError(f"federation: client_fraction must be in (0, 1], got {self.client_fraction!r}")
        if self.val_clients < 0 or self.public_size < 0 or self.max_samples < 0:
            raise RecipeError("federation: val_clients, public_size and max_samples must be >= 0")


@dataclass(frozen=True, eq=False)
class Recipe:
    """Everything one federated training needs; validated when built (:class:`RecipeError`, one line each).

    ``model``: a zoo name (``fl_server.models.MODELS``) or :class:`ModelSpec`; ``data``: :class:`DataSpec`;
    ``method``: any letter case (``"fedtta++"``); ``hyper``: the method's hyperparameters (its ``Config``
    fields); ``eval_every``: validation interval (the best round is chosen among the validated rounds);
    ``preprocess``: raw images -> model input (default: the data's layout, uint8 scaled to [0, 1]), written
    into the bundle so a device passes raw images, with the raw images' dtype, range and shape
    (``DataSpec.raw_input`` unless it records its own ``raw``; the device refuses others); ``source``:
    ``"file.py:NAME"`` when loaded by :func:`~fl_server.recipes.load_recipe` (how ``fl-server export`` rebuilds
    the model)."""

    model: Union[str, ModelSpec]
    data: DataSpec
    federation: Federation = field(default_factory=Federation)
    method: str = "FedAvg"
    hyper: dict[str, Any] = field(default_factory=dict)
    rounds: int = 60
    local_iterations: int = 20
    batch_size: int = 64
    preprocess: Preprocess | None = None
    eval_every: int = 1
    name: str = ""
    source: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.data, DataSpec):
            raise RecipeError(f"data: expected a DataSpec (DataSpec.from_arrays / from_image_folder / from_torch / "
                              f"builtin), got {type(self.data).__name__}")
        if not isinstance(self.model, (str, ModelSpec)):
            raise RecipeError(f"model: expected a zoo name or ModelSpec(factory, head), got {type(self.model).__name__}")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        set_("method", _canonical(self.method))
        set_("hyper", dict(self.hyper))
        _check_hyper(self.method, self.hyper)
        for key in ("rounds", "local_iterations", "batch_size", "eval_every"):
            value = getattr(self, key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise RecipeError(f"{key} must be an integer >= 1, got {value!r}")
        try:
            fewest = ALGORITHMS[self.method].min_local_iterations(self.hyper)
        except ValueError as exc:  # a hyperparameter the count is made of, of the wrong kind
            raise RecipeError(str(exc)) from None
        if self.local_iterations < fewest:
            raise RecipeError(f"local_iterations: {self.method} runs at least {fewest} local iterations a round "
                              f"with these hyperparameters, got {self.local_iterations}")
        if self.preprocess is None:
            set_("preprocess", self.data.default_preprocess())
        elif not isinstance(self.preprocess, Preprocess):
            raise RecipeError(f"preprocess: expected edge_sdk._preprocess.Preprocess, got "
                              f"{type(self.preprocess).__name__}")
        elif self.preprocess.layout != self.data.layout:
            raise RecipeError(f"preprocess: layout {self.preprocess.layout} but the data is {self.data.layout}; "
                              f"use Preprocess(layout={self.data.layout!r}, ...)")
        if self.preprocess.raw is None:  # the raw images the data holds: the device refuses others (one line)
            set_("preprocess", dataclasses.replace(self.preprocess, raw=self.data.raw_input(self.preprocess)))
        raw = self.preprocess.raw
        if raw is not None and raw.range is not None and max(map(abs, raw.range)) <= 1 and \
                self.preprocess.scale * max(map(abs, raw.range)) < 0.01:  # [0, 1] pixels * 1/255: scaled twice
            lo, hi = raw.range
            raise RecipeError(f"preprocess: scale {self.preprocess.scale:.6g} on data already in [{lo:g}, {hi:g}] "
                              f"would leave every value under {self.preprocess.scale * max(abs(lo), abs(hi)):.2g} "
                              f"(scaled twice); drop the scale (Preprocess(scale=1.0, ...)) or pass the 0..255 pixels")
        fed = self.federation
        if fed.partition is None:
            set_("federation", dataclasses.replace(
                fed, partition="natural" if self.data.client_ids is not None else "pathological"))
        elif fed.partition == "natural" and self.data.client_ids is None:
            raise RecipeError("federation: the natural partition needs client_ids in the data "
                              "(DataSpec.from_arrays(x, y, client_ids=...)); or choose a partition")
        self.input_shape  # noqa: B018 - raises for images of different sizes without a resize
        with torch.random.fork_rng(devices=[]):  # checks build throwaway modules: the global RNG stays as it was
            model = self.build_model(seed=0)
            check_classifier(model, self.input_shape)
            _check_method_serves(self, model)

    # ------------------------------------------------------------------ what the runs need
    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the model's input."""
        assert self.preprocess is not None
        raw = self.data.sample_shape
        if raw is None:
            if self.preprocess.size is None:
                raise RecipeError("preprocess: the images have different sizes; set Preprocess(size=(H, W)) to "
                                  "resize them to one")
            first = self.preprocess.to_nchw(self.data.x[0][None]).shape[1]
            return (int(first), *self.preprocess.size)  # type: ignore[return-value]
        if self.data.builtin_name:  # already (C, H, W)
            return (raw[0], *(self.preprocess.size or raw[1:]))  # type: ignore[return-value]
        return self.preprocess.output_shape(raw)

    @property
    def num_classes(self) -> int:
        return self.data.num_classes

    @property
    def model_name(self) -> str:
        """Zoo name, or the ModelSpec's label (run records, bundle manifests)."""
        return self.model if isinstance(self.model, str) else self.model.label

    def build_model(self, seed: int = 0) -> Classifier:
        """A fresh classifier for this recipe's input (weights seeded by ``seed``)."""
        return build_classifier(self.model, self.input_shape, self.num_classes, seed)

    def model_factory(self) -> Callable[[], Classifier]:
        """A builder of fresh copies of the model from the current torch RNG (ODPFL-HN seeds it for its encoder
        trunk, a copy of a user's model)."""
        return lambda: build_classifier(self.model, self.input_shape, self.num_classes, None)

    def build_algorithm(self, model: Classifier, num_train_clients: int, seed: int = 0) -> Algorithm:
        """The method around ``model``; what it adds (FedTTA's g, ODPFL-HN's encoder and hypernetwork, BTFL's
        local heads) is built from the recipe's model."""
        factory = None if isinstance(self.model, str) else self.model_factory()
        hyper = ALGORITHMS[self.method].fit_hyper(self.hyper, self.rounds)  # defaults that depend on the rounds
        return build_algorithm(self.method, model, num_train_clients, seed=seed, model_factory=factory, **hyper)

    def replace(self, **changes: Any) -> "Recipe":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def refuse_idle_overrides(recipe: Recipe, names: Any) -> Recipe:
    """``recipe``, unless one of the federation fields ``names`` that a flag or a job set has no effect on its
    partition (a number of clients for the natural partition, alpha for any but dirichlet): then one line.

    >>> refuse_idle_overrides(Recipe(model="mlp", data=DataSpec.builtin("digits")), {"alpha"})
    Traceback (most recent call last):
    fl_server.recipes.errors.RecipeError: federation: alpha shapes the dirichlet partition only, and this one is ...
    """
    partition = recipe.federation.partition
    if "num_clients" in names and partition == "natural":
        raise RecipeError("federation: the natural partition's clients are the data's client_ids, so a number of "
                          "clients (--clients, num_clients) would change nothing; drop it or choose a partition")
    if "alpha" in names and partition != "dirichlet":
        raise RecipeError(f"federation: alpha shapes the dirichlet partition only, and this one is {partition}; "
                          f"drop alpha or choose partition 'dirichlet'")
    return recipe


def _canonical(method: Any) -> str:
    if isinstance(method, str):
        if method in ALGORITHMS:
            return method
        matches = [m for m in ALGORITHMS if m.lower() == method.strip().lower()]
        if len(matches) == 1:
            return matches[0]
    raise RecipeError(f"method: unknown method {method!r}; choose one of {', '.join(ALGORITHMS)}")


def _check_hyper(method: str, hyper: dict[str, Any]) -> None:
    config = ALGORITHMS[method].Config
    names = [f.name for f in dataclasses.fields(config)]
    for key in hyper:
        if key not in names:
            raise RecipeError(f"hyper: {method} has no hyperparameter {key!r}; its hyperparameters are "
                              f"{', '.join(names)}")
    drift = ALGORITHMS[method].identity_warning(hyper)
    if drift is not None:
        warnings.warn(f"hyper: {drift}", RecipeWarning, stacklevel=3)


def _check_method_serves(recipe: Recipe, model: Classifier) -> None:
    """Fail now, not deep inside a run, where the method cannot serve the model: the method's own check
    (``Algorithm.check_model``), else building it."""
    try:
        if ALGORITHMS[recipe.method].check_model(model, recipe.hyper):
            return
    except ValueError as exc:
        raise RecipeError(f"method: {recipe.method} cannot serve this model: {exc}") from None
    try:
        recipe.build_algorithm(model, 2, seed=0)
    except (ValueError, TypeError) as exc:
        raise RecipeError(f"method: {recipe.method} cannot serve this model ({exc})") from None
