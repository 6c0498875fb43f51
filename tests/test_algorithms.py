"""Baselines on real data: accuracy floors on a fixed seed and the behaviour each method promises."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_server.algorithms import ALGORITHMS, NotApplicable, build_algorithm
from fl_server.algorithms.losses import entropy_from_logits
from fl_server.data import load_dataset
from fl_server.data.federated import make_federated
from fl_server.engine import RunConfig, Simulation
from fl_server.models import build_model


def _run(fed, method: str, rounds: int, **hp):  # type: ignore[no-untyped-def]
    model = build_model("mlp", fed.dataset.x.shape[1:], 10, seed=0)
    alg = build_algorithm(method, model, fed.num_train_clients, **({"lr": 0.1} | hp))
    sim = Simulation(alg, fed, RunConfig(rounds=rounds, local_iterations=20, batch_size=64, seed=0,
                                         device="cpu", progress=False))
    return sim, sim.run()


@pytest.fixture(scope="module")
def mnist_fed(mnist_all):  # type: ignore[no-untyped-def]
    sub = mnist_all.subset(np.random.default_rng(1).choice(len(mnist_all), 14_000, replace=False))
    return make_federated(sub, "pathological", 40, seed=0)


def test_fedavg_learns_mnist(mnist_fed) -> None:
    _, res = _run(mnist_fed, "FedAvg", rounds=15)
    assert res.best_val > 0.78 and res.test_at_best > 0.60


def test_tent_lowers_entropy_and_helps_pathological_new_clients(mnist_fed) -> None:
    sim, res = _run(mnist_fed, "TENT", rounds=15)
    fedavg_acc = np.mean([sim.accuracy(sim.server_state["params"], idx) for idx in mnist_fed.new])
    assert res.last["test"] > fedavg_acc  # adaptation on 2-class clients beats the global model
    x = sim.x[torch.from_numpy(mnist_fed.new[0])]
    adapted = sim.algorithm.personalize(sim.server_state, x)
    with torch.no_grad():
        h0 = entropy_from_logits(sim.algorithm.predict(sim.server_state["params"], x)).mean()
        h1 = entropy_from_logits(sim.algorithm.predict(adapted, x)).mean()
    assert h1 < h0


def test_tent_norm_affine_moves_only_the_normalisation_scale_and_shift(mnist_fed) -> None:
    """The original TENT's parameters on a batch-normalised model: every other weight stays bit-identical and
    the entropy of the client's predictions (test-batch statistics) falls."""
    model = build_model("btfl_cnn_bn", (1, 28, 28), 10, seed=0)
    tent = build_algorithm("TENT", model, 1, seed=0, adapt="norm_affine", tent_lr=0.5, batch_size=64)
    params = tent.init_state(torch.float32, torch.device("cpu"))["params"]
    x = torch.from_numpy(mnist_fed.dataset.x[mnist_fed.new[0][:256]]).float()
    adapted = tent.personalize({"params": params}, x)
    affine = {f"{name}.{p}" for name, m in model.named_modules() if type(m).__name__ == "StatBatchNorm2d"
              for p in ("weight", "bias")}
    assert affine and {n for n in params if not torch.equal(params[n], adapted[n])} == affine
    with torch.no_grad():
        before, after = (entropy_from_logits(tent.predict(p, x)).mean() for p in (params, adapted))
    assert after < before
    with pytest.raises(ValueError, match=r"^TENT adapt='norm_affine' needs a model with affine normalisation layers"):
        build_algorithm("TENT", build_model("mlp", (1, 28, 28), 10), 1, adapt="norm_affine")
    with pytest.raises(ValueError, match=r"^TENT adapt must be one of all, norm_affine, got 'bn'$"):
        build_algorithm("TENT", build_model("mlp", (1, 28, 28), 10), 1, adapt="bn")


def test_fedprox_large_mu_stays_near_server(mnist_fed) -> None:
    a, _ = _run(mnist_fed, "FedAvg", rounds=1)
    p, _ = _run(mnist_fed, "FedProx", rounds=1, mu=100.0, lr=0.005)
    init = build_model("mlp", (1, 28, 28), 10, seed=0).state_dict()
    moved = lambda s: sum(float((s.server_state["params"][k] - init[k]).norm()) for k in init)  # noqa: E731
    assert moved(p) < 0.2 * moved(a)


def test_finetune_and_local_personalise_training_clients() -> None:
    fed = make_federated(load_dataset("digits"), "pathological", 20, seed=0)
    _, avg = _run(fed, "FedAvg", rounds=10)
    _, ft = _run(fed, "FedAvg+FT", rounds=10)
    _, loc = _run(fed, "Local", rounds=10)
    assert ft.best_val > avg.best_val and loc.best_val > avg.best_val  # 2-class clients: personal wins
    assert loc.test_at_best is None  # a new client has no Local model


def test_local_personalize_is_not_applicable() -> None:
    alg = build_algorithm("Local", build_model("mlp", (1, 8, 8), 10), 3)
    with pytest.raises(NotApplicable):
        alg.personalize(alg.init_state(torch.float32, torch.device("cpu")), torch.zeros(2, 1, 8, 8))


def test_registry_and_errors() -> None:
    assert {"FedAvg", "FedProx", "FedAvg+FT", "Local", "TENT"} <= set(ALGORITHMS)
    with pytest.raises(ValueError, match="unknown method 'Nope'"):
        build_algorithm("Nope", build_model("mlp", (1, 8, 8), 10), 3)


@pytest.mark.parametrize("method", ["FedAvg", "ODPFL-HN"])
def test_local_momentum_is_torch_sgd(mnist_fed, method: str) -> None:
    """``local_momentum`` (the ODPFL-HN paper's mu_local) makes a client's local steps torch.optim.SGD with
    momentum and weight decay, the buffer starting at zero in every round; 0 keeps plain SGD."""
    model = build_model("mlp", mnist_fed.dataset.x.shape[1:], 10, seed=0).double()
    lr = {"FedAvg": {"lr": 0.05}, "ODPFL-HN": {"local_lr": 0.05}}[method]
    alg = build_algorithm(method, model, mnist_fed.num_train_clients, local_momentum=0.9, weight_decay=1e-3, **lr)
    idx = torch.from_numpy(mnist_fed.train[0][:64 * 3])
    x, y = torch.from_numpy(mnist_fed.dataset.x)[idx].double(), torch.from_numpy(mnist_fed.dataset.y)[idx]
    if method == "ODPFL-HN":
        alg.attach(torch.from_numpy(mnist_fed.dataset.x).double(), torch.from_numpy(mnist_fed.dataset.y),
                   mnist_fed.train)
    server = alg.init_state(torch.float64, torch.device("cpu"))
    state = {k: ({n: t[0] for n, t in v.items()} if isinstance(v, dict) else v)
             for k, v in alg.client_start(server, np.array([0])).items()}  # unstack the single client
    reference = build_model("mlp", mnist_fed.dataset.x.shape[1:], 10, seed=0).double()
    reference.load_state_dict({n: t.clone() for n, t in state["params"].items()})
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for s in range(0, len(idx), 64):
        state = alg.local_step(state, server, x[s:s + 64], y[s:s + 64])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x[s:s + 64]), y[s:s + 64]).backward()
        opt.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state["params"][name], p.detach(), rtol=0, atol=1e-12)
