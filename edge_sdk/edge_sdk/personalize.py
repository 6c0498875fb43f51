"""Personalise a verified bundle on the device with the method it was trained for, on unlabeled data only.

* TENT: ``steps`` full-batch entropy steps (tent_step graph).
* FedTTA / FedTTA-Prox: one adaptation step; FedTTA++: steps with entropy early stopping (UPFL Sec. 4).
* ODPFL-HN: e = g_gamma(x) on the device (encoder graph), then only e goes to the coordinator, which returns
  w = f_theta(e) (``generate``: e [E] -> {"psi.<name>": array}, e.g. :meth:`EdgeClient.generate`).
* anything else / ``method="none"``: the received weights as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from edge_sdk.bundle import Bundle, BundleError
from edge_sdk.steps import StepRunner, Weights, check_batch, personalize_early_stopping

Generate = Callable[[np.ndarray], dict[str, np.ndarray]]


@dataclass
class Personalized:
    """The device's model: the bundle's forward graph plus its personalised weights ``psi``."""

    bundle: Bundle
    psi: Weights
    steps: int = 0

    def __post_init__(self) -> None:
        self.forward = self.bundle.session("forward", threads=1)
        self.names = [i.name[len("psi."):] for i in self.forward.get_inputs() if i.name.startswith("psi.")]
        self.feeds = {f"psi.{n}": self.psi[n] for n in self.names}

    def logits(self, x: np.ndarray) -> np.ndarray:
        """x [N, *input_shape] float32 -> logits [N, C] (validated: dtype, shape, finite)."""
        return self.forward.run(["logits"], {"x": check_batch(x, self.forward), **self.feeds})[0]


def personalize(bundle: Bundle, x: np.ndarray, method: str | None = None,
                generate: Generate | None = None) -> Personalized:
    """Adapt ``bundle`` to the unlabeled batch ``x`` with ``method`` (default: the bundle's own)."""
    method = bundle.method if method is None else method
    psi = bundle.weights("params")
    hp = bundle.hyperparameters
    names = {a["name"] for a in bundle.manifest["artifacts"]}
    if method == "none":
        return Personalized(bundle, psi)
    if method != bundle.method:
        raise BundleError(f"a {bundle.method} bundle cannot run {method}; join with method={method!r}")
    if "tent_step" in names:
        runner = StepRunner(bundle.session("tent_step"))
        for _ in range(int(hp.get("steps", 1))):
            psi, _, _ = runner.step(x, psi)
        return Personalized(bundle, psi, int(hp.get("steps", 1)))
    if "fedtta_step" in names:
        runner = StepRunner(bundle.session("fedtta_step"), fixed=bundle.weights("phi"))
        if hp.get("patience", 0) >= 1:  # FedTTA++
            best, stopper = personalize_early_stopping(runner, bundle.session("forward"), x, psi,
                                                       int(hp["patience"]), int(hp.get("max_steps", 50)))
            return Personalized(bundle, best, len(stopper.history) - 1)
        psi, _, _ = runner.step(x, psi)
        return Personalized(bundle, psi, 1)
    if "encoder" in names:
        if generate is None:
            raise BundleError("ODPFL-HN needs the coordinator's hypernetwork: pass generate=EdgeClient.generate")
        encoder = bundle.session("encoder")
        gamma = {f"gamma.{k}": v for k, v in bundle.weights("enc").items()}
        (e,) = encoder.run(["embedding"], {"x": check_batch(x, encoder), **gamma})
        w = generate(e)
        return Personalized(bundle, {n[len("psi."):]: v for n, v in w.items()}, 1)
    return Personalized(bundle, psi)
