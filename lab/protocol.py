"""A protocol of the results harness (how one data set is federated and trained for an experiment) and an
experiment (methods x protocols, the papers' numbers). A protocol becomes one :class:`~fl_server.recipes.Recipe`
per method (:meth:`Protocol.recipe`): the harness trains through the product's recipes."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from fl_server.recipes import DataSpec, Federation, Recipe


@dataclass(frozen=True)
class Protocol:
    """How one dataset is federated and trained for an experiment."""

    dataset: str
    model: str
    rounds: int
    partition: str = "pathological"
    num_clients: int = 100
    new_fraction: float = 0.5
    val_fraction: float = 0.15
    alpha: float | None = None
    local_iterations: int = 20
    batch_size: int = 64
    client_fraction: float = 1.0
    eval_every: int = 1
    method_hp: dict[str, dict[str, Any]] = field(default_factory=dict)
    note: str = ""
    # per-method validation interval where evaluation dominates the cost (FedTTA++: up to 50 adaptation steps
    # per validation client each time); the best round is then chosen among the evaluated rounds
    method_eval_every: dict[str, int] = field(default_factory=dict)
    # per-method round budget where the protocol's rounds are out of reach of the hardware the rows ran on; the
    # row states it (note_for) and the engine resumes the longer run's checkpoint (a truncated run is its prefix)
    method_rounds: dict[str, tuple[int, str]] = field(default_factory=dict)

    def eval_every_for(self, method: str) -> int:
        return self.method_eval_every.get(method, self.eval_every)

    def rounds_for(self, method: str) -> int:
        return self.method_rounds[method][0] if method in self.method_rounds else self.rounds

    def note_for(self, method: str) -> str:
        every = self.method_eval_every.get(method)
        extra = f"validation every {every} rounds (to save compute)" if every else ""
        budget = ""
        if method in self.method_rounds:
            rounds, why = self.method_rounds[method]
            budget = f"{rounds} rounds instead of {self.rounds} ({why})"
        return "; ".join(n for n in (self.note, extra, budget) if n)
    split: str = "all"  # which split of the data set the clients partition
    options: dict[str, Any] = field(default_factory=dict)  # experiment-specific (read by its run_fn)

    def quick(self) -> "Protocol":
        """A CI-sized version: about a minute per row on 2 CPU cores. ``options["quick"]`` overrides options,
        ``options["quick_protocol"]`` fields of the quick protocol itself."""
        small = replace(self, num_clients=20, rounds=max(3, self.rounds // 40), local_iterations=10,
                        eval_every=1, method_eval_every={}, method_rounds={},
                        note="--quick (smoke test, not a result)",
                        options={**self.options, **self.options.get("quick", {})})
        return replace(small, **self.options.get("quick_protocol", {}))


@dataclass(frozen=True)
class Experiment:
    name: str
    methods: tuple[str, ...]
    protocols: dict[str, Protocol]
    paper: dict[tuple[str, str, str], float]  # (dataset, method, split) -> number
    description: str = ""
    runner: str | None = None  # "module:function" with run_experiment's signature, for non-UPFL protocols
    run_fn: Callable[..., dict[str, Any]] | None = None  # replaces runner.run_seed (same signature)
    # several methods of one seed trained together (--stack-variants): (protocol, methods, seed, run_dirs, device,
    # mode, progress, data_root, fed) -> one record per method
    variants_fn: Callable[..., list[dict[str, Any]]] | None = None
    optional_methods: tuple[str, ...] = ()  # run only when named (--methods); aggregated when present


def _federation(protocol: Protocol) -> Federation:
    """The recipe federation of ``protocol`` (the rotation concept shift and ``max_samples`` subsets are built by
    the harness itself, :func:`lab.runner.build_federated`)."""
    partition = "iid" if protocol.partition == "rotation" else protocol.partition  # App. F: IID, then rotated
    return Federation(partition=partition, num_clients=protocol.num_clients,
                      new_fraction=protocol.new_fraction, val_fraction=protocol.val_fraction, alpha=protocol.alpha,
                      val_clients=protocol.options.get("val_clients", 0), client_fraction=protocol.client_fraction,
                      public_size=protocol.options.get("public_size", 0))


def protocol_recipe(protocol: Protocol, method: str, data_root: str | None = None, **changes: Any) -> Recipe:
    """``method`` under ``protocol`` as a recipe: its model, data set and split, federation, the method's
    hyperparameters, round budget, local steps and validation interval. ``changes``: Recipe fields on top (an
    experiment with its own procedure sets ``model``, ``hyper`` or ``local_iterations`` of its own)."""
    fields = dict(model=protocol.model, data=DataSpec.builtin(protocol.dataset, data_root, split=protocol.split),
                  federation=_federation(protocol), method=method, hyper=protocol.method_hp.get(method, {}),
                  rounds=protocol.rounds_for(method), local_iterations=protocol.local_iterations,
                  batch_size=protocol.batch_size, eval_every=protocol.eval_every_for(method),
                  name=f"{protocol.dataset}-{method}")
    return Recipe(**{**fields, **changes})  # type: ignore[arg-type]
