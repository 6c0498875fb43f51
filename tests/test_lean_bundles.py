"""Lean, private bundles (issue #46): real runs of recipes from a recipe file, exported with the working directory
in a temporary folder, name no path of the exporting machine in any byte of any file (the manifest names its
recipe ``FILE.py:NAME``; the graphs carry none of the ONNX exporter's debug records), the graphs of a
batch-normalised model are several times smaller without those records and compute exactly the same, and
``fl-server device-data`` still finds the recipe a bundle names."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
import pytest
import torch

from edge_sdk import open_bundle
from fl_server.export import graphs
from fl_server.export.bundle import portable
from fl_server.cli import main
from test_recipes import RECIPE_FILE  # TinyNet, an MLP

ROOT = Path(__file__).resolve().parents[1]
RECIPES = RECIPE_FILE + '''

class BNNet(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        c, h, w = input_shape
        self.body = nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(4),
                                  nn.Flatten(), nn.Linear(8 * (h // 4) * (w // 4), 32), nn.ReLU())
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.fc(self.body(x))


FED = Federation(partition="iid", num_clients=6, new_fraction=0.34, max_samples=600)
MNIST, MLP = DataSpec.builtin("mnist"), ModelSpec(TinyNet, head="classifier")
bn = Recipe(model=ModelSpec(BNNet), data=MNIST, federation=FED, method="TENT",
            hyper={"adapt": "norm_affine", "tent_lr": 0.1}, rounds=1, local_iterations=3, batch_size=32)
mlp = Recipe(model=MLP, data=MNIST, federation=FED, method="FedTTA", rounds=1, local_iterations=3, batch_size=32)
btfl = Recipe(model=MLP, data=MNIST, federation=FED, method="BTFL", rounds=1, local_iterations=6, batch_size=32)
'''


@pytest.fixture(scope="module")
def bundles(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Bundles of the three recipes (the MLP's with its int8 graph), exported from a working directory in a temporary
    folder; ``bn_kept``: the BN run exported again with the exporter's debug records kept."""
    from fl_server.export.run import export_run
    from fl_server.recipes import load_recipe, train

    work = tmp_path_factory.mktemp("exporter")
    (work / "recipes").mkdir()
    (work / "recipes" / "my_recipes.py").write_text(RECIPES)
    out: dict[str, Path] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        for name in ("bn", "mlp", "btfl"):
            recipe = load_recipe(f"{work / 'recipes' / 'my_recipes.py'}:{name}")  # run.json names the absolute path
            train(recipe, work / f"run-{name}", device="cpu", progress=False, data_root=str(data_root))
            out[name] = export_run(work / f"run-{name}", work / name, int8=name == "mlp", data_root=str(data_root))
        mp.setattr(graphs, "_KEEP_DEBUG", True)
        out["bn_kept"] = export_run(work / "run-bn", work / "bn_kept", data_root=str(data_root))
    yield out


def machine_paths(work: Path, data_root: Path) -> set[str]:
    """Folders of the exporting machine a bundle must not name (the file-system root aside)."""
    paths = {work, Path.home(), ROOT, Path(tempfile.gettempdir()), data_root, Path(sys.prefix),
             Path(torch.__file__).parent}
    return {s for p in paths for s in (str(p), str(p.resolve())) if Path(s).parent != Path(s)}


def found(bundle: Path, paths: set[str]) -> list[str]:
    return [f"{f.name}: {p}" for f in sorted(bundle.iterdir()) for p in paths if p.encode() in f.read_bytes()]


def test_bundles_name_no_path_of_the_exporting_machine(bundles: dict[str, Path], data_root: Path) -> None:
    paths = machine_paths(bundles["bn"].parent, data_root)
    for name in ("bn", "mlp", "btfl"):
        bundle = open_bundle(bundles[name]).bundle
        assert bundle.manifest["recipe"] == f"my_recipes.py:{name}"
        assert not found(bundles[name], paths), found(bundles[name], paths)
        for a in bundle.manifest["artifacts"]:
            if a["kind"] == "onnx":  # nothing left to strip: no doc strings, no metadata anywhere in the graph
                model = onnx.load(str(bundles[name] / a["file"]), load_external_data=False)  # (frozen weights)
                assert not graphs.strip_debug(model), (name, a["file"])
    kinds = {n: {a["name"] for a in open_bundle(bundles[n]).bundle.manifest["artifacts"]} for n in bundles}
    assert {"forward", "tent_step", "stats"} <= kinds["bn"] and {"forward_int8", "fedtta_step"} <= kinds["mlp"]
    assert {"features", "btfl"} <= kinds["btfl"]
    # the check can fail: with the records kept, the graphs name this machine's torch (its stack traces)
    assert any(".onnx" in hit for hit in found(bundles["bn_kept"], paths))
    # any other manifest string holding an absolute path (a data root, say) is cut to its last part too
    assert portable({"data": ["/home/alice/images", r"C:\Users\alice\data.py:x", "mnist"], "n": 1}) == {
        "data": ["images", "data.py:x", "mnist"], "n": 1}


def test_lean_graphs_are_smaller_and_compute_the_same(bundles: dict[str, Path], data_root: Path) -> None:
    from fl_server.data import load_dataset

    lean, kept = bundles["bn"], bundles["bn_kept"]
    sizes = {f.name: (f.stat().st_size, (kept / f.name).stat().st_size) for f in lean.glob("*.onnx")}
    assert set(sizes) == {"forward.onnx", "tent_step.onnx"}
    assert all(k >= 2.5 * s for s, k in sizes.values()), sizes
    x = load_dataset("mnist", root=data_root, split="test").x[:96]
    a, b = open_bundle(lean), open_bundle(kept)
    assert np.array_equal(a.predict(x), b.predict(x))
    a.personalize(x)
    b.personalize(x)  # TENT's device steps on both graphs
    assert np.array_equal(a.predict(x), b.predict(x))
    assert not np.array_equal(a.predict(x), open_bundle(lean).predict(x))  # the steps moved the weights


def test_device_data_finds_the_recipe_a_bundle_names(bundles: dict[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    bundle, work = bundles["bn"], bundles["bn"].parent
    args = ["device-data", str(bundle), "--kind", "clients"]
    monkeypatch.chdir(work)  # my_recipes.py is in recipes/, not here
    assert main([*args, "--out", str(tmp_path / "a.npz")]) == 2
    assert capsys.readouterr().err == ("error: the bundle's recipe my_recipes.py:bn is not found (a bundle names it "
                                       "FILE.py:NAME, relative to the working directory): run from the folder that "
                                       "holds it or pass --recipe PATH/FILE.py:NAME\n")
    assert main([*args, "--out", str(tmp_path / "a.npz"), "--recipe", "recipes/my_recipes.py:bn"]) == 0
    monkeypatch.chdir(work / "recipes")
    assert main([*args, "--out", str(tmp_path / "b.npz")]) == 0
    with np.load(tmp_path / "a.npz") as first, np.load(tmp_path / "b.npz") as second:
        assert len(first["x"]) > 0 and np.array_equal(first["x"], second["x"])
