"""The one small interface every federated method implements.

Training (simulation and HTTP flow use the same functions):
  ``init_state`` -> server state (pytree of tensors)
  ``client_start(server_state, ids)`` -> stacked client states (leading axis = selected clients)
  ``local_step(client_state, server_state, x, y)`` -> client state   (pure, one client; vmapped by the engine)
  ``aggregate(server_state, ids, client_states, weights)`` -> server state
Evaluation:
  ``val_params(server_state, ids, trainer)`` -> params per training client (stacked) or one shared params
  ``personalize(server_state, x)`` -> params for one *new* client from its unlabeled data ``x`` (pure)
  ``predict(params, x)`` -> logits
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from fl_server.functional import (State, broadcast, clip_by_global_norm, get_params, grad, make_forward, sgd_step,
                                  weighted_mean)
from fl_server.models import Classifier

if TYPE_CHECKING:  # imported where used: a training process (a Flower ClientApp) never needs the SDK
    from edge_sdk.safeguard import SafeguardRule

StepFn = Callable[[State, State, torch.Tensor, torch.Tensor], State]


class LocalTrainer(Protocol):
    """What the engine offers an algorithm that must train at evaluation time (e.g. FedAvg+FT)."""

    def __call__(self, step_fn: StepFn, states: State, server_state: State, ids: np.ndarray,
                 iterations: int, step_at: Callable[[int], StepFn] | None = None) -> State: ...


class NotApplicable(RuntimeError):
    """Raised when a method has no answer for a setting (e.g. ``Local`` for a new client)."""


@dataclass
class Hyper:
    """Base hyperparameters; subclasses add their own fields (defaults from the papers)."""

    lr: float = 0.1
    weight_decay: float = 0.0
    clip_norm: float | None = None  # per-client gradient-norm clip of the local step (authors' code: 10)


A = TypeVar("A", bound="Algorithm")
ALGORITHMS: dict[str, type["Algorithm"]] = {}  # name -> method, in registration order (:func:`register`)


def register(cls: type[A]) -> type[A]:
    """Class decorator: make a method known by its ``name`` to recipes, the CLI, the coordinator's jobs and the
    exporter (:data:`ALGORITHMS`). The one place a method is listed; a module in ``fl_server/algorithms/``
    registers its methods when the package is imported.

    >>> @register
    ... class Mine(Algorithm):
    ...     name = "Mine"
    >>> ALGORITHMS.pop("Mine") is Mine
    True
    """
    known = ALGORITHMS.get(cls.name)
    rerun = known is not None and (known.__module__, known.__qualname__) == (cls.__module__, cls.__qualname__)
    if known is not None and known is not cls and not rerun:  # rerun: its file changed and was run again
        raise ValueError(f"two methods are named {cls.name!r}: {known.__module__}.{known.__qualname__} and "
                         f"{cls.__module__}.{cls.__qualname__}")
    ALGORITHMS[cls.name] = cls
    return cls


def class_set(labels: np.ndarray, num_classes: int) -> list[int]:
    """The classes present among a client's training ``labels``, sorted (which ones, not how many of each)."""
    return np.flatnonzero(np.bincount(labels, minlength=num_classes)).tolist()


def checked_class_set(value: Any, num_classes: int) -> list[int]:
    """A class set a client sent, sorted; ``ValueError`` (one line) unless it is distinct integer labels in
    0 .. num_classes - 1, at least one."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, int) and not isinstance(c, bool) for c in value):
        raise ValueError(f"expected a list of integer labels, got {value!r}")
    if not value:
        raise ValueError("empty: a training client holds at least one class")
    if len(set(value)) != len(value):
        raise ValueError(f"repeats a label: {list(value)}")
    if min(value) < 0 or max(value) >= num_classes:
        raise ValueError(f"labels {list(value)} outside 0 .. {num_classes - 1}")
    return sorted(value)


@dataclass(frozen=True)
class ClientFact:
    """Something a method's server state needs to know of each training client's data (:attr:`Algorithm.
    client_facts`), computed from the client's training labels and the number of classes; never samples."""

    compute: Callable[[np.ndarray, int], list[int]]
    check: Callable[[Any, int], list[int]]  # a received value -> the fact, or ValueError with one line


CLIENT_FACTS: dict[str, ClientFact] = {"class_set": ClientFact(class_set, checked_class_set)}


class Algorithm:
    name: ClassVar[str] = "base"
    Config: ClassVar[type[Hyper]] = Hyper
    # True for test-time methods: training clients' validation accuracy is then measured, like the new
    # clients', after ``personalize`` on the (unlabeled) validation data itself.
    adapts_at_test_time: ClassVar[bool] = False
    # server-state entries with one row per training client (e.g. BTFL's local heads): a client is sent only its
    # own row (through ``client_start``), never the others' (the Flower app, ``fl_server.flower``)
    per_client_keys: ClassVar[tuple[str, ...]] = ()
    # client-state entries that are the client's own between rounds ({client key: per-client server key}, e.g.
    # BTFL's local head): on Flower they stay on the client and never cross the wire
    client_private: ClassVar[dict[str, str]] = {}
    # True when ``local_step`` is a pure function of its tensor arguments and of hyperparameters fixed for the run
    # (no Python state that changes between rounds): the engine may then record a round's steps once as a CUDA
    # graph and replay it (fl_server/engine/graphs.py)
    graph_safe: ClassVar[bool] = False
    # ---- the device contract: declared here once; export, publish, the coordinator and the SDK derive from it
    # what the device runs to personalise (the bundle's step graph, built by the kind's
    # ``@fl_server.export.steps.register_step_graph(kind)`` builder, and the SDK's ``@edge_sdk.register_runner(kind)`` runner,
    # recorded in the manifest as ``device_step``): "tent_step", "fedtta_step", "encoder" (ODPFL-HN's set encoder),
    # "fedicon_step", "btfl" (BTFL's two-head stream) or None (plain inference). A step of a new kind needs its
    # graph builder and its runner, each in the method author's own module (tests/test_extension.py)
    device_step: ClassVar[str | None] = None
    # the server-state entries a bundle ships as weights (FedTTA's adaptation model phi, ODPFL-HN's encoder enc)
    device_weights: ClassVar[tuple[str, ...]] = ("params",)
    # weight sets that the run's finalize step computes from the clients' data (:meth:`finalize`, BTFL's global
    # DLE "btfl"); the run directory holds them, so export needs no data set
    finalize_weights: ClassVar[tuple[str, ...]] = ()
    # whether a device personalises on its own labeled data (BTFL's local head): the engine holds no labels out
    # for that, so the new-client accuracy training reports is the received model's, before it (and says so)
    device_labels: ClassVar[bool] = False
    # whether a coordinator can train this method as a job and serve its bundles (it has a device path)
    servable: ClassVar[bool] = False
    # whether a coordinator with an empty store trains it by default (``FL_SERVE_DEFAULT_METHODS`` overrides; the
    # first registered one is a device's default method). Not inherited: a subclass is a default only where it
    # says so itself (:meth:`__init_subclass__`)
    default_job: ClassVar[bool] = False
    # the label-free safeguard a device applies after this method's personalisation (edge_sdk.safeguard's
    # SafeguardRule in manifest form, written into the bundle's manifest as ``safeguard``); chosen per method on
    # the lab's validation shifts only (lab/safeguard_choice.py). None: none declared (not inherited: a subclass
    # declares its own).
    safeguard: ClassVar[dict[str, Any] | None] = None
    # why a bundle of this method cannot be published to another coordinator ("" when it can)
    publish_refusal: ClassVar[str] = ""
    # how batch-normalised layers normalise during the device's adaptation steps: "rule" (the bundle's
    # ``batch_norm`` rule: the batch's statistics from ``min_batch`` samples on, else the population's) or
    # "batch" (always the batch's own, e.g. FedICON's two augmented views)
    adapt_norm: ClassVar[str] = "rule"
    # what the server state is built from about each training client's data, by name (:data:`CLIENT_FACTS`, e.g.
    # MAP's "class_set": which classes the client holds): the engine computes them from the partitions
    # (:meth:`attach`), a Flower client from its own data, sending only them; :meth:`receive_client_facts` takes them
    client_facts: ClassVar[tuple[str, ...]] = ()
    # why this method cannot train with its clients on their own machines ("" when it can; the Flower app refuses
    # it with this reason), e.g. a server step that needs more of the clients' data than :attr:`client_facts`
    needs_client_data: ClassVar[str] = ""

    def client_data_need(self) -> str:
        """:attr:`needs_client_data` for this method's hyperparameters ("" when its server step needs none)."""
        return self.needs_client_data

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.default_job = bool(vars(cls).get("default_job", False))
        # a rule is chosen for one method's device step: a subclass declares its own, or has none
        cls.safeguard = vars(cls).get("safeguard")

    def __init__(self, model: Classifier, config: Hyper | None = None, seed: int = 0, **overrides: Any) -> None:
        """``seed`` fixes the initial weights of any module the method adds to ``model`` (e.g. FedTTA's g)."""
        base = config if config is not None else self.Config()
        self.hp = type(base)(**{**asdict(base), **overrides})
        self.model = model
        self.forward = make_forward(model)

    @classmethod
    def device_step_for(cls, hyper: dict[str, Any]) -> str | None:
        """The device step of a bundle with hyperparameters ``hyper`` (default: :attr:`device_step`; FedICON
        without test-time adaptation ships the received model as it is)."""
        return cls.device_step

    @classmethod
    def bundle_artifacts(cls, hyper: dict[str, Any]) -> tuple[str, ...]:
        """The artifacts a bundle of this method with hyperparameters ``hyper`` must hold: the ``forward`` graph,
        the device step's graph, the weights it ships and its finalize weights. The publish check requires
        exactly these (plus ``stats`` where a graph is batch-normalised).

        >>> from fl_server.algorithms import ALGORITHMS
        >>> ALGORITHMS["FedTTA"].bundle_artifacts({})
        ('forward', 'fedtta_step', 'params', 'phi')
        """
        step = cls.device_step_for(hyper)
        return ("forward", *((step,) if step else ()), *cls.device_weights, *cls.finalize_weights)

    def finalize(self, server_state: State, x: torch.Tensor, train: list[np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
        """Weight sets (:attr:`finalize_weights`) computed at the end of a run from the training clients' data
        ``x[train[k]]`` with the final ``server_state`` (batch-normalised layers already at the population
        statistics). Default: none."""
        return {}

    @classmethod
    def identity_warning(cls, hyper: dict[str, Any]) -> str | None:
        """One line when ``hyper`` turns this method into another registered one (FedTTA with ``patience`` is
        FedTTA++), else None; a recipe warns with it."""
        return None

    @classmethod
    def min_local_iterations(cls, hyper: dict[str, Any]) -> int:
        """The fewest local iterations a round of this method can run with ``hyper`` (BTFL: its body steps and at
        least one head step); a recipe with fewer is refused when built (BTFL's aggregate checks it too)."""
        return 1

    @classmethod
    def fit_hyper(cls, hyper: dict[str, Any], rounds: int) -> dict[str, Any]:
        """``hyper`` completed for a run of ``rounds`` rounds where a default depends on the run's length (FedICON's
        phase schedule); a recipe builds its method with it, so the run's ``run.json`` records the values used."""
        return hyper

    @classmethod
    def check_model(cls, model: Classifier, hyper: dict[str, Any]) -> bool:
        """Raise ``ValueError`` (one line: why, and what to do) where this method cannot serve ``model`` with
        ``hyper``, checked without building the method; True when that settles it (a method too large to build
        only to check it), False to check by building the method (the recipe's default)."""
        return False

    # ---------------------------------------------------------------- training
    def attach(self, x: torch.Tensor, y: torch.Tensor, train: list[np.ndarray]) -> None:
        """Called once by the simulation with the data tensors (on the run's device) and each training
        client's training indices, for methods whose server-side step needs a client's data (e.g. ODPFL-HN's
        embedding of the client's set). In the HTTP flow the client computes those parts itself. Default: the
        declared :attr:`client_facts` of each client's training labels, to :meth:`receive_client_facts`."""
        if self.client_facts:
            labels = y.cpu().numpy()
            self.receive_client_facts({name: [CLIENT_FACTS[name].compute(labels[t], self.model.num_classes)
                                              for t in train] for name in self.client_facts})

    def receive_client_facts(self, facts: dict[str, list[list[int]]]) -> None:
        """Each declared fact (:attr:`client_facts`) of every training client, in client order (an empty list:
        a client that never takes part), before :meth:`init_state`."""
        raise NotImplementedError(f"{self.name} declares client_facts {self.client_facts} but takes none")

    def init_state(self, dtype: torch.dtype, device: torch.device) -> State:
        return {"params": get_params(self.model, dtype, device)}

    def client_start(self, server_state: State, ids: np.ndarray) -> State:
        return {"params": broadcast(server_state["params"], len(ids))}

    def begin_round(self, server_state: State) -> None:
        """Called with the round's server state before its local steps, wherever they run (``client_start`` on the
        engine, :func:`fl_server.flower.task.client_train` on a Flower client): a method whose step depends on the
        round in Python (FedICON's training phase) sets that here. Default: nothing."""

    def loss(self, params: State, server_state: State, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.forward(params, x), y)

    def local_step(self, client_state: State, server_state: State, x: torch.Tensor, y: torch.Tensor) -> State:
        grads = grad(self.loss)(client_state["params"], server_state, x, y)
        if self.hp.clip_norm is not None:
            (grads,) = clip_by_global_norm((grads,), self.hp.clip_norm)
        # local SGD momentum where the method's config offers it (FedAvg's ``local_momentum``; its client_start
        # creates the buffer ``mom``), else plain SGD
        momentum = getattr(self.hp, "local_momentum", 0.0)
        return sgd_step(client_state, grads, self.hp.lr, momentum, self.hp.weight_decay)

    def local_step_at(self, t: int) -> StepFn:
        """The step the engine applies at local iteration ``t`` of a round (every client of a round is at the
        same t). Default: ``local_step``. A method whose step switches phase with the iteration (BTFL, MAP)
        returns the step specialised to t's phase, which skips the other phase's zero-weighted work;
        ``local_step`` itself, which reads the phase from the state's counter, gives the same result."""
        return self.local_step

    def aggregate(self, server_state: State, ids: np.ndarray, client_states: State, weights: torch.Tensor) -> State:
        return {**server_state, "params": weighted_mean(client_states["params"], weights)}

    # -------------------------------------------------------------- evaluation
    def val_params(self, server_state: State, ids: np.ndarray, trainer: LocalTrainer) -> State:
        """Params used on training clients' validation data. Shared (unstacked) by default."""
        return server_state["params"]

    def personalize(self, server_state: State, x: torch.Tensor) -> State:
        """Params for a new client with unlabeled data ``x`` [N, C, H, W]. Global model by default."""
        return server_state["params"]

    def predict(self, params: State, x: torch.Tensor) -> torch.Tensor:
        return self.forward(params, x)


def declared_safeguard(algorithm: Algorithm) -> SafeguardRule | None:
    """The safeguard rule a device applies after ``algorithm``'s personalisation (:attr:`Algorithm.safeguard`,
    written into its bundles' manifests), or None where it declares none or its rule is "off"."""
    if algorithm.safeguard is None:
        return None
    from edge_sdk.safeguard import SafeguardRule

    rule = SafeguardRule.from_manifest(algorithm.safeguard)
    return None if rule.kind == "off" else rule
