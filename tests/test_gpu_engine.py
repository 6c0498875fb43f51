"""CUDA-graph replay of the engine's local steps (fl_server/engine/graphs.py): on a GPU the graphed rounds equal the
eager ones in float64; elsewhere the engine takes the eager path and the graph runner passes rounds through."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_server.algorithms import build_algorithm
from fl_server.data.federated import make_federated
from fl_server.engine import RunConfig, Simulation
from fl_server.engine.graphs import GraphedLocalSteps, vmapped_round
from fl_server.models import build_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU lease)")


def _sim(fed, method: str, model: str, device: str, graphs: bool, **hp) -> Simulation:  # type: ignore[no-untyped-def]
    alg = build_algorithm(method, build_model(model, (1, 28, 28), 10, seed=0), fed.num_train_clients, **hp)
    return Simulation(alg, fed, RunConfig(rounds=3, local_iterations=4, seed=0, mode="vmap", dtype="float64",
                                          device=device, progress=False, cuda_graphs=graphs))


@pytest.fixture(scope="module")
def small_fed(mnist_all):  # type: ignore[no-untyped-def]
    return make_federated(mnist_all.subset(np.arange(3000)), "pathological", 12, seed=0)


def test_graph_runner_passes_cpu_rounds_through(small_fed) -> None:  # type: ignore[no-untyped-def]
    """On CPU tensors the runner records nothing and returns exactly the eager round."""
    sim = _sim(small_fed, "FedTTA-Prox", "mlp", "cpu", graphs=True, mu=0.1)
    assert sim.graphed is None  # graphs are for vmapped runs on a GPU only
    alg, x, y = sim.algorithm, sim.x, sim.y
    ids = np.arange(small_fed.num_train_clients)
    states = alg.client_start(sim.server_state, ids)
    batches = torch.randint(0, len(x), (len(ids), 3, 8), generator=torch.Generator().manual_seed(0))
    runner = GraphedLocalSteps()
    steps = (alg.local_step,) * 3
    got = runner(steps, states, sim.server_state, x, y, batches, None)
    want = vmapped_round(steps, states, sim.server_state, x, y, batches, None)
    assert runner.captures == 0 and runner.replays == 0
    for key in ("params", "phi"):
        for name in want[key]:
            assert torch.equal(got[key][name], want[key][name])


@cuda
@pytest.mark.parametrize("method,model,hp", [("FedTTA-Prox", "mlp", {"mu": 0.1}), ("FedTTA", "convnet", {}),
                                             ("FedAvg", "convnet", {"lr": 0.1})])
def test_graphed_rounds_equal_eager_rounds_on_cuda(small_fed, method: str, model: str, hp: dict) -> None:  # type: ignore[no-untyped-def]
    """Three rounds (the first records the graph, the next two replay it) equal the eager engine's in float64."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    eager, graphed = (_sim(small_fed, method, model, "cuda", g, **hp) for g in (False, True))
    assert eager.graphed is None and graphed.graphed is not None
    for r in range(3):
        eager.run_round(r)
        graphed.run_round(r)
    assert (graphed.graphed.captures, graphed.graphed.replays) == (1, 2)
    for key in ("params", "phi"):
        for name, want in eager.server_state.get(key, {}).items():
            assert float((graphed.server_state[key][name] - want).abs().max()) <= 1e-10, (key, name)


@cuda
def test_methods_with_round_dependent_steps_are_not_graphed(small_fed) -> None:  # type: ignore[no-untyped-def]
    """MAP's step reads its phase from Python state: it is never recorded."""
    sim = _sim(small_fed, "MAP", "mlp", "cuda", graphs=True)
    assert sim.graphed is None
