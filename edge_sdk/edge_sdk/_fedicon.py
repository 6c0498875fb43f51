"""FedICON's test-time adaptation on the device (Tan et al., Sec. 4.2): the encoder and projection tuned with the
unsupervised contrastive loss Eq. 7 on the device's unlabeled set, classifier head frozen.

The bundle's ``fedicon_step`` graph is one SGD step of Eq. 7: (x [B, ...], u [B, 2, K], psi, proj) -> (new psi,
new proj, logits, loss); ``u`` are the uniforms that draw each sample's two augmented views, so the graph holds
no randomness. This module draws them exactly as the server does (:func:`hash_uniform`, a numpy port of
``fl_server.data.augment.hash_uniform``) and walks the set as ``FedICON.personalize`` does (``tta_epochs``
passes of ``tta_batch`` samples in a seeded order): the device's personalised weights are the server's.
Batch normalisation: every step normalises with the statistics of its 2B augmented views, as the server's step
does (B >= 2, so never one sample's statistics), whatever the bundle's ``batch_norm`` rule says for other
methods' steps; the device's population statistics are not changed, and predictions use them (the server's
fedicon-shift benchmark predicts with the test batch's statistics instead, see docs/edge-architectures.md).

    runner = FedICONStep(bundle.session("fedicon_step"), proj=bundle.weights("proj"))
    psi, steps, losses = personalize_fedicon(runner, x, bundle.weights("params"), TTAPlan.from_bundle(bundle))

onnxruntime + numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_sdk._batchnorm import statistics_feeds
from edge_sdk._errors import BundleError
from edge_sdk._steps import Weights, check_batch, check_weights, finite

if TYPE_CHECKING:
    import onnxruntime as ort

    from edge_sdk._bundle import Bundle

_M32 = 0xFFFFFFFF
# the server's constants (fl_server.algorithms.fedicon.FedICON._uniforms / personalize): key = tag + seed * 7919,
# tag = epoch * 1_000_003 + batch index
_SEED_MIX, _EPOCH_MIX = 7_919, 1_000_003
MAX_SEED, MAX_EPOCHS = 2**31 - 1, 1000  # the server's int64 key arithmetic is exact far beyond these


def _hash32(x: np.ndarray) -> np.ndarray:
    """'lowbias32' integer hash on uint64 arrays holding values in [0, 2^32) (products wrap mod 2^64, as
    torch's int64 ones do; only the low 32 bits are kept)."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(_M32)
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & np.uint64(_M32)
    return x ^ (x >> np.uint64(16))


def hash_uniform(key: int, n: int, k: int) -> np.ndarray:
    """[n, k] float32 uniforms in (0, 1), a pure function of the integer ``key`` >= 0: bit-identical to the
    server's ``fl_server.data.augment.hash_uniform``.

    >>> hash_uniform(7, 2, 3).shape
    (2, 3)
    """
    if key < 0:
        raise ValueError(f"key must be >= 0, got {key}")
    idx = np.arange(n * k, dtype=np.uint64).reshape(n, k)
    with np.errstate(over="ignore"):
        base = _hash32(np.array(key & _M32, dtype=np.uint64))
        h = _hash32((base + idx * np.uint64(0x9E3779B9) + np.uint64(key >> 32)) & np.uint64(_M32))
    return (h.astype(np.float32) + np.float32(0.5)) / np.float32(4294967296.0)


@dataclass(frozen=True)
class TTAPlan:
    """How the set is walked: ``epochs`` passes of ``batch`` samples in the order seeded by ``seed`` (the run's
    seed, from the manifest); batches of fewer than 2 samples are skipped (Eq. 7 needs negatives)."""

    epochs: int = 1
    batch: int = 64
    seed: int = 0

    @classmethod
    def from_bundle(cls, bundle: Bundle) -> "TTAPlan":
        """The plan a FedICON bundle's manifest fixes (``tta_epochs``, ``tta_batch``, the run's ``seed``), validated:
        without the seed the device would draw other views than the server."""
        hp = bundle.manifest.get("hyperparameters")
        if not isinstance(hp, dict):
            raise BundleError("the FedICON bundle's manifest has no hyperparameters object")
        if "seed" not in bundle.manifest:
            raise BundleError("the FedICON bundle's manifest has no 'seed' (the run's seed draws the augmented "
                              "views); export it with fl-server export")
        if hp.get("tta_mode", "batch") != "batch":
            raise BundleError(f"this FedICON bundle asks for tta_mode={hp.get('tta_mode')!r}; the device runs "
                              "batch-mode TTA only (export a run trained with tta_mode='batch')")
        plan = cls(hp.get("tta_epochs", 1), hp.get("tta_batch", 64), bundle.manifest["seed"])
        for name, value, low, high in (("tta_epochs", plan.epochs, 1, MAX_EPOCHS), ("tta_batch", plan.batch, 2, None),
                                       ("seed", plan.seed, 0, MAX_SEED)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
                bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise BundleError(f"the bundle's {name} must be an integer {bounds}, got {value!r}")
        return plan


@dataclass
class FedICONStep:
    """The ``fedicon_step`` graph with the projection's weights (``proj``, empty for ``projection="none"``) and,
    for a batch-normalised model, the population statistics (fed to the graph, which steps with batch statistics
    as the server does, module docstring)."""

    session: ort.InferenceSession
    proj: Weights = field(default_factory=dict)
    stats: Weights = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.param_names = [n[len("new."):] for n in self.output_names if n.startswith("new.")]
        self.proj_names = [n[len("new_proj."):] for n in self.output_names if n.startswith("new_proj.")]
        try:  # names, dtype, shapes and finiteness, before anything reaches onnxruntime
            self.proj = check_weights(self.proj, self.session, prefix="proj.")
        except ValueError as exc:
            raise BundleError(f"the bundle's proj weights do not fit its fedicon_step graph: {exc}") from None
        u = next((i for i in self.session.get_inputs() if i.name == "u"), None)
        if u is None or not isinstance(u.shape[-1], int):
            raise BundleError("the fedicon_step graph has no input 'u' [B, 2, K] with a fixed K")
        self.uniforms_per_view: int = u.shape[-1]

    def uniforms(self, key: int, batch: int) -> np.ndarray:
        """The graph's ``u`` [B, 2, K] for the server's draw of 2B views (view 1 of every sample, then view 2)."""
        u = hash_uniform(key, 2 * batch, self.uniforms_per_view)
        return np.ascontiguousarray(u.reshape(2, batch, -1).transpose(1, 0, 2))

    def step(self, x: np.ndarray, psi: Weights, proj: Weights, u: np.ndarray) -> tuple[Weights, Weights, float]:
        """One SGD step of Eq. 7 on batch ``x``: (new psi, new proj, the loss before the step)."""
        feeds: dict[str, Any] = {"x": check_batch(x, self.session), "u": u}
        feeds.update({f"psi.{n}": psi[n] for n in self.param_names})
        feeds.update({f"proj.{n}": proj[n] for n in self.proj_names})
        feeds.update(statistics_feeds(self.session, self.stats, 1.0))  # the 2B views' own statistics
        out = dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
        return ({n: out[f"new.{n}"] for n in self.param_names}, {n: out[f"new_proj.{n}"] for n in self.proj_names},
                float(out["loss"]))


def personalize_fedicon(runner: FedICONStep, x: np.ndarray, psi: Weights,
                        plan: TTAPlan) -> tuple[Weights, int, list[float]]:
    """Batch-mode TTA of ``psi`` on the unlabeled set ``x`` (``FedICON.personalize``): returns (personalised psi,
    steps taken, Eq. 7 loss of every step). A step that overflows ends the adaptation at the last finite iterate."""
    proj, losses = runner.proj, []
    for epoch in range(plan.epochs):
        order = np.random.default_rng([plan.seed, epoch]).permutation(len(x))
        for i, start in enumerate(range(0, len(x), plan.batch)):
            idx = order[start:start + plan.batch]
            if len(idx) < 2:
                continue
            key = epoch * _EPOCH_MIX + i + plan.seed * _SEED_MIX
            new_psi, new_proj, loss = runner.step(x[idx], psi, proj, runner.uniforms(key, len(idx)))
            if not (finite(new_psi, loss) and finite(new_proj, loss)):
                return psi, len(losses), losses
            psi, proj = new_psi, new_proj
            losses.append(loss)
    return psi, len(losses), losses
