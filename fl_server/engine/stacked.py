"""Several runs of one configuration stepped together: the seeds of a table row in one process.

A vmapped round of a small convolutional model keeps a GPU busy with many small grouped convolutions (one group
per client) without filling its matrix units (docs/research/gpu-engine.md). Stepping S runs that differ only in
their seed (their clients, initial weights and mini-batches) as one round of S x K clients gives every kernel S
times the work. Each run keeps everything of its own: its client sampling and batch draws, its aggregation,
validation, metrics, checkpoints and best state; only the local steps are computed together, as a second vmap
over the runs (:func:`~fl_server.engine.graphs.vmapped_round` with ``seed_axis``). So each run's results are the
ones it gets alone in float64 (tests/test_stacked_runs.py); in float32 the grouped kernels round differently from
the solo ones and training amplifies that, so a stacked run matches its solo run as a run on another GPU would,
not to the bit.

Runs that resume from different rounds are brought level first: the runs furthest behind step alone (or
together) until they reach the others (:func:`level_rounds`, also what lab/hetero.py's stacked lambda variants
use).

Example::

    sims = [simulation(recipe, seed, f"runs/row/seed{seed}", mode="vmap") for seed in (0, 1, 2)]
    results = run_stacked(sims)  # one RunResult per run, as sim.run() would return it
"""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from fl_server.engine.graphs import GraphedLocalSteps
from fl_server.engine.simulation import RunResult, Simulation, fingerprint_hp, graphable, run_local_steps
from fl_server.functional import State, stack, tree_map


def check_stackable(sims: list[Simulation]) -> None:
    """Raise ``ValueError`` naming what differs where ``sims`` cannot share their local steps: one method with the
    same hyperparameters and model shapes, a local step that is a pure function of its tensors
    (``Algorithm.graph_safe``, a model without batch-statistics normalisation), vmap mode, the same round shape
    (clients per round, local iterations, batch size) and the same data tensors (the runs' clients index into
    them)."""
    if not sims:
        raise ValueError("no runs to step together")
    lead = sims[0]
    for sim in sims:
        alg = sim.algorithm
        if not (alg.graph_safe and graphable(alg.model)):
            raise ValueError(f"{alg.name}'s local step reads Python state (Algorithm.graph_safe is False or the "
                             "model normalises by batch statistics): its runs cannot be stepped together")
        if sim.mode != "vmap":
            raise ValueError(f"runs stepped together need mode 'vmap' (a run resolved to {sim.mode!r}); pass "
                             "mode='vmap'")
    for sim in sims[1:]:
        differs = [what for what, a, b in (
            ("method", lead.algorithm.name, sim.algorithm.name),
            ("hyperparameters", fingerprint_hp(lead.algorithm.hp), fingerprint_hp(sim.algorithm.hp)),
            ("model", _shapes(lead), _shapes(sim)),
            ("round", _round_shape(lead), _round_shape(sim)),
            ("device", lead.device, sim.device), ("dtype", lead.dtype, sim.dtype),
            ("batched_conv", lead.cfg.batched_conv, sim.cfg.batched_conv))
            if a != b]
        if not differs and not (torch.equal(lead.x, sim.x) and torch.equal(lead.y, sim.y)):
            differs = ["data set"]
        if differs:
            raise ValueError(f"runs of seeds {lead.cfg.seed} and {sim.cfg.seed} differ in {', '.join(differs)}: "
                             "only runs that differ in their seed can be stepped together")


def _shapes(sim: Simulation) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in sim.algorithm.model.state_dict().items()}


def _round_shape(sim: Simulation) -> tuple[int, int, int, str]:
    return (len(sim.select_clients(0)), sim.cfg.local_iterations, sim.cfg.batch_size, sim.cfg.batch_stream)


def stacked_round(sims: list[Simulation], round_: int,
                  graphed: GraphedLocalSteps | None = None) -> list[tuple[np.ndarray, State]]:
    """Round ``round_`` of every run in ``sims``: each run's own client sampling, batches and aggregation, the
    local steps of all runs computed at once (``graphed``: replayed as one CUDA graph). Returns per run what its
    :meth:`~fl_server.engine.Simulation.run_round` returns: the selected client ids and their local states before
    aggregation."""
    if len(sims) == 1:
        return [sims[0].run_round(round_)]
    lead = sims[0]
    inputs = [sim.round_inputs(round_) for sim in sims]
    states = stack([s for _, s, _ in inputs])
    server = stack([sim.server_state for sim in sims])
    batches = torch.stack([b for _, _, b in inputs])
    out = run_local_steps(lead.algorithm.local_step, states, server, lead.x, lead.y, batches, "vmap",
                          lead.cfg.chunk_size, lead.algorithm.local_step_at, graphed, lead.cfg.batched_conv,
                          seed_axis=True)
    rounds = [(ids, tree_map(lambda t: t[k], out)) for k, (ids, _, _) in enumerate(inputs)]
    for sim, (ids, states_k) in zip(sims, rounds):
        sim.aggregate(ids, states_k)
    return rounds


def level_rounds(at: list[int], ends: list[int]) -> Iterator[tuple[int, list[int]]]:
    """(round, indices of the runs that step in it) until every run k has reached ``ends[k]``: the runs furthest
    behind step first, alone or together, so runs resumed at different rounds are brought level. The caller
    advances ``at`` after each round (and may lower ``ends``, e.g. for a run that diverged)."""
    while behind := [k for k in range(len(at)) if at[k] < ends[k]]:
        r = min(at[k] for k in behind)
        yield r, [k for k in behind if at[k] == r]


def run_stacked(sims: list[Simulation], progress: bool | None = None) -> list[RunResult]:
    """Run every simulation of ``sims`` (seeds of one configuration, :func:`check_stackable`) to its end with
    their local steps computed together; returns what each ``sim.run()`` would. A round's training time is shared
    equally by the runs that stepped in it (``RunResult.wall_s``); validation is each run's own."""
    check_stackable(sims)
    lead = sims[0]
    graphed = lead.graphed  # one graph cache for the stacked rounds (its key holds the stacked shapes)
    opened = [sim.begin() for sim in sims]  # (result, first round, round to stop before) per run
    at = [start for _, start, _ in opened]
    ends = [end for _, _, end in opened]
    show = lead.cfg.progress if progress is None else progress
    seeds = ", ".join(str(sim.cfg.seed) for sim in sims)
    with tqdm(total=sum(ends) - sum(at), desc=f"{lead.algorithm.name} {lead.fed.dataset.name} seeds {seeds}",
              disable=not show, dynamic_ncols=True) as bar:
        for r, group in level_rounds(at, ends):
            t0 = time.perf_counter()
            stacked_round([sims[k] for k in group], r, graphed)
            share = (time.perf_counter() - t0) / len(group)
            for k in group:
                sims[k].close_round(r, opened[k][0], share, ends[k])
                at[k] += 1
                if opened[k][0].diverged_round is not None:  # a diverged run leaves the group (Simulation.run)
                    bar.update(ends[k] - at[k])
                    ends[k] = at[k]
            bar.update(len(group))
    return [sim.finish(result, start, end) for sim, (result, start, _), end in zip(sims, opened, ends)]
