"""Run exported gradient-step graphs on onnxruntime: the device personalises without a training framework.

A step graph takes ``x`` and weights named ``psi.<p>`` (and ``phi.<p>`` for FedTTA) and returns the updated
weights ``new.<p>``, the ``logits`` and the mean prediction ``entropy`` of the updated model (see
``export/steps.py``). Weights are plain ``dict[str, np.ndarray]`` keyed by parameter name.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from edge_sdk.early_stopping import EntropyEarlyStopping
from edge_sdk.numerics import entropy

Weights = dict[str, np.ndarray]


def load_session(path: str | os.PathLike, threads: int | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def check_batch(x: np.ndarray, session: ort.InferenceSession) -> np.ndarray:
    """Validate a batch against the graph's ``x`` input: dtype float32, rank, fixed dims, finite values."""
    spec = next(i for i in session.get_inputs() if i.name == "x")
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if x.ndim != len(spec.shape):
        raise ValueError(f"x must have {len(spec.shape)} dimensions {spec.shape}, got shape {x.shape}")
    for axis, (want, got) in enumerate(zip(spec.shape, x.shape)):
        if isinstance(want, int) and want != got:
            raise ValueError(f"x has size {got} on axis {axis}, the model expects {want} (shape {spec.shape})")
    if x.shape[0] == 0:
        raise ValueError("x is an empty batch")
    if not np.isfinite(x).all():
        raise ValueError("x contains NaN or inf")
    return x


@dataclass
class StepRunner:
    """One exported step graph plus the weights it updates (``psi``) and any fixed ones (``phi``)."""

    session: ort.InferenceSession
    fixed: Weights = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.param_names = [o.name[len("new."):] for o in self.session.get_outputs() if o.name.startswith("new.")]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def step(self, x: np.ndarray, psi: Weights) -> tuple[Weights, np.ndarray, float]:
        """One step on batch ``x``: returns (updated psi, logits [N, C], mean entropy)."""
        feeds = {"x": check_batch(x, self.session)}
        feeds.update({f"psi.{n}": psi[n] for n in self.param_names})
        feeds.update({f"phi.{n}": v for n, v in self.fixed.items()})
        out = dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
        return {n: out[f"new.{n}"] for n in self.param_names}, out["logits"], float(out["entropy"])


def personalize_early_stopping(runner: StepRunner, forward: ort.InferenceSession, x: np.ndarray, psi: Weights,
                               patience: int, max_steps: int = 50) -> tuple[Weights, EntropyEarlyStopping]:
    """FedTTA++ on the device: step until the mean entropy has not decreased for ``patience`` steps and
    return the lowest-entropy iterate (iterate 0, the received model, included)."""
    stopper = EntropyEarlyStopping(patience, max_steps)
    feeds = {"x": check_batch(x, forward), **{f"psi.{n}": psi[n] for n in runner.param_names}}
    stop = stopper.update(float(entropy(forward.run(["logits"], feeds)[0]).mean()))
    best, current = psi, psi
    while not stop:
        current, _, h = runner.step(x, current)
        stop = stopper.update(h)
        if stopper.best_step == len(stopper.history) - 1:
            best = current
    return best, stopper
