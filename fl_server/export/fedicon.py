"""FedICON's test-time step as an exportable graph (see :mod:`fl_server.export.steps` for the conventions).

``fedicon_tta_step_spec``: (x, u, psi, proj) -> (new psi, new proj, logits, loss): one SGD step of Eq. 7 on the
batch; ``u`` [B, 2, K] are the uniforms that draw the two augmented views (the device makes them with any
seeded generator, e.g. numpy), so the graph itself has no randomness.
"""
from __future__ import annotations

import torch

from fl_server.algorithms.base import Algorithm
from fl_server.algorithms.fedicon import FedICON, split_params
from fl_server.data.augment import num_uniforms
from fl_server.export.steps import StepSpec, Stats, example_x, register_step_graph, with_norm_statistics
from fl_server.functional import State


def fedicon_tta_step_spec(algorithm: FedICON, psi: State, proj: State, batch: int = 4,
                          stats: Stats | None = None) -> StepSpec:
    if algorithm.hp.tta_mode != "batch":
        raise ValueError(f"FedICON's {algorithm.hp.tta_mode} TTA has no device graph: the device runs batch-mode "
                         "TTA (Sec. 4.2); export a run trained with tta_mode='batch'")
    names, proj_names = list(psi), list(proj)
    x = example_x(algorithm.model, psi, batch)
    u = torch.rand(batch, 2, num_uniforms(x.shape[1:]), dtype=x.dtype)

    def fn(x: torch.Tensor, u: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = dict(zip(names, weights[:len(names)]))
        q = dict(zip(proj_names, weights[len(names):]))
        uu = u.transpose(0, 1).reshape(-1, u.shape[-1])  # view 1 of every sample, then view 2
        loss = algorithm.tta_objective(split_params(p)[0], q, x, uu)
        new_p, new_q = algorithm.tta_step(p, q, x, uu)
        return (*(new_p[n] for n in names), *(new_q[n] for n in proj_names), algorithm.forward(new_p, x), loss)

    spec = StepSpec(fn, [x, u, *psi.values(), *proj.values()],
                    ["x", "u", *(f"psi.{n}" for n in names), *(f"proj.{n}" for n in proj_names)],
                    [*(f"new.{n}" for n in names), *(f"new_proj.{n}" for n in proj_names), "logits", "loss"],
                    batch_inputs=("x", "u"))
    return with_norm_statistics(spec, algorithm.model, stats, momentum=1.0)


@register_step_graph("fedicon_step")
def _fedicon_step(algorithm: Algorithm, state: State) -> StepSpec:
    return fedicon_tta_step_spec(algorithm, state["params"], state.get("proj", {}))  # type: ignore[arg-type]
