"""A new client's personalisation of a verified bundle, whatever the method, on unlabeled data only.

    from edge_sdk.bundle import load_bundle
    from edge_sdk.personalize import Personalizer, personalize

    p = Personalizer(load_bundle("bundle/"))
    result = p.personalize(x_unlabeled)          # -> Personalized(weights, steps, entropy_history)
    logits = p.predict(x_stream, result.weights)

    model = personalize(bundle, x_unlabeled)     # the same as one object: model.logits(x)

Methods, by the bundle's artifacts and hyperparameters:
* ``fedtta_step`` with ``patience >= 1``: FedTTA++ (steps of UPFL Eq. 5 with entropy early stopping, Sec. 4.3);
  without: FedTTA / FedTTA-Prox (one step).
* ``tent_step``: TENT (``steps`` passes of entropy steps over the set, in batches of ``batch_size`` if set).
* ``encoder``: ODPFL-HN: e = g_gamma(x) on the device (encoder graph); only e goes to the coordinator, whose
  hypernetwork returns w = f_theta(e) (``generate``: e [E] -> {"psi.<name>": array}, e.g. EdgeClient.generate).
* anything else, or ``method="none"``: the received weights as they are (plain inference).
onnxruntime + numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edge_sdk.bundle import Bundle, BundleError
from edge_sdk.numerics import entropy
from edge_sdk.steps import StepRunner, Weights, check_batch, personalize_early_stopping

Generate = Callable[[np.ndarray], dict[str, np.ndarray]]


@dataclass
class Personalized:
    weights: Weights
    steps: int  # adaptation steps behind the returned weights (FedTTA++: the chosen iterate)
    entropy_history: list[float] = field(default_factory=list)  # mean entropy per iterate, iterate 0 first


class Personalizer:
    def __init__(self, bundle: Bundle, threads: int | None = None, int8: bool = False,
                 method: str | None = None) -> None:
        """``int8``: predictions of the received (un-personalised) model use the bundle's ``forward_int8``.
        ``method``: ``None`` (the bundle's own) or ``"none"`` (plain inference with the received weights)."""
        if method not in (None, "none", bundle.method):
            raise BundleError(f"a {bundle.method} bundle cannot run {method}; join with method={method!r}")
        self.bundle = bundle
        self.hp = bundle.hyperparameters
        self.forward = bundle.session("forward", threads)
        self.base = bundle.weights("params")
        self.frozen_int8 = bundle.session("forward_int8", threads) if int8 else None
        names = {a["name"] for a in bundle.manifest["artifacts"]}
        self.runner: StepRunner | None = None
        self.kind = "none"
        if method == "none":
            pass
        elif "fedtta_step" in names:
            self.runner = StepRunner(bundle.session("fedtta_step", threads), fixed=bundle.weights("phi"))
            self.kind = "FedTTA++" if int(self.hp.get("patience", 0)) >= 1 else "FedTTA"
        elif "tent_step" in names:
            self.runner = StepRunner(bundle.session("tent_step", threads))
            self.kind = "TENT"
        elif "encoder" in names:
            self.encoder = bundle.session("encoder", threads)
            self.gamma = {f"gamma.{k}": v for k, v in bundle.weights("enc").items()}
            self.kind = "ODPFL-HN"
        self._psi_inputs = [i.name for i in self.forward.get_inputs() if i.name.startswith("psi.")]

    def predict(self, x: np.ndarray, weights: Weights | None = None) -> np.ndarray:
        """Logits [N, C] of the model with ``weights`` (default: the received base model)."""
        if weights is None and self.frozen_int8 is not None:
            return self.frozen_int8.run(["logits"], {"x": check_batch(x, self.frozen_int8)})[0]
        w = self.base if weights is None else weights
        feeds = {"x": check_batch(x, self.forward), **{n: w[n[len("psi."):]] for n in self._psi_inputs}}
        return self.forward.run(["logits"], feeds)[0]

    def embed(self, x: np.ndarray) -> np.ndarray:
        """ODPFL-HN: the client embedding e = g_gamma(x) [E], computed here; it is all the server sees."""
        if self.kind != "ODPFL-HN":
            raise BundleError(f"a {self.bundle.method} bundle has no client encoder")
        return self.encoder.run(["embedding"], {"x": check_batch(x, self.encoder), **self.gamma})[0]

    def personalize(self, x: np.ndarray, generate: Generate | None = None) -> Personalized:
        """Adapt the received model on the client's unlabeled set ``x`` (float32, the model's input shape)."""
        if self.kind == "ODPFL-HN":
            if generate is None:
                raise BundleError("ODPFL-HN needs the coordinator's hypernetwork: pass generate=EdgeClient.generate")
            w = generate(self.embed(x))
            return Personalized({n[len("psi."):]: v for n, v in w.items()}, 1)
        if self.runner is None:
            return Personalized(self.base, 0, [float(entropy(self.predict(x)).mean())])
        if self.kind == "FedTTA++":
            best, stopper = personalize_early_stopping(self.runner, self.forward, x, self.base,
                                                       int(self.hp["patience"]), int(self.hp.get("max_steps", 50)))
            return Personalized(best, stopper.best_step, list(stopper.history))
        steps = int(self.hp.get("steps", 1)) if self.kind == "TENT" else 1
        chunk = int(self.hp.get("batch_size") or len(x)) if self.kind == "TENT" else len(x)
        history = [float(entropy(self.predict(x)).mean())]
        current = self.base
        for _ in range(steps):  # TENT: one pass over the set in batches of ``batch_size`` per step (as on the server)
            for start in range(0, len(x), chunk):
                current, _, h = self.runner.step(x[start:start + chunk], current)
                history.append(h)
        return Personalized(current, len(history) - 1, history)


@dataclass
class DeviceModel:
    """A personalised model ready for streaming: ``logits(x)`` with the personalised weights."""

    personalizer: Personalizer
    weights: Weights
    steps: int = 0

    @property
    def psi(self) -> Weights:
        return self.weights

    def logits(self, x: np.ndarray) -> np.ndarray:
        """x [N, *input_shape] float32 -> logits [N, C] (validated: dtype, shape, finite)."""
        return self.personalizer.predict(x, self.weights)


def personalize(bundle: Bundle, x: np.ndarray, method: str | None = None,
                generate: Generate | None = None, threads: int | None = 1) -> DeviceModel:
    """Adapt ``bundle`` to the unlabeled batch ``x`` with ``method`` (default: the bundle's own; ``"none"``:
    the received weights)."""
    p = Personalizer(bundle, threads=threads, method=method)
    result = p.personalize(x, generate)
    return DeviceModel(p, result.weights, result.steps)
