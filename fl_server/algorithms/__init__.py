"""Federated methods behind one interface (:mod:`fl_server.algorithms.base`)."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable

from fl_server.algorithms.base import ALGORITHMS, Algorithm, Hyper, NotApplicable, register
from fl_server.models import Classifier

# every module of this package is imported, so a method registers itself (@register) where it is defined; the
# built-in ones first, in the order their names are listed (FedAvg first), then any other module
_BUILTIN = ("fedavg", "fedprox", "finetune", "local", "tent", "fedtta", "odpfl_hn", "btfl", "fedicon", "map")
for _module in (*_BUILTIN, *sorted(m.name for m in pkgutil.iter_modules(__path__))):
    importlib.import_module(f"{__name__}.{_module}")

from fl_server.algorithms.local import Local  # noqa: E402 - registered above, in order
from fl_server.algorithms.odpfl_hn import ODPFLHN  # noqa: E402


def canonical_method(name: str) -> str:
    """The display name of a method given in any letter case (``"tent"`` -> ``"TENT"``)."""
    if name in ALGORITHMS:
        return name
    matches = [m for m in ALGORITHMS if m.lower() == name.strip().lower()]
    if len(matches) != 1:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(ALGORITHMS)}")
    return matches[0]


def build_algorithm(name: str, model: Classifier, num_train_clients: int, seed: int = 0,
                    model_factory: Callable[[], Classifier] | None = None, **hyper: Any) -> Algorithm:
    """Instantiate a method by its display name (e.g. ``"FedAvg"``, ``"TENT"``); ``seed`` fixes the init of
    the modules a method adds to ``model``. ``model_factory``: fresh copies of a model not from the zoo
    (ODPFL-HN's encoder trunk is such a copy's ``features``)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(ALGORITHMS)}")
    cls = ALGORITHMS[name]
    if cls is Local:
        return Local(model, num_train_clients=num_train_clients, seed=seed, **hyper)
    if cls is ODPFLHN and "encoder_model" not in hyper:  # the encoder's trunk = the target model's
        if model.arch is not None:
            hyper = {**hyper, "encoder_model": model.arch}
        elif model_factory is not None:
            return ODPFLHN(model, seed=seed, encoder_factory=model_factory, **{**hyper, "encoder_model": "recipe"})
        else:
            raise ValueError("ODPFL-HN needs encoder_model (the model was not built by build_model)")
    return cls(model, seed=seed, **hyper)


__all__ = ["ALGORITHMS", "Algorithm", "Hyper", "NotApplicable", "build_algorithm", "canonical_method", "register"]
