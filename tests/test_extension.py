"""A method from outside the package, with a device step of a kind nobody else knows, in three files of its author:
its class (with its recipe), its step's graph builder (``@fl_server.export.steps.register_step_graph``) and its device runner
(``@edge_sdk.register_runner``). It trains on real Fashion-MNIST, is exported from its run directory, published
to a running coordinator that imports the first two files (``FL_SERVE_PLUGINS``) and personalised by a device
process in which torch cannot be imported; the device's new-client accuracy is the one training reported. No file
of the repository changes or names the method. And no registered method's name is written in the coordinator's
service code or the SDK's dispatch (a source scan)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

import edge_sdk
from coordinator_proc import ADMIN, REPO, start
from fl_server.algorithms import ALGORITHMS

pytestmark = pytest.mark.timeout(300)
METHOD, KIND = "BiasTENT", "bias_entropy"

# (a) the method: FedAvg training; a new client takes entropy steps on its last layer's bias only
METHOD_FILE = '''
import torch

from fl_server.algorithms.base import register
from fl_server.algorithms.losses import entropy_from_logits
from fl_server.algorithms.tent import Tent
from fl_server.recipes import DataSpec, Federation, Recipe


@register
class BiasTent(Tent):
    """TENT whose entropy steps move only the head's bias (a cheap adaptation for a small device)."""

    name = "BiasTENT"
    device_step = "bias_entropy"

    def entropy_step(self, params, x):
        lr = self.hp.tent_lr if self.hp.tent_lr is not None else self.hp.lr
        entropy = lambda bias: entropy_from_logits(self.forward({**params, "head.bias": bias}, x)).mean()
        return {**params, "head.bias": params["head.bias"] - lr * torch.func.grad(entropy)(params["head.bias"])}


recipe = Recipe(model="mlp", data=DataSpec.builtin("fashion_mnist"), method="BiasTENT",
                federation=Federation(partition="dirichlet", alpha=1.0, num_clients=8, new_fraction=0.375,
                                      max_samples=1600),
                rounds=4, local_iterations=20, batch_size=32, hyper={"tent_lr": 1.0, "steps": 3})
'''

# (b) its device step's graph: (x, psi) -> (new head bias, logits, entropy), traced from the method's own step
GRAPH_FILE = '''
import torch

from fl_server.export.steps import StepSpec, register_step_graph
from fl_server.algorithms.losses import entropy_from_logits


@register_step_graph("bias_entropy")
def bias_entropy_graph(algorithm, state):
    params = state["params"]
    names = list(params)

    def fn(x, *weights):
        new = algorithm.entropy_step(dict(zip(names, weights)), x)
        logits = algorithm.forward(new, x)
        return new["head.bias"], logits, entropy_from_logits(logits).mean()

    x = torch.rand(4, *algorithm.model.input_shape)
    return StepSpec(fn, [x, *params.values()], ["x", *(f"psi.{n}" for n in names)],
                    ["new.head.bias", "logits", "entropy"])
'''

# (c) its device runner: numpy and onnxruntime only; the SDK's ModelRunner brings the forward graph and its weights
RUNNER_FILE = '''
import edge_sdk


@edge_sdk.register_runner("bias_entropy")
class BiasEntropyRunner(edge_sdk.ModelRunner):
    def __init__(self, bundle, **options):
        super().__init__(bundle, **options)
        self.step_graph = bundle.session("bias_entropy", self.threads)

    def adapt(self, x, **options):
        weights, steps = dict(self.base), int(self.hp.get("steps", 1))
        for _ in range(steps):
            feeds = {"x": x, **{f"psi.{n}": v for n, v in weights.items()}}
            inputs = {i.name: feeds[i.name] for i in self.step_graph.get_inputs()}
            weights["head.bias"] = self.step_graph.run(["new.head.bias"], inputs)[0]
        return weights, steps, {}
'''

# the device: torch cannot be imported; it joins, downloads the signed bundle and personalises each new client
DEVICE = '''
import json, sys
sys.modules["torch"] = None  # any import of torch now fails
import numpy as np
import edge_sdk
import bias_entropy_runner  # the plugin's runner (registers the "bias_entropy" kind)

url, key, data, cache = sys.argv[1:5]
with edge_sdk.EdgeClient(url, cache_dir=cache, public_key=key) as client:
    info = client.join("BiasTENT")
    bundle = client.download(info.manifest, method="BiasTENT")
device = edge_sdk.open_bundle(bundle)
received = edge_sdk.open_bundle(bundle, method="none")  # the model as trained, not adapted
arrays = np.load(data)
accs, moved = [], 0
for k in range(int(arrays["clients"])):
    x, y = arrays[f"x{k}"], arrays[f"y{k}"]
    adaptation = device.personalize(x)
    after = device.predict(x)
    moved += int(not np.allclose(received.predict(x), after))
    accs.append(float((after.argmax(1) == y).mean()))
print(json.dumps({"accuracy": 100 * float(np.mean(accs)), "clients": len(accs), "moved": moved,
                  "steps": adaptation.steps,
                  "runner": type(device.runner).__name__,
                  "server_modules": sorted(m for m, v in sys.modules.items()
                                           if v is not None and m.split(".")[0] in ("torch", "fl_server"))}))
'''


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[Path]:
    """The author's three files, outside the repository; what they register here is dropped afterwards (the
    runner registers only in the device process)."""
    from fl_server.export.steps import STEP_GRAPHS

    root = tmp_path / "plugin"
    root.mkdir()
    for name, text in (("bias_tent.py", METHOD_FILE), ("bias_entropy_graph.py", GRAPH_FILE),
                       ("bias_entropy_runner.py", RUNNER_FILE)):
        (root / name).write_text(textwrap.dedent(text).lstrip())
    try:
        yield root
    finally:
        ALGORITHMS.pop(METHOD, None)
        STEP_GRAPHS.pop(KIND, None)



def _new_clients(recipe, data_root: Path, out: Path) -> None:  # type: ignore[no-untyped-def]
    """The run's new clients (x preprocessed as the recipe does, y) for the device process."""
    from fl_server.recipes import federate

    fed = federate(recipe, 0, str(data_root))
    arrays = {f"{v}{k}": getattr(fed.dataset, v)[idx] for k, idx in enumerate(fed.new) for v in ("x", "y")}
    np.savez(out, clients=len(fed.new), **arrays)


def test_a_method_of_a_new_device_step_from_three_outside_files(plugin: Path, data_root: Path,
                                                                 tmp_path: Path) -> None:
    from fl_server.export.run import export_run
    from fl_server.recipes import train
    from fl_server.recipes.loader import import_plugin, load_recipe
    from fl_server.service.publish import PublishError, check_contract, upload

    # the author trains and exports: their recipe file registers the method, their graph file the step's builder
    recipe = load_recipe(f"{plugin / 'bias_tent.py'}:recipe")
    import_plugin(str(plugin / "bias_entropy_graph.py"))
    assert ALGORITHMS[METHOD].servable and not ALGORITHMS[METHOD].default_job  # TENT's default is not inherited
    record = train(recipe, tmp_path / "run", device="cpu", progress=False, data_root=str(data_root))
    bundle = export_run(tmp_path / "run", tmp_path / "bundle", data_root=str(data_root))  # rebuilt from run.json
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["method"] == METHOD and manifest["device_step"] == KIND
    assert {"forward", KIND, "params"} <= {a["name"] for a in manifest["artifacts"]}
    _new_clients(recipe, data_root, tmp_path / "device.npz")

    # a coordinator whose operator names the method's files publishes the bundle and serves it signed
    coord = start(tmp_path / "store", methods="", workers=1,
                  env={"FL_SERVE_PLUGINS": f"{plugin / 'bias_tent.py'},{plugin / 'bias_entropy_graph.py'}"})
    try:
        published = upload(bundle, coord.url, ADMIN)
        assert published["method"] == METHOD
        key = httpx.get(f"{coord.url}/v1/signing-key", timeout=10).json()["public_key"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "edge_sdk"), str(plugin)])}
        run = subprocess.run([sys.executable, "-c", DEVICE, coord.url, key, str(tmp_path / "device.npz"),
                              str(tmp_path / "cache")], env=env, capture_output=True, text=True, timeout=120)
    finally:
        coord.stop()
    assert run.returncode == 0, run.stderr[-3000:]
    device = json.loads(run.stdout.strip().splitlines()[-1])
    assert device["runner"] == "BiasEntropyRunner" and device["steps"] == 3 and device["server_modules"] == []
    assert device["moved"] == device["clients"] > 1  # the bias steps changed every new client's predictions
    assert abs(device["accuracy"] - record["test"]) <= 0.1, (device, record["test"])

    # the three files are the whole method: nothing in the repository names it or its step kind
    assert sorted(p.name for p in plugin.glob("*.py")) == ["bias_entropy_graph.py", "bias_entropy_runner.py",
                                                           "bias_tent.py"]
    here = Path(__file__).resolve()
    mentions = [p for d in ("fl_server", "edge_sdk", "tests") for p in (REPO / d).rglob("*.py")
                if p.resolve() != here and (METHOD in (text := p.read_text(errors="replace")) or KIND in text)]
    assert not mentions, mentions
    # a coordinator without the plugin refuses the bundle and says where the method is registered
    ALGORITHMS.pop(METHOD)
    with pytest.raises(PublishError, match="names the file that registers it in FL_SERVE_PLUGINS"):
        check_contract(METHOD, manifest, [a["name"] for a in manifest["artifacts"]])


def test_a_plugin_that_cannot_be_imported_stops_the_coordinator_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fl_server.service.config import load_plugins

    monkeypatch.setenv("FL_SERVE_PLUGINS", str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match=r"^FL_SERVE_PLUGINS: .*missing\.py: no such Python file$"):
        load_plugins()
    monkeypatch.setenv("FL_SERVE_PLUGINS", "not a module")
    with pytest.raises(ValueError, match="a plugin is a file path ending in .py or a module name"):
        load_plugins()


def _string_literals(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_method_name_is_written_in_the_service_or_the_sdk_dispatch() -> None:
    """The coordinator and the SDK's runner choice derive every method's part from the registry and the
    manifest's device step: a method's name as a string literal there would be a second place that lists it."""
    dispatch = [REPO / "edge_sdk" / "edge_sdk" / name for name in ("_device.py", "_registry.py")]
    assert all(p.is_file() for p in dispatch), "the SDK's dispatch moved: name its files here"
    files = [*sorted((REPO / "fl_server" / "service").glob("*.py")), *dispatch]
    found = [f"{p.relative_to(REPO)}:{line}: {value!r}" for p in files for line, value in _string_literals(p)
             if value in ALGORITHMS]
    assert not found, "method names written in the service or the SDK's dispatch:\n" + "\n".join(found)
