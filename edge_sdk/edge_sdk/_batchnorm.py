"""The bundle's batch-normalisation rule: which statistics a batch-normalised model normalises with on the device.

Graphs of batch-normalised models take the population statistics (``stats.<layer>.mean`` / ``.var``, the bundle's
``stats`` weights) and a scalar ``bn_momentum`` m: each layer normalises with (1 - m) population + m batch
statistics. The manifest's ``batch_norm`` entry fixes m:
* the frozen forward (predictions): m = 0, the population statistics, at every batch size -- a prediction never
  depends on which other samples share its batch;
* an adaptation step on ``min_batch`` or more samples: m = 1, the batch's own statistics (the original TENT);
* a smaller step batch (a stream of batch 1): ``small_batch="running"`` (default) m = 0, the population
  statistics; ``"ema"``: m = ``ema_momentum``, and the step's ``new_stats.*`` replace the device's statistics
  (an exponential moving average over the stream). Never the statistics of one sample alone.

    rule = BatchNormRule.from_manifest({"min_batch": 16, "small_batch": "ema", "ema_momentum": 0.1})
    rule.step_momentum(1)    # 0.1
    rule.step_momentum(64)   # 1.0
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnxruntime as ort

SMALL_BATCH = ("running", "ema")
Weights = dict[str, np.ndarray]


@dataclass(frozen=True)
class BatchNormRule:
    statistics: str = "federated"  # where the population statistics come from (informational)
    min_batch: int = 16
    small_batch: str = "running"
    ema_momentum: float = 0.1

    @classmethod
    def from_manifest(cls, entry: Any) -> "BatchNormRule":
        """Validate the manifest's ``batch_norm`` entry (a dict); ValueError names the bad field."""
        if not isinstance(entry, dict):
            raise ValueError(f"batch_norm must be an object, got {type(entry).__name__}")
        rule = cls(**{k: entry[k] for k in ("statistics", "min_batch", "small_batch", "ema_momentum") if k in entry})
        if not isinstance(rule.min_batch, int) or rule.min_batch < 2:
            raise ValueError(f"batch_norm.min_batch must be an integer >= 2, got {rule.min_batch!r}")
        if rule.small_batch not in SMALL_BATCH:
            raise ValueError(f"batch_norm.small_batch must be one of {', '.join(SMALL_BATCH)}, "
                             f"got {rule.small_batch!r}")
        if not isinstance(rule.ema_momentum, (int, float)) or not 0.0 < rule.ema_momentum < 1.0:
            raise ValueError(f"batch_norm.ema_momentum must be in (0, 1), got {rule.ema_momentum!r}")
        return rule

    def step_momentum(self, batch: int) -> float:
        """m for an adaptation step on ``batch`` samples."""
        if batch >= self.min_batch:
            return 1.0
        return float(self.ema_momentum) if self.small_batch == "ema" else 0.0

    def updates_statistics(self, batch: int) -> bool:
        """Whether a step on ``batch`` samples replaces the device's statistics with its ``new_stats``."""
        return batch < self.min_batch and self.small_batch == "ema"


def uses_statistics(session: ort.InferenceSession) -> bool:
    return any(i.name == "bn_momentum" for i in session.get_inputs())


def statistics_feeds(session: ort.InferenceSession, stats: Weights, momentum: float) -> dict[str, np.ndarray]:
    """The ``stats.*`` and ``bn_momentum`` inputs of ``session`` ({} for a graph without batch normalisation)."""
    if not uses_statistics(session):
        return {}
    feeds: dict[str, np.ndarray] = {"bn_momentum": np.array(momentum, np.float32)}
    for spec in session.get_inputs():
        if spec.name.startswith("stats."):
            name = spec.name[len("stats."):]
            if name not in stats:
                raise ValueError(f"the bundle's statistics lack {name!r} (the graph needs {spec.name})")
            feeds[spec.name] = stats[name]
    return feeds
