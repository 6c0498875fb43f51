"""The SDK's own runners, one per device step kind (:func:`edge_sdk.register_runner`); what each does behind
``Device.personalize`` / ``Device.predict``:

* ``"none"`` (:class:`ModelRunner`): the received model; the base of every runner on the ``forward`` graph
  (its weights, the int8 graph, batch normalisation's population statistics and rule).
* ``"tent_step"``: ``steps`` passes of entropy steps over the set, in batches of ``batch_size`` if set.
* ``"fedtta_step"``: one step of UPFL Eq. 5; with ``patience >= 1`` steps with entropy early stopping (Sec. 4.3).
* ``"fedicon_step"``: encoder and projection tuned with Eq. 7 (:mod:`edge_sdk._fedicon`).
* ``"encoder"``: e = g_gamma(x) on the device (optionally differentially private), the coordinator's
  hypernetwork returns the weights (``client.generate``).
* ``"btfl"``: local head and local DLE on labeled data, BTFL's interpolation while streaming; variants
  ``"FedTHE"`` (FedTHE's head ensemble on the same two heads) and ``"none"`` (the global head alone).

Bad input: ``x`` must be a float32 array of the model's input shape, non-empty and finite, else a ValueError
says which; weights must match the graph's names, shapes and dtype and be finite. A constant stream adapts like
any other; finite inputs so large that the model overflows raise a ValueError; a step that overflows ends
adaptation at the last finite iterate (the lowest-entropy one with early stopping).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_sdk import _dp as dp
from edge_sdk._batchnorm import BatchNormRule, statistics_feeds, uses_statistics
from edge_sdk._btfl import BTFLParticipant
from edge_sdk._errors import BundleError
from edge_sdk._fedicon import FedICONStep, TTAPlan, personalize_fedicon
from edge_sdk._fedthe import feature_history, fedthe_predict
from edge_sdk._numerics import entropy, log_softmax
from edge_sdk._registry import RECEIVED, Adaptation, Runner, register_runner
from edge_sdk._steps import (StepRunner, Weights, check_batch, check_logits, check_weights, finite,
                            personalize_early_stopping)
from edge_sdk.safeguard import mix

if TYPE_CHECKING:
    from edge_sdk._bundle import Bundle
    from edge_sdk._client import EdgeClient

__all__ = ["ModelRunner"]


def _adaptation(bundle: Bundle, steps: int, samples: int, details: dict[str, Any] | None = None) -> Adaptation:
    return Adaptation(bundle.method, steps, samples, details or {})


@register_runner(RECEIVED)
class ModelRunner(Runner):
    """The received model on the bundle's ``forward`` graph (weights ``params``); a batch-normalised model
    predicts with the bundle's population statistics. Subclasses override :meth:`adapt`, which returns
    (weights, steps, details); :meth:`predict` then uses those weights. ``int8``: the received model's
    predictions use ``forward_int8``."""

    def __init__(self, bundle: Bundle, *, threads: int | None = 1, int8: bool = False,
                 client: EdgeClient | None = None) -> None:
        super().__init__(bundle, threads=threads, int8=int8, client=client)
        self.hp = bundle.hyperparameters
        self.forward = bundle.session("forward", threads)
        self.base = bundle.weights("params")
        self.frozen_int8 = bundle.session("forward_int8", threads) if int8 else None
        self.stats: Weights = {}  # batch normalisation: the population statistics (edge_sdk._batchnorm)
        self.rule = BatchNormRule()
        if uses_statistics(self.forward):
            names = {a["name"] for a in bundle.manifest["artifacts"]}
            if "stats" not in names or "batch_norm" not in bundle.manifest:
                raise BundleError("the model is batch-normalised but the bundle has no statistics or batch_norm rule")
            try:
                self.rule = BatchNormRule.from_manifest(bundle.manifest["batch_norm"])
            except ValueError as exc:
                raise BundleError(str(exc)) from None
            self.stats = check_weights(bundle.weights("stats"), self.forward, prefix="stats.")
        self.step: StepRunner | None = None  # a step graph whose "ema" rule may move the statistics
        self.weights: Weights | None = None  # the personalised weights (None: the received model's)
        self.partial = False  # the safeguard kept both models partially (predict mixes them)
        self._psi_inputs = [i.name for i in self.forward.get_inputs() if i.name.startswith("psi.")]
        self._checked: Weights | None = None  # the last weight set that passed check_weights ...
        self._checked_copy: Weights = {}  # ... and the copy of it that was checked and is what runs

    @property
    def current_stats(self) -> Weights:
        """The population statistics predictions use: the bundle's, or the stream's exponential update of them
        (``batch_norm.small_batch="ema"``) once adaptation steps have run."""
        return self.step.stats if self.step is not None else self.stats

    def logits(self, x: np.ndarray, weights: Weights | None = None, stats: Weights | None = None) -> np.ndarray:
        """Logits [N, C] of the model with ``weights`` (default: the received model) and population statistics
        ``stats`` (default: :attr:`current_stats`). A weight set is validated and copied on its first use here;
        pass a new dict to predict with changed weights."""
        # the received model (also after a rollback, which sets the weights back to it, and as the received half
        # of a partial decision) runs its int8 graph: the received weights with the bundle's own statistics
        if (weights is None or weights is self.base) and (stats is None or stats is self.stats) \
                and self.frozen_int8 is not None:
            x = check_batch(x, self.frozen_int8)
            return check_logits(self.frozen_int8.run(["logits"], {"x": x})[0], x)
        x = check_batch(x, self.forward)
        w = self.base if weights is None else weights
        if w is not self.base:
            if w is not self._checked:
                # a weight set is checked once, on a copy that is then what runs: changing the caller's arrays
                # afterwards cannot send unchecked values to onnxruntime (pass a new dict to use new weights)
                copy = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in w.items()} \
                    if isinstance(w, dict) else w
                self._checked_copy, self._checked = check_weights(copy, self.forward), w
            w = self._checked_copy
        feeds = {"x": x, **{n: w[n[len("psi."):]] for n in self._psi_inputs},
                 **statistics_feeds(self.forward, self.current_stats if stats is None else stats, 0.0)}
        return check_logits(self.forward.run(["logits"], feeds)[0], x)

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self.partial:  # the safeguard kept both models: the mean of their probabilities
            return mix(self.logits(x, self.base, self.stats), self.logits(x, self.weights))
        return self.logits(x, self.weights)

    def personalize(self, x: np.ndarray, y: np.ndarray | None = None, *, epsilon: float = math.inf,
                    delta: float = 0.01, rng: np.random.Generator | None = None) -> Adaptation:
        """Adapt on the unlabeled set ``x`` (``y`` is not used); ``epsilon``, ``delta``, ``rng``: the privacy
        budget of a runner that sends something to the coordinator (``"encoder"``)."""
        x = check_batch(x, self.forward)
        self.partial = False
        # the last personalisation is dropped before this one runs (each call starts from the received model):
        # its weights and their checked copy would otherwise stay alive through the new steps (peak memory)
        self.weights, self._checked, self._checked_copy = self.base, None, {}
        self.weights, steps, details = self.adapt(x, epsilon=epsilon, delta=delta, rng=rng)
        return _adaptation(self.bundle, steps, len(x), details)

    def roll_back(self) -> None:
        """Predict with the received model again (the safeguard's rollback): its weights, and the bundle's
        population statistics where adaptation steps moved them."""
        self.weights, self.partial = self.base, False
        if self.step is not None:
            self.step.stats = self.stats

    def keep_partially(self) -> None:
        """Predict with the mean of the received and the personalised model's probabilities (the safeguard's
        partial decision; :func:`edge_sdk.safeguard.mix`)."""
        self.partial = True

    def adapt(self, x: np.ndarray, **options: Any) -> tuple[Weights, int, dict[str, Any]]:
        """(weights, steps, details) for the checked batch ``x``: here the received weights, unchanged."""
        return self.base, 0, {"entropy_history": [self._entropy(x)]}

    def _entropy(self, x: np.ndarray, weights: Weights | None = None) -> float:
        return float(entropy(self.logits(x, weights)).mean())


@register_runner("tent_step")
class TentRunner(ModelRunner):
    """``steps`` passes of entropy steps over the set in batches of ``batch_size`` (the whole set if unset), as
    on the server; an overflowing step keeps the last finite iterate."""

    graph = "tent_step"

    def __init__(self, bundle: Bundle, **kwargs: Any) -> None:
        super().__init__(bundle, **kwargs)
        self.step = self._step_graph()

    def _step_graph(self) -> StepRunner:
        return StepRunner(self.bundle.session(self.graph, self.threads), stats=self.stats, rule=self.rule)

    def plan(self, x: np.ndarray) -> tuple[int, int]:
        """(passes over the set, samples per step)."""
        return int(self.hp.get("steps", 1)), int(self.hp.get("batch_size") or len(x))

    def adapt(self, x: np.ndarray, **options: Any) -> tuple[Weights, int, dict[str, Any]]:
        assert self.step is not None
        steps, chunk = self.plan(x)
        history = [self._entropy(x)]
        current = self.base
        starts = [start for _ in range(steps) for start in range(0, len(x), chunk)]
        for i, start in enumerate(starts):
            new, _, h = self.step.step(x[start:start + chunk], current, release=i == len(starts) - 1)
            if not finite(new, h):  # overflow: keep the last finite iterate
                return current, len(history) - 1, {"entropy_history": history}
            current = new
            history.append(h)
        return current, len(history) - 1, {"entropy_history": history}


@register_runner("fedtta_step")
class FedTTARunner(TentRunner):
    """One step of UPFL Eq. 5 on the set (the step graph holds phi); with ``patience >= 1`` (FedTTA++, Sec. 4.3)
    steps with entropy early stopping, keeping the lowest-entropy iterate."""

    graph = "fedtta_step"

    def _step_graph(self) -> StepRunner:
        return StepRunner(self.bundle.session(self.graph, self.threads), fixed=self.bundle.weights("phi"),
                          stats=self.stats, rule=self.rule)

    def plan(self, x: np.ndarray) -> tuple[int, int]:
        return 1, len(x)

    def adapt(self, x: np.ndarray, **options: Any) -> tuple[Weights, int, dict[str, Any]]:
        patience = int(self.hp.get("patience", 0))
        if patience < 1:
            return super().adapt(x)
        assert self.step is not None
        best, stopper = personalize_early_stopping(self.step, self.forward, x, self.base, patience,
                                                   int(self.hp.get("max_steps", 50)),
                                                   int(self.hp.get("first_candidate", 0)))
        return best, stopper.best_step, {"entropy_history": list(stopper.history)}


@register_runner("fedicon_step")
class FedICONRunner(ModelRunner):
    """Encoder and projection tuned with Eq. 7 on two augmented views per sample, walking the set as the server
    does (:mod:`edge_sdk._fedicon`); predictions keep the shipped population statistics."""

    def __init__(self, bundle: Bundle, **kwargs: Any) -> None:
        super().__init__(bundle, **kwargs)
        names = {a["name"] for a in bundle.manifest["artifacts"]}
        proj = bundle.weights("proj") if "proj" in names else {}  # projection="none": no weights
        self.fedicon = FedICONStep(bundle.session("fedicon_step", self.threads), proj=proj, stats=self.stats)
        self.plan = TTAPlan.from_bundle(bundle)

    def adapt(self, x: np.ndarray, **options: Any) -> tuple[Weights, int, dict[str, Any]]:
        before = self._entropy(x)
        psi, steps, losses = personalize_fedicon(self.fedicon, x, self.base, self.plan)
        details: dict[str, Any] = {"entropy_history": [before, self._entropy(x, psi)]}
        if losses:
            details["contrastive_loss"] = losses
        return psi, steps, details


@register_runner("encoder")
class EncoderRunner(ModelRunner):
    """The client embedding e = g_gamma(x) on the device (only e leaves it); the coordinator's hypernetwork
    returns the weights w = f_theta(e) (``client.generate``)."""

    def __init__(self, bundle: Bundle, **kwargs: Any) -> None:
        super().__init__(bundle, **kwargs)
        self.encoder = bundle.session("encoder", self.threads)
        self.gamma = {f"gamma.{k}": v for k, v in bundle.weights("enc").items()}

    def embed(self, x: np.ndarray, epsilon: float = math.inf, delta: float = 0.01,
              rng: np.random.Generator | None = None) -> np.ndarray:
        """The client embedding e [E], all the coordinator sees. A finite ``epsilon`` makes it (epsilon,
        delta)-differentially private for this set of |D| = len(x) samples (noise on the pooled vector,
        :func:`edge_sdk._dp.privatize_pooled`); the bundle must come from the DP encoder (``dp=True``)."""
        x = check_batch(x, self.encoder)
        feeds = {"x": x, **self.gamma}
        if dp.gaussian_sigma(epsilon, delta, len(x)) == 0.0:  # also validates the budget (ValueError)
            return check_logits(self.encoder.run(["embedding"], feeds)[0], x)
        if "pooled" not in {o.name for o in self.encoder.get_outputs()}:
            raise BundleError(f"this {self.bundle.method} bundle's encoder is not the DP encoder (trained with "
                              "dp=True), so its embedding has no known sensitivity: use epsilon=math.inf or a DP "
                              "bundle")
        pooled = check_logits(self.encoder.run(["pooled"], feeds)[0], x)
        return dp.privatize_pooled(pooled, self.gamma["gamma.psi.weight"], self.gamma["gamma.psi.bias"], epsilon,
                                   delta, len(x), rng if rng is not None else np.random.default_rng())

    def personalize(self, x: np.ndarray, y: np.ndarray | None = None, **options: Any) -> Adaptation:
        if self.client is None:
            raise BundleError(f"{self.bundle.method} needs the coordinator's hypernetwork: open_bundle(bundle, "
                              "client=EdgeClient)")
        return super().personalize(x, y, **options)

    def adapt(self, x: np.ndarray, *, epsilon: float = math.inf, delta: float = 0.01,
              rng: np.random.Generator | None = None, **options: Any) -> tuple[Weights, int, dict[str, Any]]:
        assert self.client is not None
        # this bundle's hypernetwork, not whichever the coordinator serves now: another release's (a retrain, another
        # seed) generates weights of the same shapes for another encoder, which nothing could tell apart
        weights = self.client.generate(self.embed(x, epsilon, delta, rng), bundle_id=self.bundle.id)
        return self.generated(weights), 1, {"entropy_history": []}

    def generated(self, w: object) -> Weights:
        """The coordinator's reply {"psi.<name>": array}, checked against the forward graph."""
        if not isinstance(w, dict):
            raise ValueError(f"generate returned {type(w).__name__}, not a dict of 'psi.<name>' arrays")
        try:
            return check_weights({n[len("psi."):]: v for n, v in w.items() if n.startswith("psi.")}, self.forward)
        except ValueError as exc:
            raise ValueError(f"the generated weights do not fit this bundle's model: {exc}") from None


@register_runner("btfl")
class BTFLRunner(Runner):
    """BTFL's personalisation phase on labeled (x, y): a local head and a local DLE on the frozen global features;
    the DLE goes to the coordinator when a client is given (the reply's re-aggregated DLE is the stream's global
    DLE, else the bundle's training DLE); then BTFL's interpolation of the two heads while predicting (each
    batch is the next samples of the stream)."""

    needs_labels = True

    def __init__(self, bundle: Bundle, *, threads: int | None = 1, int8: bool = False,
                 client: EdgeClient | None = None) -> None:
        super().__init__(bundle, threads=threads, int8=int8, client=client)
        self.btfl = BTFLParticipant(bundle, threads)

    @property
    def global_weight(self) -> float | None:  # type: ignore[override]
        """The weight e of the global head for the last sample predicted."""
        stream = self.btfl.stream
        if stream is None:
            return None
        if stream.last_weight is not None:  # a one-sample call
            return float(stream.last_weight)
        return None if stream.last_weights is None else float(stream.last_weights[-1])

    def _fit(self, x: np.ndarray, y: np.ndarray | None, name: str) -> dict[str, Any]:
        if y is None:
            raise ValueError(f"{name} personalises on labeled data: call personalize(x, y) (it trains the device's "
                             "local head on the frozen global features)")
        fit = self.btfl.fit(x, np.asarray(y))
        return {"local_head_train_accuracy": fit.train_accuracy}

    def personalize(self, x: np.ndarray, y: np.ndarray | None = None, **options: Any) -> Adaptation:
        details = self._fit(x, y, self.bundle.method)
        global_dle = None
        if self.client is not None:  # the coordinator re-aggregates the DLEs (everyone else's is ours to use)
            fit = self.btfl.fit_result
            assert fit is not None
            reply = self.client.upload_dle(fit.local_dle, fit.samples, bundle_id=self.bundle.id)
            global_dle = reply["others_dle"] if reply.get("others_dle") is not None else reply["global_dle"]
            details["dle_clients"], details["dle_base"] = reply.get("clients"), reply.get("base")
        self.btfl.start(global_dle)
        return _adaptation(self.bundle, 1, len(x), details)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Log-probabilities [N, C] of the interpolation (before :meth:`personalize`: the received model's)."""
        if self.btfl.fit_result is None:
            return self.btfl.global_logits(x)
        return self.btfl.logits(x)


@register_runner("btfl", variant=RECEIVED)
class BTFLReceivedRunner(Runner):
    """A BTFL bundle's received model: the global head on the global features."""

    def __init__(self, bundle: Bundle, *, threads: int | None = 1, int8: bool = False,
                 client: EdgeClient | None = None) -> None:
        super().__init__(bundle, threads=threads, int8=int8, client=client)
        self.btfl = BTFLParticipant(bundle, threads)

    def personalize(self, x: np.ndarray, y: np.ndarray | None = None, **options: Any) -> Adaptation:
        return _adaptation(self.bundle, 0, len(x))

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.btfl.global_logits(x)


@register_runner("btfl", variant="FedTHE")
class FedTHERunner(BTFLRunner):
    """FedTHE (Jiang & Lin 2022) on a BTFL bundle: a local head on labeled (x, y), then per batch the test-time
    ensemble of the global and local heads (:mod:`edge_sdk._fedthe`), the feature history carried over calls."""

    global_weight = None

    def __init__(self, bundle: Bundle, **kwargs: Any) -> None:
        super().__init__(bundle, **kwargs)
        self._state: dict[str, np.ndarray] | None = None  # mu_local, mu_global, the feature history

    def personalize(self, x: np.ndarray, y: np.ndarray | None = None, **options: Any) -> Adaptation:
        details = self._fit(x, y, "FedTHE")
        served = self.bundle.weights("btfl")
        if "mu_global" not in served:
            raise BundleError("this BTFL bundle has no mu_global (the training clients' mean feature FedTHE "
                              "needs); export it again with this version")
        z, _ = self.btfl.features(x)
        self._state = {"mu_local": z.mean(0), "mu_global": np.asarray(served["mu_global"], dtype=np.float64)}
        return _adaptation(self.bundle, 1, len(x), details)

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self.btfl.fit_result is None or self._state is None:
            return self.btfl.global_logits(x)
        z, g = self.btfl.features(x)
        local = z @ self.btfl.fit_result.local_head.T
        s = self._state
        logits, _ = fedthe_predict(g, local, z, s["mu_local"], s["mu_global"], batch_size=len(x),
                                   initial_history=s.get("history"))
        s["history"] = feature_history(z, initial=s.get("history"))[-1]
        return log_softmax(logits)
