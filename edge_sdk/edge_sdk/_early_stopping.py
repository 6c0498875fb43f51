"""Entropy early stopping for FedTTA++ (Sec. 4.3 of "UPFL: Unsupervised Personalized Federated Learning towards New
Clients", Ye et al., SDM 2024, arXiv:2307.15994), shared by the server simulation and the device.

Iterate 0 is the un-adapted model. After each adaptation step the caller reports the mean prediction
entropy H = -sum p log p of the personalised model on the client's data; adaptation stops once the entropy
has not decreased for ``patience`` consecutive steps (or after ``max_steps``), and the iterate with the
lowest entropy is the answer. Iterates before ``first_candidate`` are recorded but never chosen: with 1, the
one-step model that FedTTA's meta-training targets is the starting point and the un-adapted model (not
trained to predict on its own) is not an answer (docs/research/fedttapp-diagnosis.md; 0 is the paper's reading).
(The authors' code computes ``p * log2(prob)`` with ``p`` the patience counter, which always returns
iterate 0.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class EntropyEarlyStopping:
    patience: int = 1
    max_steps: int = 50
    first_candidate: int = 0
    best_step: int = -1
    best_entropy: float = math.inf
    history: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")
        if not 0 <= self.first_candidate <= self.max_steps:
            raise ValueError(f"first_candidate must be in [0, max_steps={self.max_steps}], got {self.first_candidate}")

    def update(self, entropy: float) -> bool:
        """Record the entropy of the next iterate (0 = un-adapted); return True when adaptation should stop."""
        if not math.isfinite(entropy):
            raise ValueError(f"entropy must be finite, got {entropy}")
        step = len(self.history)
        self.history.append(float(entropy))
        if step < self.first_candidate:
            return False
        if entropy < self.best_entropy:
            self.best_step, self.best_entropy = step, float(entropy)
        return step - self.best_step >= self.patience or step >= self.max_steps
