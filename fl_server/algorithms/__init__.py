"""Federated methods behind one interface (:mod:`fl_server.algorithms.base`)."""
from __future__ import annotations

from typing import Any, Callable

from fl_server.algorithms.base import Algorithm, Hyper, NotApplicable
from fl_server.algorithms.btfl import BTFL
from fl_server.algorithms.fedavg import FedAvg
from fl_server.algorithms.fedicon import FedICON, FedICONNoTTA
from fl_server.algorithms.fedprox import FedProx
from fl_server.algorithms.fedtta import FedTTA, FedTTAPlusPlus, FedTTAProx
from fl_server.algorithms.finetune import FedAvgFT
from fl_server.algorithms.local import Local
from fl_server.algorithms.map import MAP, FedPHP, FedRS
from fl_server.algorithms.odpfl_hn import ODPFLHN
from fl_server.algorithms.tent import Tent
from fl_server.models import Classifier

ALGORITHMS: dict[str, type[Algorithm]] = {a.name: a for a in (FedAvg, FedProx, FedAvgFT, Local, Tent,
                                                                FedTTA, FedTTAProx, FedTTAPlusPlus, ODPFLHN, BTFL,
                                                                FedICON, FedICONNoTTA, MAP, FedRS, FedPHP)}


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


__all__ = ["ALGORITHMS", "Algorithm", "Hyper", "NotApplicable", "build_algorithm", "canonical_method"]
