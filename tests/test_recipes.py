"""The public recipe API: the same samples from arrays, an image folder and a torch Dataset train identically; bad
recipes fail when built, with one line saying what is wrong and how to fix it; a user's nn.Module trains and
exports through the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from edge_sdk._preprocess import Preprocess, RawInput
from fl_server import rundir
from fl_server.recipes import DataSpec, Federation, ModelSpec, Recipe, RecipeError, train

REPO = Path(__file__).resolve().parents[1]


class SmallNet(nn.Module):
    """A user's CNN (GroupNorm: the engine's state is parameters only) with its linear head at ``fc``."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(input_shape[0], 8, 3, stride=2), nn.GroupNorm(2, 8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(288, 32), nn.ReLU())
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


@pytest.fixture(scope="module")
def fashion_raw(fashion_all):  # type: ignore[no-untyped-def]
    """240 real Fashion-MNIST samples as raw uint8 NHWC images, ordered by class (an image folder's order)."""
    idx = np.random.default_rng(0).choice(len(fashion_all), 240, replace=False)
    idx = idx[np.argsort(fashion_all.y[idx], kind="stable")]
    x = np.round(fashion_all.x[idx] * 255).astype(np.uint8).transpose(0, 2, 3, 1)
    return x, fashion_all.y[idx]


def _recipe(data: DataSpec) -> Recipe:
    return Recipe(model=ModelSpec(SmallNet, head="fc"), data=data, method="FedTTA",
                  federation=Federation(partition="iid", num_clients=6, new_fraction=0.34), rounds=1,
                  local_iterations=3, batch_size=16, hyper={"inner_lr": 0.05, "lr": 0.1, "adapt_lr": 0.001})


def _write_folder(root: Path, x: np.ndarray, y: np.ndarray) -> Path:
    from PIL import Image

    for i, (img, label) in enumerate(zip(x, y)):
        (root / f"{label:02d}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(img[:, :, 0], mode="L").save(root / f"{label:02d}" / f"{i:05d}.png")
    return root


class TorchImages(torch.utils.data.Dataset):
    """torchvision-style: CHW uint8 tensors and int labels."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.x[i].transpose(2, 0, 1).copy()), int(self.y[i])


def test_arrays_image_folder_and_torch_dataset_train_identically(fashion_raw, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x, y = fashion_raw
    sources = {"arrays": DataSpec.from_arrays(x, y, layout="NHWC"),
               "folder": DataSpec.from_image_folder(_write_folder(tmp_path / "images", x, y)),
               "torch": DataSpec.from_torch(TorchImages(x, y))}
    assert sources["torch"].layout == "NCHW" and sources["folder"].classes == tuple(f"{k:02d}" for k in range(10))
    weights = {}
    for name, data in sources.items():
        record = train(_recipe(data), tmp_path / name, seed=0, device="cpu", progress=False)
        assert record["method"] == "FedTTA" and record["val"] > 0
        weights[name] = rundir.load_best(tmp_path / name)
    assert set(weights["arrays"]) == {"params", "phi"}  # FedTTA's adaptation model g came with the user's model
    for name in ("folder", "torch"):
        for part in weights["arrays"]:
            for key, value in weights["arrays"][part].items():
                assert torch.equal(value, weights[name][part][key]), (name, part, key)
    run = json.loads((tmp_path / "torch" / "run.json").read_text())
    assert run["preprocess"] == {"layout": "NCHW", "size": None, "scale": 1 / 255, "mean": [0.0], "std": [1.0],
                                 "raw": {"dtype": "uint8", "range": [0.0, 255.0], "shape": [1, 28, 28]}}

    # a recipe built in Python: its run.json names no file, so export takes the recipe itself
    from edge_sdk._bundle import load_bundle
    from fl_server.export.run import export_run

    with pytest.raises(RecipeError, match=r"^the run of 'arrays' names no recipe file \(its recipe was built in "
                                          r"Python\): pass the recipe"):
        export_run(tmp_path / "arrays", tmp_path / "nope")
    recipe = _recipe(sources["arrays"])
    bundle = load_bundle(export_run(tmp_path / "arrays", tmp_path / "bundle", recipe=recipe))
    # the device: raw uint8 NHWC images through the manifest's preprocessing, then the ONNX forward; the server:
    # torch on its own preprocessed data. Same predictions.
    session, params = bundle.session("forward"), bundle.weights("params")
    feeds = {i.name: params[i.name.split(".", 1)[1]] for i in session.get_inputs() if i.name != "x"}
    device_logits = session.run(None, {**feeds, "x": bundle.preprocess.apply(x)})[0]
    model = recipe.build_model(0)
    model.load_state_dict({k: v.float() for k, v in weights["arrays"]["params"].items()})
    with torch.no_grad():
        server_logits = model(torch.from_numpy(recipe.data.dataset(recipe.preprocess).x)).numpy()
    device_acc, server_acc = (100 * float(np.mean(logits.argmax(1) == y)) for logits in (device_logits, server_logits))
    assert abs(device_acc - server_acc) < 0.1


def test_bundles_without_preprocessing_load_as_identity(tmp_path: Path) -> None:
    from edge_sdk._bundle import load_bundle
    from edge_sdk._errors import BundleError

    (tmp_path / "manifest.json").write_text(json.dumps({"method": "FedAvg", "device_step": None, "artifacts": []}))
    assert load_bundle(tmp_path).preprocess == Preprocess.identity()
    (tmp_path / "manifest.json").write_text(json.dumps({"method": "FedAvg", "artifacts": []}))
    with pytest.raises(BundleError, match=r"names no 'device_step' \(written before bundle format 3\): export it again"):
        load_bundle(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"method": "FedAvg", "device_step": None, "artifacts": [],
                                                        "preprocess": {"layout": "NHWC"}}))
    with pytest.raises(BundleError, match=r"malformed manifest \(preprocess keys must be layout, size, scale, mean, "
                                          r"std and optionally raw \(unknown: \[\], missing: \['mean', 'scale', 'size', 'std'\]\)\)"):
        load_bundle(tmp_path)


def _wrong_input_shape() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 30 * 30, 10))


class NotLinearHead(SmallNet):
    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__(input_shape, num_classes)
        self.fc = nn.Sequential(nn.Linear(32, num_classes), nn.Softmax(dim=1))  # type: ignore[assignment]


class SoftmaxAfterHead(SmallNet):
    """Returns probabilities: the engine would take them for logits and train another model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(self.body(x)), dim=1)


class LogSoftmaxAfterHead(SmallNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.fc(self.body(x)), dim=1)


class WideNet(SmallNet):
    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__(input_shape, num_classes)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 32), nn.ReLU())


class DropoutNet(SmallNet):
    """Dropout before the head: random in training mode, where the engine validates; off on the device."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__(input_shape, num_classes)
        self.body.append(nn.Dropout(0.5))


class FunctionalDropoutNet(SmallNet):
    """F.dropout in forward with its default training=True: random in either mode, invisible as a module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(nn.functional.dropout(self.body(x), 0.3))


class TrainingBranchNet(SmallNet):
    """A branch on self.training: the engine's (training-mode) numbers are not the exported eval-mode graph's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.body(x)
        return self.fc(features if self.training else 0.5 * features)


class BatchNorm1dNet(SmallNet):
    """BatchNorm1d on the flat features: running statistics in buffers, not converted (only BatchNorm2d is)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__(input_shape, num_classes)
        self.body.append(nn.BatchNorm1d(32))


def _bad(case: str, tmp_path: Path, x: np.ndarray, y: np.ndarray) -> None:  # noqa: C901 - one branch per case
    from PIL import Image

    x, y = x[::6], y[::6]  # 40 samples of every class
    data = DataSpec.from_arrays(x, y, layout="NHWC")
    if case == "wrong input shape":
        Recipe(model=ModelSpec(lambda shape, k: _wrong_input_shape(), head="2"), data=data)
    elif case == "head not linear":
        Recipe(model=ModelSpec(NotLinearHead, head="fc"), data=data)
    elif case == "softmax after the head":
        Recipe(model=ModelSpec(SoftmaxAfterHead, head="fc"), data=data)
    elif case == "log_softmax after the head (split by a callable)":
        Recipe(model=ModelSpec(LogSoftmaxAfterHead, head=lambda net: (net.body, net.fc)), data=data)
    elif case == "NaN in the data":
        bad = x.astype(np.float32) / 255
        bad[7, 3, 3, 0] = np.nan
        DataSpec.from_arrays(bad, y, layout="NHWC")
    elif case == "unknown method":
        Recipe(model=ModelSpec(SmallNet), data=data, method="FedMagic")
    elif case in ("unreadable image", "empty class folder"):
        root = _write_folder(tmp_path / "images", x[:4], np.array([0, 0, 1, 1]))
        if case == "unreadable image":
            (root / "01" / "00002.png").write_bytes(b"not a png")
        else:
            (root / "02").mkdir()
        DataSpec.from_image_folder(root)
    elif case == "dropout in the model":
        Recipe(model=ModelSpec(DropoutNet, head="fc"), data=data)
    elif case == "BatchNorm1d in the model":
        Recipe(model=ModelSpec(BatchNorm1dNet, head="fc"), data=data)
    elif case == "functional dropout in forward":
        Recipe(model=ModelSpec(FunctionalDropoutNet, head="fc"), data=data)
    elif case == "a branch on self.training":
        Recipe(model=ModelSpec(TrainingBranchNet, head="fc"), data=data)
    elif case == "16-bit image":
        root = _write_folder(tmp_path / "images", x[:4], np.array([0, 0, 1, 1]))
        Image.fromarray(x[2, :, :, 0].astype(np.uint16) * 257).save(root / "01" / "00002.png")
        DataSpec.from_image_folder(root)
    elif case == "NCHW arrays read as NHWC":
        DataSpec.from_arrays(x.transpose(0, 3, 1, 2), y)
    elif case == "method cannot serve the model":
        Recipe(model=ModelSpec(WideNet), data=data, method="ODPFL-HN")
    elif case == "feature vectors":
        DataSpec.from_arrays(x.reshape(len(x), -1)[:, :16].astype(np.float32), y)
    elif case == "pixels in [0, 1] scaled by 1/255":
        Recipe(model="mlp", data=DataSpec.from_arrays(x.astype(np.float32) / 255, y),
               preprocess=Preprocess(layout="NHWC", scale=1 / 255, mean=(0.5,), std=(0.5,)))
    elif case == "labels 1..K":
        DataSpec.from_arrays(x, y + 1)
    elif case == "too few local iterations for BTFL":
        Recipe(model=ModelSpec(SmallNet), data=data, method="BTFL", local_iterations=5)
    del Image


BAD = {
    "wrong input shape": "model: a batch of the data's shape [2, 1, 28, 28] fails in the model's forward (Given "
                         "groups=1, weight of size [8, 3, 3, 3], expected input[2, 1, 28, 28] to have 3 channels, but "
                         "got 1 channels instead); build the model for input_shape (the factory receives it) or "
                         "resize the images (Preprocess(size=(H, W)))",
    "head not linear": "model: the head (attribute 'fc') is Sequential, not torch.nn.Linear; the methods need a "
                       "linear head on the features: name the model's last nn.Linear (ModelSpec(head='fc')) or "
                       "split it with head=callable(model) -> (features, linear)",
    "softmax after the head": "model: SoftmaxAfterHead.forward does not return its head's output (it differs from "
                              "head(features(x)) on a random batch: a softmax, log_softmax or other function after "
                              "the head?); return the head's logits; the methods apply softmax themselves",
    "log_softmax after the head (split by a callable)": "model: LogSoftmaxAfterHead.forward does not return its head's "
                                                        "output (it differs from head(features(x)) on a random batch: "
                                                        "a softmax, log_softmax or other function after the head?); "
                                                        "return the head's logits; the methods apply softmax themselves",
    "NaN in the data": "data: 1 image(s) hold NaN or infinite values (first: sample 7); drop or repair them before "
                       "building the recipe",
    "unknown method": "method: unknown method 'FedMagic'; choose one of FedAvg, FedProx, FedAvg+FT, Local, TENT, "
                      "FedTTA, FedTTA-Prox, FedTTA++, ODPFL-HN, BTFL, FedICON, FedICON w/o TTA, MAP, FedRS, FedPHP",
    "unreadable image": "data: cannot read image {root}/01/00002.png (UnidentifiedImageError); replace or remove it",
    "empty class folder": "data: class folder {root}/02 holds no PNG/JPEG images; add images or remove the folder",
    "dropout in the model": "model: Dropout at features.body.8 draws random numbers in training mode, where the "
                            "engine validates and tests the model, and a device runs it in eval mode: the accuracy "
                            "training reports would not be the device's; remove it",
    "BatchNorm1d in the model": "model: BatchNorm1d at features.body.8 keeps buffer 'running_mean' (e.g. BatchNorm "
                                "running statistics), which the functional engine cannot carry; use nn.LayerNorm "
                                "for features of shape [N, C] (nn.BatchNorm2d is converted, BatchNorm1d/3d are not)",
    "functional dropout in forward": "model: the forward gives one batch other logits each time in training mode "
                                     "(it draws random numbers: F.dropout, added noise?), where the engine validates "
                                     "and tests the model, while a device runs it in eval mode: the accuracy training "
                                     "reports would not be the device's; make forward deterministic",
    "a branch on self.training": "model: the forward computes otherwise in training and in eval mode (a branch on "
                                 "self.training, F.dropout(training=self.training)?): the engine validates and tests "
                                 "the model in training mode, a device runs it in eval mode, so the accuracy training "
                                 "reports would not be the device's; compute the same in both modes",
    "16-bit image": "data: image {root}/01/00002.png has I;16 pixels (16-bit or float), which 8-bit images would "
                    "clip; convert the folder to 8-bit PNG/JPEG or load the pixels with DataSpec.from_arrays",
    "NCHW arrays read as NHWC": "data: images of shape [40, 1, 28, 28] read as NHWC would have 28 channels; they "
                                "look like [N, C, H, W]: pass layout='NCHW'",
    "method cannot serve the model": "method: ODPFL-HN cannot serve this model: its hypernetwork generates all "
                                     "3,346,794 weights, about 338,026,194 parameters at hn_width 100 (limit "
                                     "200,000,000); use a smaller model (e.g. 'lenet') or another method",
    "feature vectors": "data: the samples are vectors of shape [40, 16], and the models take images: pass them as "
                       "1x1 images with a channel per feature, x.reshape(N, 1, 1, D) (layout NHWC; Preprocess(mean=..., "
                       "std=...) then normalises each feature)",
    "pixels in [0, 1] scaled by 1/255": "preprocess: scale 0.00392157 on data already in [0, 1] would leave every "
                                        "value under 0.0039 (scaled twice); drop the scale (Preprocess(scale=1.0, "
                                        "...)) or pass the 0..255 pixels",
    "labels 1..K": "data: labels 0..10 leave 1 class(es) without a sample (0), so the model would learn 11 outputs; "
                   "relabel them 0..K-1 (np.unique(y, return_inverse=True)[1]) or, to keep classes absent from this "
                   "data, name every class (classes=[...])",
    "too few local iterations for BTFL": "local_iterations: BTFL runs at least 6 local iterations a round with these "
                                         "hyperparameters, got 5",
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_recipe_fails_when_built_with_one_line(case: str, fashion_raw, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x, y = fashion_raw
    with pytest.raises(RecipeError) as info:
        _bad(case, tmp_path, x, y)
    message = str(info.value)
    assert "\n" not in message
    assert message == BAD[case].format(root=tmp_path / "images")


def test_natural_partition_and_preprocess_round_trip(fashion_raw) -> None:  # type: ignore[no-untyped-def]
    x, y = fashion_raw
    ids = np.arange(len(y)) % 8  # the user's own clients
    pre = Preprocess(layout="NHWC", size=(16, 16), scale=1 / 255, mean=(0.5,), std=(0.25,))
    recipe = Recipe(model="mlp", data=DataSpec.from_arrays(x, y, client_ids=ids), preprocess=pre)
    assert recipe.federation.partition == "natural" and recipe.input_shape == (1, 16, 16)
    from fl_server.recipes import federate

    fed = federate(recipe, seed=0)
    assert fed.num_train_clients + len(fed.new) == 8 and fed.dataset.x.shape[1:] == (1, 16, 16)
    for k, (tr, va) in enumerate(zip(fed.train, fed.val)):  # every client holds one client id's samples
        assert len(set(ids[np.concatenate([tr, va])])) == 1
    assert Preprocess.from_dict(json.loads(json.dumps(pre.to_dict()))) == pre
    with pytest.raises(ValueError, match=r"preprocess keys must be layout, size, scale, mean, std and optionally "
                                         r"raw \(unknown: "
                                         r"\['gamma'\], missing: \[\]\)"):
        Preprocess.from_dict({**pre.to_dict(), "gamma": 2.2})
    with pytest.raises(RecipeError, match=r"^preprocess: layout NCHW but the data is NHWC; use "
                                          r"Preprocess\(layout='NHWC', \.\.\.\)$"):
        recipe.replace(preprocess=Preprocess(layout="NCHW"))


def test_preprocess_resize_matches_torch_bilinear() -> None:
    x = np.random.default_rng(0).random((3, 2, 28, 28)).astype(np.float32)
    ours = Preprocess(size=(20, 36)).apply(x)
    ref = torch.nn.functional.interpolate(torch.from_numpy(x), size=(20, 36), mode="bilinear", align_corners=False)
    assert np.abs(ours - ref.numpy()).max() < 1e-5


RECIPE_FILE = '''
import torch
from torch import nn

from fl_server.recipes import DataSpec, Federation, ModelSpec, Recipe


class TinyNet(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        c, h, w = input_shape
        self.trunk = nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 48), nn.ReLU())
        self.classifier = nn.Linear(48, num_classes)

    def forward(self, x):
        return self.classifier(self.trunk(x))


small = Recipe(model=ModelSpec(TinyNet, head="classifier"), data=DataSpec.builtin("digits"),
               federation=Federation(num_clients=10), method="TENT", rounds=3, local_iterations=5)
'''


def test_cli_trains_and_exports_a_user_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fl_server.cli import main

    (tmp_path / "my_recipes.py").write_text(RECIPE_FILE)
    run_dir, bundle = tmp_path / "run", tmp_path / "bundle"
    assert main(["train", "--recipe", f"{tmp_path / 'my_recipes.py'}:small", "--out", str(run_dir), "--no-progress",
                 "--device", "cpu"]) == 0
    assert "TENT on digits: best val" in capsys.readouterr().out
    run = rundir.read_run(run_dir)
    assert run["recipe"].endswith("my_recipes.py:small") and run["model"] == "TinyNet"
    assert main(["export", str(run_dir), "--out", str(bundle)]) == 0
    from edge_sdk._bundle import load_bundle

    loaded = load_bundle(bundle)
    assert loaded.method == "TENT" and loaded.preprocess.is_identity  # digits: float32 [0, 1] as loaded
    assert loaded.preprocess.raw == RawInput("float32", (0, 1), (1, 8, 8))
    assert {a["name"] for a in loaded.manifest["artifacts"]} >= {"forward", "tent_step"}
    assert loaded.weights("params")["features.trunk.1.weight"].shape == (48, 64)  # the user's layers, by name
    assert main(["train", "--recipe", f"{tmp_path / 'my_recipes.py'}:nope", "--out", str(run_dir)]) == 2
    assert capsys.readouterr().err.strip().endswith("my_recipes.py defines no 'nope'; recipes in it: small "
                                                     "(name one as my_recipes.py:NAME)")


def test_a_recipe_file_imports_the_modules_beside_it(tmp_path: Path) -> None:
    """A model kept in its own file beside the recipe file imports, as it would under `python my_recipes.py`."""
    from fl_server.recipes import load_recipe

    model, recipes = RECIPE_FILE.split("small = ")
    (tmp_path / "sibling_nets_of_a_recipe.py").write_text(model)
    (tmp_path / "my_recipes.py").write_text("from fl_server.recipes import DataSpec, Federation, ModelSpec, Recipe\n"
                                           "from sibling_nets_of_a_recipe import TinyNet\n\nsmall = " + recipes)
    assert load_recipe(f"{tmp_path / 'my_recipes.py'}:small").model_name == "TinyNet"


SPREAD_FILE = '''
from fl_server.recipes import DataSpec, Federation, Recipe

recipe = Recipe(model="mlp", data=DataSpec.builtin("digits"), method="FedAvg", rounds=3, local_iterations=5,
                federation=Federation(partition="dirichlet", alpha=0.5, num_clients=10))
'''


def test_coordinator_trains_a_recipe_from_its_recipe_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """An admin names FILE:NAME from FL_SERVE_RECIPES_DIR; the job trains the user's model and serves its bundle.
    A name outside the directory's grammar or a missing file is refused before anything runs. A job whose
    new-client predictions collapsed says so in its status (one line). A job trains the recipe's own method and
    federation where the request sets none (its spec lists what it overrides), and device-data hands out that run's
    new clients (none of its training samples), from the recipe file named with --recipe (never one the served
    manifest names alone)."""
    import httpx
    from coordinator_proc import ADMIN, auth, join, start

    from fl_server.cli import main
    from fl_server.recipes import federate, load_recipe

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "my_recipes.py").write_text(RECIPE_FILE)
    (tmp_path / "recipes" / "collapsing.py").write_text(RECIPE_FILE + "\ncollapsed = small.replace(method='FedAvg', "
                                                        "hyper={'lr': 50.0}, rounds=1)\n")
    (tmp_path / "recipes" / "spread.py").write_text(SPREAD_FILE)
    coord = start(tmp_path / "store", methods="", env={"FL_SERVE_RECIPES_DIR": str(tmp_path / "recipes")})
    try:
        url = f"{coord.url}/v1/jobs"
        missing = httpx.post(url, json={"method": "TENT", "recipe": "other:small"}, headers=auth(ADMIN), timeout=10)
        assert missing.status_code == 404
        assert "no recipe file other.py in the coordinator's recipe directory" in missing.text
        assert httpx.post(url, json={"recipe": "../my_recipes"}, headers=auth(ADMIN), timeout=10).status_code == 422
        assert httpx.post(url, json={"recipe": "spread", "dataset": "mnist"}, headers=auth(ADMIN),
                          timeout=10).status_code == 422  # a recipe brings its own data
        job = httpx.post(url, json={"method": "TENT", "rounds": 2, "recipe": "my_recipes:small"}, headers=auth(ADMIN),
                         timeout=10)
        assert job.status_code == 201, job.text
        bad = httpx.post(url, json={"method": "FedAvg", "rounds": 1, "recipe": "collapsing:collapsed"},
                         headers=auth(ADMIN), timeout=10)
        assert bad.status_code == 201 and bad.json()["warning"] is None, bad.text  # queued: nothing to say yet
        spread = httpx.post(url, json={"recipe": "spread", "rounds": 1}, headers=auth(ADMIN), timeout=10).json()
        assert spread["spec"] == {"recipe": "spread", "seed": 0, "rounds": 1, "overrides": ["rounds"]}
        coord.wait_bundles(3, timeout=300)
        warning = httpx.get(f"{url}/{bad.json()['id']}", headers=auth(ADMIN), timeout=10).json()["warning"]
        assert warning.startswith("warning: new-client predictions collapsed to one class (class ") and warning.endswith(
            "chance 10.0%): the model learnt no classifier; lower the learning rate or check the labels, and do not "
            "ship this bundle"), warning
        manifest = join(coord.url, "TENT")["manifest"]
        assert manifest["model"] == "TinyNet" and manifest["dataset"] == "digits"
        assert manifest["preprocess"] == {**Preprocess.identity().to_dict(),
                                          "raw": {"dtype": "float32", "range": [0.0, 1.0], "shape": [1, 8, 8]}}
        run = rundir.read_run(coord.store / "jobs" / spread["id"] / "run")
        assert run["method"] == "FedAvg" and run["federation"]["partition"] == "dirichlet"
        assert run["federation"]["alpha"] == 0.5 and run["federation"]["num_clients"] == 10
        assert "a recipe / its own" in httpx.get(f"{coord.url}/", timeout=10).text  # the dashboard
        # a recipe job that names no method: the API says which one it trained, from its run
        assert httpx.get(f"{url}/{spread['id']}", headers=auth(ADMIN), timeout=10).json()["method"] == "FedAvg"
        out = tmp_path / "new.npz"  # the newest FedAvg bundle is the spread job's (jobs run in order)
        monkeypatch.chdir(tmp_path / "recipes")  # a manifest names its recipe FILE.py:NAME (no exporter's path)
        served = ["device-data", coord.url, "--method", "fedavg", "--kind", "clients", "--out", str(out)]
        assert main(served) == 2 and not out.exists()  # the server's manifest does not pick a file to run here
        err = capsys.readouterr().err
        assert err == (f"error: {coord.url} serves a bundle of the recipe spread.py:recipe; a coordinator's manifest "
                       "does not choose a Python file to run on this machine: pass --recipe FILE.py:NAME, the recipe "
                       "file you trust\n"), err
        assert main([*served, "--recipe", "spread.py:recipe"]) == 0
        fed = federate(load_recipe(tmp_path / "recipes" / "spread.py"), 0)  # the recipe's own federation
        with np.load(out, allow_pickle=False) as f:
            written = {r.tobytes() for r in f["x"]}
        assert written == {r.tobytes() for r in fed.dataset.x[np.concatenate(fed.new)]}
        assert not written & {r.tobytes() for r in fed.dataset.x[np.concatenate([*fed.train, *fed.val])]}
    finally:
        coord.stop()


def test_a_stream_with_a_corrupted_phase_needs_a_built_in_data_set(fashion_raw, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """device-data's stream corrupts a built-in set's [0, 1] images; a user's float images in the same layout are
    refused with one line that names what works (before: they passed, as any float NCHW array did)."""
    from fl_server.device_samples import stream_samples
    from fl_server.export.run import export_run

    x, y = fashion_raw
    floats = (x.transpose(0, 3, 1, 2) / 255).astype(np.float32)
    recipe = Recipe(model="mlp", data=DataSpec.from_arrays(floats, y, layout="NCHW"),
                    method="FedAvg", rounds=1, local_iterations=2,
                    federation=Federation(partition="iid", num_clients=4))
    train(recipe, tmp_path / "run", device="cpu", progress=False)
    bundle = export_run(tmp_path / "run", tmp_path / "bundle", recipe=recipe)
    with pytest.raises(ValueError, match=r"^the corrupted phase needs a built-in data set \(float grayscale or RGB "
                                         r"images\); use --kind clients$"):
        stream_samples(json.loads((bundle / "manifest.json").read_text()), recipe=recipe)


def test_classes_a_data_set_lacks_are_kept_by_naming_every_class(fashion_raw) -> None:  # type: ignore[no-untyped-def]
    """Labels 0..8 of a ten-class problem (the tenth absent from this data): refused without names (the model would
    learn 9 outputs), kept with all ten names: the model has ten outputs, and too few names are refused."""
    x, y = fashion_raw
    keep = y < 9
    names = [f"c{k}" for k in range(10)]
    data = DataSpec.from_arrays(x[keep], y[keep], classes=names)
    assert data.num_classes == 10 and Recipe(model="mlp", data=data).num_classes == 10
    with pytest.raises(RecipeError, match=r"^data: 5 class names for labels up to 8; name every class, one name per "
                                          r"label 0\.\.K-1$"):
        DataSpec.from_arrays(x[keep], y[keep], classes=names[:5])
