"""Adding a method end to end touches one file when its device step is one the device already runs: this module
is that file. It defines a new method (FedProx's training, TENT's entropy step at test time), registers it, trains
it for a round on real MNIST through a recipe, exports the run's bundle and personalises it with the torch-free
device SDK; nothing else in the repository knows the method."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from fl_server.algorithms.base import ALGORITHMS, register
from fl_server.algorithms.fedprox import FedProx, FedProxConfig
from fl_server.algorithms.tent import Tent


@dataclass
class ProxTentConfig(FedProxConfig):
    tent_lr: float | None = None  # None: the training rate
    steps: int = 1
    batch_size: int | None = None  # None: full batch
    adapt: str = "all"


class FedProxTent(FedProx):
    """FedProx's proximal local steps; a new client takes TENT's entropy step(s) on its unlabeled data, so the
    device runs the ``tent_step`` graph it already knows."""

    name = "FedProx+TENT"
    Config = ProxTentConfig
    adapts_at_test_time = True
    device_step = "tent_step"
    _affine: list[str] = []  # adapt="all": every parameter
    entropy_step = Tent.entropy_step
    personalize = Tent.personalize


@pytest.fixture
def registered() -> Iterator[type[FedProxTent]]:
    assert FedProxTent.name not in ALGORITHMS
    register(FedProxTent)
    try:
        yield FedProxTent
    finally:
        ALGORITHMS.pop(FedProxTent.name)


def test_a_method_defined_in_one_module_trains_exports_and_personalises_on_the_device(
        registered: type[FedProxTent], data_root: Path, tmp_path: Path) -> None:
    from edge_sdk import open_bundle
    from fl_server.export.run import export_run
    from fl_server.recipes import DataSpec, Federation, Recipe, federate, train
    from fl_server.recipes.run import rebuild
    from fl_server.rundir import load_best, read_run

    recipe = Recipe(model="mlp", data=DataSpec.builtin("mnist", str(data_root)), method="fedprox+tent",
                    federation=Federation(partition="pathological", num_clients=6, max_samples=1500),
                    hyper={"lr": 0.1, "mu": 0.01, "steps": 2}, rounds=1, local_iterations=5)
    assert recipe.method == "FedProx+TENT"
    record = train(recipe, tmp_path / "run", device="cpu", progress=False, data_root=str(data_root))
    assert record["method"] == "FedProx+TENT" and record["val"] > 10  # trained (10 classes)

    bundle = export_run(tmp_path / "run", tmp_path / "bundle", data_root=str(data_root), recipe=recipe)
    device = open_bundle(bundle, safeguard=False)  # the adaptation itself, held to the server's below
    assert device.bundle.method == "FedProx+TENT" and device.bundle.hyperparameters["steps"] == 2
    assert {"forward", "tent_step", "params"} <= {a["name"] for a in device.bundle.manifest["artifacts"]}

    fed = federate(recipe, 0, str(data_root))
    x = fed.dataset.x[fed.new[0]]
    before = device.predict(x)
    adaptation = device.personalize(x)
    assert adaptation.steps == 2
    after = device.predict(x)
    assert not np.allclose(before, after)  # the entropy steps moved the weights

    # the device's personalised model is the server's: the method's own personalize on the same data
    _, _, algorithm = rebuild(read_run(tmp_path / "run"), str(data_root), recipe=recipe)
    state = {k: {n: v.float() for n, v in d.items()} for k, d in load_best(tmp_path / "run").items()}
    xt = torch.from_numpy(x).float()
    server = algorithm.predict(algorithm.personalize(state, xt), xt).detach().numpy()
    np.testing.assert_allclose(after, server, atol=1e-4)


def test_two_methods_of_one_name_are_refused() -> None:
    from fl_server.algorithms.fedavg import FedAvg

    class Clash(FedAvg):
        name = "FedAvg"

    with pytest.raises(ValueError, match=r"two methods are named 'FedAvg': fl_server\.algorithms\.fedavg\.FedAvg and "):
        register(Clash)
    assert ALGORITHMS["FedAvg"] is FedAvg


def test_a_step_of_a_new_kind_is_traced_by_its_registered_graph_builder(tmp_path: Path) -> None:
    """A method whose device step is a new kind exports it through the builder registered for that kind (no
    exporter change); the graph is real ONNX that onnxruntime runs. A kind without a builder is refused in one
    line that names the decorator; a kind cannot be taken twice."""
    import onnxruntime as ort

    from fl_server.export.bundle import export_specs
    from fl_server.export.steps import STEP_GRAPHS, StepSpec, device_specs, register_step_graph
    from fl_server.algorithms.fedavg import FedAvg
    from fl_server.models import build_model

    class Sharpen(FedAvg):  # a made-up device step: the logits at temperature 1/2
        name = "Sharpen"
        device_step = "sharpen"

    algorithm = Sharpen(build_model("mlp", (1, 8, 8), 4, seed=0))
    params = {n: p.detach() for n, p in algorithm.model.named_parameters()}
    with pytest.raises(ValueError, match=r"Sharpen's device step 'sharpen' has no graph builder: register one "
                                         r"with @fl_server\.export\.steps\.register_step_graph\('sharpen'\)"):
        device_specs(algorithm, {"params": params})

    @register_step_graph("sharpen")
    def sharpen(method: Sharpen, state: dict) -> StepSpec:
        names = list(state["params"])

        def fn(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (2 * method.forward(dict(zip(names, weights)), x),)

        return StepSpec(fn, [torch.zeros(4, 1, 8, 8), *state["params"].values()],
                        ["x", *(f"psi.{n}" for n in names)], ["logits"])

    try:
        with pytest.raises(ValueError, match="device step 'sharpen' already has a graph builder"):
            register_step_graph("sharpen")(lambda method, state: sharpen(method, state))
        specs = device_specs(algorithm, {"params": params})
        assert sorted(specs) == ["forward", "sharpen"]
        graph = export_specs({"sharpen": specs["sharpen"]}, tmp_path)["sharpen"]
    finally:
        STEP_GRAPHS.pop("sharpen")
    session = ort.InferenceSession(str(graph))
    x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
    out = session.run(["logits"], {"x": x, **{f"psi.{n}": v.numpy() for n, v in params.items()}})[0]
    np.testing.assert_allclose(out, 2 * algorithm.forward(params, torch.from_numpy(x)).detach().numpy(), atol=1e-5)
