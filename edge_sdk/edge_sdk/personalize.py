"""One entry point for a new client's personalisation of a verified bundle, whatever the method.

    from edge_sdk.bundle import load_bundle
    from edge_sdk.personalize import Personalizer

    p = Personalizer(load_bundle("bundle/"))
    result = p.personalize(x_unlabeled)          # FedTTA: 1 step; FedTTA++: entropy early stopping; TENT: steps
    logits = p.predict(x_stream, result.weights)

Methods by the bundle's artifacts and hyperparameters: ``fedtta_step`` with ``patience >= 1`` is FedTTA++
(UPFL Sec. 4.3), without it FedTTA (one step of Eq. 5); ``tent_step`` is TENT (``steps`` entropy steps on
the whole set); a bundle with only ``forward`` is plain inference. onnxruntime + numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge_sdk.bundle import Bundle
from edge_sdk.numerics import entropy
from edge_sdk.steps import StepRunner, Weights, check_batch, personalize_early_stopping


@dataclass
class Personalized:
    weights: Weights
    steps: int  # adaptation steps applied to the returned weights
    entropy_history: list[float] = field(default_factory=list)  # mean entropy per iterate, iterate 0 first


class Personalizer:
    def __init__(self, bundle: Bundle, threads: int | None = None, int8: bool = False) -> None:
        """``int8``: predictions of the received (un-personalised) model use the bundle's ``forward_int8``."""
        self.bundle = bundle
        self.hp = bundle.hyperparameters
        self.forward = bundle.session("forward", threads)
        self.base = bundle.weights("params")
        self.frozen_int8 = bundle.session("forward_int8", threads) if int8 else None
        names = {a["name"] for a in bundle.manifest["artifacts"]}
        self.runner: StepRunner | None = None
        if "fedtta_step" in names:
            self.runner = StepRunner(bundle.session("fedtta_step", threads), fixed=bundle.weights("phi"))
            self.kind = "FedTTA++" if int(self.hp.get("patience", 0)) >= 1 else "FedTTA"
        elif "tent_step" in names:
            self.runner = StepRunner(bundle.session("tent_step", threads))
            self.kind = "TENT"
        else:
            self.kind = "none"
        self._psi_inputs = [i.name for i in self.forward.get_inputs() if i.name.startswith("psi.")]

    def predict(self, x: np.ndarray, weights: Weights | None = None) -> np.ndarray:
        """Logits [N, C] of the model with ``weights`` (default: the received base model)."""
        if weights is None and self.frozen_int8 is not None:
            return self.frozen_int8.run(["logits"], {"x": check_batch(x, self.frozen_int8)})[0]
        w = self.base if weights is None else weights
        feeds = {"x": check_batch(x, self.forward), **{n: w[n[len("psi."):]] for n in self._psi_inputs}}
        return self.forward.run(["logits"], feeds)[0]

    def personalize(self, x: np.ndarray) -> Personalized:
        """Adapt the received model on the client's unlabeled set ``x`` (float32, the model's input shape)."""
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
