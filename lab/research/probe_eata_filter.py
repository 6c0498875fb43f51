"""Does EATA's reliable-sample filter make personalisation safe? Validation shifts of ``unseen-domain`` only.

For TENT, FedTTA and FedTTA-Prox, with the product's test-time step (off) and with EATA's reliable-sample weighting
of it at each ``--margins`` value (``reliable_mean`` below; EATA's default 0.4; lab-only subclasses of the product's
algorithms, built only to personalise the validation clients), the personalised minus received accuracy of
the new clients of every *validation* condition of the ``unseen-domain`` experiment (the training clients'
validation samples under the corruptions no test condition uses), mean over seeds and clients, per data set x
condition cell; then per method and margin the share of the validation samples the received model finds reliable
(kept%), the mean gain, the worst cell and the cells more than a point below the received model. The trainings are the experiment's
(resumed from ``--runs-dir``, trained there if missing); the test conditions' clients are never adapted.
``--masked`` (a diagnostic, not EATA's loss): sum_i 1[E_i < E0] v_i / N, the plain mean's own terms of the kept
samples only -- without EATA's weights (1 to e^E0 each) and its mean over the kept samples, which scale the step
up -- to tell the selection's effect from the step size's.

    python lab/research/probe_eata_filter.py [--seeds 3] [--margins 0.4] [--masked] [--runs-dir runs/bench]
        [--out FILE.json]   # docs/research/eata-filter*.txt: its printed tables
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import math

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "edge_sdk")]
from fl_server.algorithms import Algorithm, build_algorithm  # noqa: E402
from fl_server.algorithms.fedtta import FedTTA, FedTTAProx  # noqa: E402
from fl_server.algorithms.losses import entropy_from_logits  # noqa: E402
from fl_server.algorithms.tent import Tent  # noqa: E402
from fl_server.functional import State, grad, sgd  # noqa: E402
from fl_server.models import Classifier  # noqa: E402
from lab.experiments import get_experiment  # noqa: E402
from lab.runner import build_federated, build_simulation, safe_name  # noqa: E402
from lab.unseen import UNSEEN_METHODS, conditions  # noqa: E402

METHODS = ("TENT", "FedTTA", "FedTTA-Prox")


Weigh = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (values [N], logits [N, C], margin) -> loss


def reliable_mean(values: torch.Tensor, logits: torch.Tensor, margin: float) -> torch.Tensor:
    """EATA's reliable-sample weighting of per-sample losses ``values`` [N] ("Efficient Test-Time Model Adaptation
    without Forgetting", Niu et al., ICML 2022, arXiv:2204.02610, Eq. 3): S_i = 1[E_i < E0] exp(E0 - E_i), E_i the
    prediction entropy of ``logits`` (no gradient through S), E0 = margin * ln C; then sum_i S_i values_i /
    max(1, #kept) (the authors' code filters, then means), so nothing kept gives a zero loss."""
    entropy = entropy_from_logits(logits).detach()
    e0 = margin * math.log(logits.shape[-1])
    kept = (entropy < e0).to(values.dtype)
    return (kept * torch.exp(e0 - entropy) * values).sum() / kept.sum().clamp(min=1.0)


def masked_mean(values: torch.Tensor, logits: torch.Tensor, margin: float) -> torch.Tensor:
    """The ``--masked`` diagnostic: the plain mean's terms of EATA's kept samples only (no weights, over N)."""
    kept = entropy_from_logits(logits).detach() < margin * math.log(logits.shape[-1])
    return (kept.to(values.dtype) * values).mean()


class _Weighted:
    """A lab-only subclass's sample weighting of its test-time loss: ``weigh`` at ``margin``. The probe builds these
    only to personalise new clients (never to train), so the whole test-time loss is overridden."""
    margin: float
    weigh: Weigh

    def __init__(self, model: Classifier, *, margin: float, weigh: Weigh = reliable_mean, seed: int = 0,
                 **hyper: Any) -> None:
        super().__init__(model, seed=seed, **hyper)  # type: ignore[call-arg]
        self.margin, self.weigh = margin, weigh


class EataTent(_Weighted, Tent):
    """TENT whose entropy step weights the per-sample entropies (EATA's Eq. 3, or ``masked_mean``)."""

    def entropy_step(self, params: State, x: torch.Tensor) -> State:
        lr = self.hp.tent_lr if self.hp.tent_lr is not None else self.hp.lr
        moving = params if self.hp.adapt == "all" else {n: params[n] for n in self._affine}

        def loss(m: State) -> torch.Tensor:
            logits = self.forward({**params, **m}, x)
            return self.weigh(entropy_from_logits(logits), logits, self.margin)

        return {**params, **sgd(moving, grad(loss)(moving), lr)}


class EataFedTTA(_Weighted, FedTTA):
    """FedTTA whose new-client step weights l_per's per-sample g_i^2 inside sqrt(B * .)."""

    def personalization_loss_and_logits(self, psi: State, phi: State,
                                        x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.forward(psi, x)
        scores = self.g(phi, logits)
        # the clamp: no sample kept gives a zero loss of zero gradient (sqrt's at 0 would be NaN)
        mean_sq = self.weigh(scores.square(), logits, self.margin).clamp(min=1e-12)
        return torch.sqrt((self.hp.loss_batch or scores.shape[0]) * mean_sq), logits


class EataFedTTAProx(EataFedTTA, FedTTAProx):
    """FedTTA-Prox (FedTTA's step; mu acts in training only) with the weighted new-client step."""


WEIGHTED: dict[str, type[_Weighted]] = {"TENT": EataTent, "FedTTA": EataFedTTA, "FedTTA-Prox": EataFedTTAProx}


def personalizer(method: str, model: Classifier, seed: int, hyper: dict[str, Any], margin: float | None,
                 weigh: Weigh = reliable_mean) -> Algorithm:
    """The product's ``method`` (margin None) or its lab-only weighted subclass, to personalise new clients."""
    if margin is None:
        return build_algorithm(method, model, 1, seed=seed, **hyper)
    return WEIGHTED[method](model, margin=margin, weigh=weigh, seed=seed, **hyper)  # type: ignore[return-value]


def gains(protocol: Any, method: str, seed: int, margins: list[float | None], runs: Path,
          data_root: str | None, weigh: Weigh = reliable_mean) -> dict[str, tuple[dict[str, float], float]]:
    """margin label -> (validation condition -> mean over clients of personalised - received accuracy (points),
    the share of the clients' samples the received model finds reliable, entropy < margin ln C (%))."""
    fed = build_federated(protocol, seed, data_root)
    train = UNSEEN_METHODS[method]
    run_dir = runs / "unseen-domain" / protocol.dataset / safe_name(train) / f"seed{seed}"
    sim = build_simulation(protocol, train, seed, run_dir, progress=False, data_root=data_root, fed=fed)
    sim.run()
    state = sim.best_state if sim.best_state is not None else sim.server_state
    val = [(shift, xs, ys) for split, shift, xs, ys in conditions(protocol, fed, seed, data_root) if split == "val"]
    with torch.no_grad():  # the received model's prediction entropy of every validation sample
        logits = [sim.algorithm.predict(state["params"], torch.from_numpy(xi).to(sim.device, sim.dtype))
                  for _, xs, _ in val for xi in xs]
        entropies = np.concatenate([entropy_from_logits(z).cpu().numpy() for z in logits])
    classes = logits[0].shape[-1]
    out: dict[str, tuple[dict[str, float], float]] = {}
    for margin in margins:
        algo = personalizer(method, sim.algorithm.model, seed, protocol.method_hp.get(method, {}), margin, weigh)

        def accuracy(params: Any, x: torch.Tensor, y: np.ndarray) -> float:
            with torch.no_grad():
                return float((algo.predict(params, x).argmax(-1).cpu().numpy() == y).mean())

        cells = {}
        for shift, xs, ys in val:
            diffs = []
            for xi, yi in zip(xs, ys):
                x = torch.from_numpy(xi).to(sim.device, sim.dtype)
                diffs.append(accuracy(algo.personalize(state, x), x, yi) - accuracy(state["params"], x, yi))
            cells[shift] = 100 * float(np.mean(diffs))
        kept = 100.0 if margin is None else 100 * float(np.mean(entropies < margin * math.log(classes)))
        out[str(margin)] = cells, kept
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--margins", type=float, nargs="+", default=[0.4])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--masked", action="store_true", help="diagnostic: the kept samples' plain terms, over N")
    ap.add_argument("--runs-dir", type=Path, default=Path("runs/bench"))
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    weigh = masked_mean if args.masked else reliable_mean
    margins: list[float | None] = [None, *args.margins]
    exp = get_experiment("unseen-domain")
    table: dict[str, dict[str, dict[str, float]]] = {}  # method -> margin -> "dataset/shift" -> gain
    kept: dict[str, dict[str, list[float]]] = {}  # method -> margin -> per data set and seed
    for method in args.methods:
        for dataset, protocol in exp.protocols.items():
            per_seed = [gains(protocol, method, s, margins, args.runs_dir, args.data_dir, weigh)
                        for s in range(args.seeds)]
            for m in map(str, margins):
                kept.setdefault(method, {}).setdefault(m, []).extend(seed[m][1] for seed in per_seed)
                for shift in per_seed[0][m][0]:
                    table.setdefault(method, {}).setdefault(m, {})[f"{dataset}/{shift}"] = float(
                        np.mean([seed[m][0][shift] for seed in per_seed]))
    print(f"{'method':12s} {'margin':>6s} {'kept%':>6s} {'mean':>6s} {'worst':>6s} {'<-1':>4s}  worst cell")
    summary = {}
    for method, by_margin in table.items():
        for m, cells in by_margin.items():
            worst = min(cells, key=cells.__getitem__)
            mean = float(np.mean(list(cells.values())))
            share, below = float(np.mean(kept[method][m])), sum(v < -1 for v in cells.values())
            summary[f"{method} {m}"] = {"kept": share, "mean": mean, "worst": cells[worst], "worst_cell": worst,
                                        "cells_below_-1": below}
            print(f"{method:12s} {m:>6s} {share:6.1f} {mean:6.1f} {cells[worst]:6.1f} {below:4d}  {worst}")
    cells_all = sorted(next(iter(next(iter(table.values())).values())))
    print("\ncell", *(f"{me}|{m}" for me in table for m in table[me]), sep="\t")
    for c in cells_all:
        print(c, *(f"{table[me][m][c]:.1f}" for me in table for m in table[me]), sep="\t")
    if args.out:
        args.out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "seeds": args.seeds,
                                        "summary": summary, "cells": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
