"""Mistakes that used to pass silently now fail or warn with one line saying what to fix: raw images unlike the
recipe's data given to a device (already normalised, another size), a run whose new-client predictions
collapsed (``fl-server train`` and ``fl-server export`` say so), and a run whose weights became NaN or infinite
(``fl-server train`` says so, ``fl-server export`` refuses it). Real MNIST and digits, real recipe files, a real
bundle run by onnxruntime. (A forward that applies softmax after its head: tests/test_recipes.py's bad recipes.)"""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from fl_server.cli import main
from fl_server.diagnostics import collapse_warning

RECIPES = '''
import numpy as np

from fl_server.data import load_dataset
from fl_server.recipes import DataSpec, Federation, Recipe

test = load_dataset("mnist", root={root!r}, split="test")
idx = np.random.default_rng(0).choice(len(test), 1200, replace=False)
raw = np.round(test.x[idx, 0] * 255).astype(np.uint8)  # the user's raw images: uint8 [N, 28, 28]
healthy = Recipe(model="mlp", data=DataSpec.from_arrays(raw, test.y[idx], layout="NHWC"),
                 federation=Federation(partition="iid", num_clients=6, new_fraction=0.34), method="FedAvg",
                 rounds=3, local_iterations=20, batch_size=32)
collapsed = healthy.replace(hyper={{"lr": 5.0}})  # a learning rate that sends every prediction to one class
'''


@pytest.fixture(scope="module")
def runs(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The CLI's train and export of a healthy and of a collapsed recipe (their printed lines, the bundles)."""
    tmp = tmp_path_factory.mktemp("loud")
    (tmp / "mnist_recipes.py").write_text(RECIPES.format(root=str(data_root)))
    out: dict[str, object] = {}
    for name in ("healthy", "collapsed"):
        lines = []
        for argv in (["train", "--recipe", f"{tmp / 'mnist_recipes.py'}:{name}", "--out", str(tmp / name),
                      "--no-progress", "--device", "cpu"],
                     ["export", str(tmp / name), "--out", str(tmp / f"{name}-bundle")]):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main(argv) == 0
            lines.append(buf.getvalue().strip().splitlines())
        out[name] = {"train": lines[0], "export": lines[1], "bundle": tmp / f"{name}-bundle",
                     "run": json.loads((tmp / name / "run.json").read_text())}
    return out


COLLAPSED = re.compile(r"^warning: new-client predictions collapsed to one class \(class \d takes 100% of them; "
                       r"accuracy \d+\.\d%, chance 10\.0%\): the model learnt no classifier; lower the learning rate "
                       r"or check the labels, and do not ship this bundle$")


def test_a_collapsed_run_warns_at_train_and_export(runs: dict) -> None:
    collapsed, healthy = runs["collapsed"], runs["healthy"]
    assert COLLAPSED.match(collapsed["train"][-1]), collapsed["train"][-1]  # after the summary line
    assert COLLAPSED.match(collapsed["export"][-1]) and collapsed["export"][0].startswith("bundle written to")
    assert collapsed["run"]["warning"] == collapsed["train"][-1]
    assert healthy["run"]["warning"] is None and healthy["run"]["preprocess"]["raw"] == {
        "dtype": "uint8", "range": [0.0, 255.0], "shape": [28, 28]}
    assert not any("warning" in line for line in healthy["train"][-1:] + healthy["export"])


DIVERGING = '''
from fl_server.recipes import DataSpec, Federation, Recipe

diverged = Recipe(model="mlp", data=DataSpec.builtin("digits"), method="FedAvg", hyper={"lr": 1e8}, rounds=2,
                  local_iterations=5, batch_size=32, federation=Federation(partition="iid", num_clients=6))
'''
NONFINITE = re.compile(r"^warning: the run's weights are not finite \(NaN or inf in params/[\w.]+ and \d+ more tensors\): "
                       r"training diverged and its accuracies mean nothing; lower the learning rate or clip the "
                       r"gradients \(hyper clip_norm\), and do not ship this bundle \(fl-server export refuses it\)$")


def test_a_diverged_run_warns_at_train_and_export_refuses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    """A learning rate of 1e8 sends the weights to NaN/inf in the first round: the summary and run.json say so
    instead of an accuracy alone (or a misleading "collapsed" line); export writes nothing."""
    from fl_server import rundir

    (tmp_path / "diverging.py").write_text(DIVERGING)
    run_dir = tmp_path / "run"
    assert main(["train", "--recipe", f"{tmp_path / 'diverging.py'}:diverged", "--out", str(run_dir),
                 "--no-progress", "--device", "cpu"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert NONFINITE.match(last), last
    assert rundir.read_run(run_dir)["warning"] == last
    assert main(["export", str(run_dir), "--out", str(tmp_path / "bundle")]) == 2 and not (tmp_path / "bundle").exists()
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: {re.escape(str(run_dir))}: the run's best state is not finite \(NaN or inf in "
                        r"params/[\w.]+ and \d+ more tensors\): training diverged, so no bundle is written; train "
                        r"again and lower the learning rate or clip the gradients \(hyper clip_norm\)\n", err), err


CHANCE = re.compile(r"^warning: new-client accuracy \d+\.\d% is at chance \(10\.0% for 10 classes\): the model learnt "
                    r"\(almost\) nothing; train longer, lower the learning rate or check the labels before shipping "
                    r"this bundle$")


def test_fedicon_at_the_papers_rates_over_short_rounds_warns(tmp_path: Path) -> None:
    """FedICON's paper rates (lr 0.005, head_lr 0.01) are for rounds of 5 epochs; over three rounds of 5 steps its
    classifier does not leave its initial draw. The record (and so the summary and run.json) says so in one line
    instead of printing a chance-level accuracy alone."""
    from fl_server.recipes import DataSpec, Federation, Recipe, train

    recipe = Recipe(model="mlp", data=DataSpec.builtin("digits"), method="FedICON", rounds=3, local_iterations=5,
                    batch_size=32, federation=Federation(partition="iid", num_clients=6, new_fraction=0.34))
    record = train(recipe, tmp_path / "run", device="cpu", progress=False)
    assert record["hyper"]["lr"] == 0.005 and record["hyper"]["head_lr"] == 0.01
    assert record["warning"] is not None and (CHANCE.match(record["warning"]) or COLLAPSED.match(record["warning"]))


@pytest.mark.parametrize("counts, accuracy, labels, expected", [
    ([0, 0, 95, 5], None, None, "class 2 takes 95% of them; chance 25.0%"),
    ([0, 0, 91, 9], None, [0, 0, 90, 10], None),  # the labels are 90% that class: predicting it is right
    ([30, 25, 25, 20], 0.30, None, "new-client accuracy 30.0% is at chance (25.0% for 4 classes)"),
    ([30, 25, 25, 20], 0.31, None, None),
    ([60, 40], 0.9, None, None),
    ([0, 0], None, None, None),
])
def test_collapse_thresholds(counts: list[int], accuracy: float | None, labels: list[int] | None,
                             expected: str | None) -> None:
    line = collapse_warning(counts, len(counts), accuracy, labels)
    assert (line is None) if expected is None else (expected in line and "\n" not in line)


def test_new_clients_at_chance_under_a_good_validation_say_they_differ() -> None:
    """At chance on the new clients while validation is well above it, the model did learn something: the line says
    that what validation scored does not carry over, not that nothing was learnt; at chance on both, it says that."""
    line = collapse_warning([30, 25, 25, 20], 4, 0.20, None, validation=0.64, clients=2)
    assert line == ("warning: new-client accuracy 20.0% is at chance (25.0% for 4 classes) while validation reached "
                    "64.0%: what validation scored does not carry over to the new clients (another domain, classes "
                    "training rarely saw, models of the training clients' own, or too few new clients to tell: 2); "
                    "check them before shipping this bundle")
    assert "the model learnt (almost) nothing" in collapse_warning([30, 25, 25, 20], 4, 0.20, validation=0.30)


def test_a_btfl_runs_warning_names_the_received_model() -> None:
    """BTFL's devices personalise on labeled data, which training does not score: its chance line says whose
    accuracy it is (the received model's), not that the bundle's devices get it."""
    from fl_server.diagnostics import RECEIVED_SUBJECT

    line = collapse_warning([30, 25, 25, 20], 4, 0.30, None, subject=RECEIVED_SUBJECT)
    assert line is not None and line.startswith("warning: the received model's (before each device's labeled "
                                                "personalisation) new-client accuracy 30.0% is at chance")


def _mnist_raw(data_root: Path) -> tuple[np.ndarray, np.ndarray]:
    from fl_server.data import load_dataset

    test = load_dataset("mnist", root=data_root, split="test")
    return np.round(test.x[:64, 0] * 255).astype(np.uint8), test.y[:64]


def test_device_refuses_raw_images_unlike_the_recipes(runs: dict, data_root: Path) -> None:
    """The bundle records uint8 [0, 255] images of 28x28 (NHW): raw uint8 and float 0..255 pass and agree;
    normalised floats or 0/1 integers (scaled twice, silently, before) and another size are refused in the user's
    own terms."""
    from edge_sdk import open_bundle

    device = open_bundle(runs["healthy"]["bundle"])
    x, y = _mnist_raw(data_root)
    logits = device.predict(x)
    assert (logits.argmax(1) == y).mean() > 0.5
    np.testing.assert_allclose(device.predict(x.astype(np.float32)), logits, atol=1e-5)  # float 0..255: raw
    np.testing.assert_allclose(device.predict(x[..., None]), logits, atol=1e-5)  # [N, 28, 28, 1]: the same
    device.predict(np.zeros((2, 28, 28), np.float32))  # all-black floats are not "normalised"
    with pytest.raises(ValueError, match=r"^this bundle expects raw pixels in \[0, 255\] \(uint8\); got float32 "
                                         r"values in \[0, 1\]: pass the raw images, not normalised ones$"):
        device.predict(x.astype(np.float32) / 255)
    with pytest.raises(ValueError, match=r"^this bundle expects raw pixels in \[0, 255\] \(uint8\); got uint8 "
                                         r"values in \[0, 1\]: pass the raw images, not normalised ones$"):
        device.predict((x > 127).astype(np.uint8))  # 0/1 integers (a thresholded mask, x / 255 cast back)
    with pytest.raises(ValueError, match=r"^expected raw images \[N, 28, 28\] \(uint8, layout NHW\), got \[4, 32, 32, "
                                         r"3\]: pass images of that size and channels \(the recipe's data\)$"):
        device.personalize(np.zeros((4, 32, 32, 3), np.uint8))

    # a bundle exported before the manifest recorded its raw images: nothing is checked (as before)
    manifest_file = runs["healthy"]["bundle"] / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["preprocess"]["raw"]
    manifest_file.write_text(json.dumps(manifest))
    try:
        assert open_bundle(runs["healthy"]["bundle"]).predict(x.astype(np.float32) / 255).shape == (64, 10)
    finally:
        manifest["preprocess"]["raw"] = {"dtype": "uint8", "range": [0.0, 255.0], "shape": [28, 28]}
        manifest_file.write_text(json.dumps(manifest))


def test_training_says_which_new_clients_personalising_cost_more_than_a_point(tmp_path: Path) -> None:
    """TENT on the embedded digits (Dir(0.5), 20 new clients): the safeguard bounds a shift's mean, not each
    device, and here some devices end below the model they received. Training says how many, and its figures
    are the devices': the received model's accuracy (``method="none"``) and, per client, whether personalising
    (the bundle's method, its safeguard on) cost more than a point."""
    from edge_sdk import open_bundle
    from fl_server.device_samples import client_samples
    from fl_server.export.run import export_run
    from fl_server.recipes import DataSpec, Federation, Recipe, train

    recipe = Recipe(model="mlp", data=DataSpec.builtin("digits"), method="TENT", rounds=10, local_iterations=10,
                    batch_size=32, hyper={"lr": 0.1, "tent_lr": 0.1},
                    federation=Federation(partition="dirichlet", alpha=0.5, num_clients=40, new_fraction=0.5))
    record = train(recipe, tmp_path / "run", device="cpu", progress=False)
    bundle = export_run(tmp_path / "run", tmp_path / "bundle", recipe=recipe)
    samples = client_samples(json.loads((bundle / "manifest.json").read_text()), recipe=recipe)
    received, personalised = [], []
    for lo, hi in zip(samples["offsets"][:-1], samples["offsets"][1:]):
        x, y = samples["x"][lo:hi], samples["y"][lo:hi]
        received.append(float((open_bundle(bundle, method="none").predict(x).argmax(1) == y).mean()))
        device = open_bundle(bundle)
        device.personalize(x)
        personalised.append(float((device.predict(x).argmax(1) == y).mean()))
    loss = np.asarray(received) - np.asarray(personalised)
    worse = int((loss > 0.01 + 1e-9).sum())
    assert worse >= 1, loss  # the case this line exists for
    assert abs(100 * np.mean(received) - record["received_test"]) <= 0.1
    assert abs(100 * np.mean(personalised) - record["test"]) <= 0.1
    assert record["adaptation_note"] == (
        f"note: personalising cost {worse} of {len(loss)} new clients more than a point against the model they "
        f"received (worst {100 * loss.max():.1f} points; mean {100 * np.mean(personalised):.1f}% personalised, "
        f"{100 * np.mean(received):.1f}% received); the safeguard bounds a shift's mean over clients, not each "
        f"device: check the method's learning rate on your data, or open the bundle with method='none'")


@pytest.mark.parametrize("partition", ["dirichlet", "pathological"])  # adapting helps there, hurts here
def test_a_rollback_methods_note_says_what_adapting_would_do_on_its_validation_data(tmp_path: Path,
                                                                                    partition: str) -> None:
    """FedTTA++ declares the rule 'rollback': no device adapts. Training says what adapting without the rule would
    do on the run's own validation data (5 validation clients here; never the new clients), and its figures are
    what the SDK gets from the bundle with ``safeguard=False`` and with ``method="none"`` on those clients."""
    from edge_sdk import open_bundle
    from fl_server.device_samples import bundle_clients
    from fl_server.export.run import export_run
    from fl_server.recipes import train
    from fl_server.recipes.presets import builtin_recipe

    recipe = builtin_recipe("digits", "FedTTA++", rounds=10, val_clients=5, partition=partition,
                            **({"alpha": 0.5} if partition == "dirichlet" else {}))
    record = train(recipe, tmp_path / "run", device="cpu", progress=False)
    bundle = export_run(tmp_path / "run", tmp_path / "bundle", recipe=recipe)
    fed, raw = bundle_clients(json.loads((bundle / "manifest.json").read_text()), recipe=recipe)
    adapted, received = [], []
    for idx in fed.val_clients:
        x, y = raw[idx], fed.dataset.y[idx]
        received.append((open_bundle(bundle, method="none").predict(x).argmax(1) == y).mean())
        device = open_bundle(bundle, safeguard=False)
        device.personalize(x)
        adapted.append((device.predict(x).argmax(1) == y).mean())
    note = record["adaptation_note"]
    assert note.startswith("note: FedTTA++'s safeguard rule 'rollback' keeps the received model on every device; on "
                           "this run's 5 validation clients, adapting without it gives "), note
    figures = [float(f) for f in re.findall(r"(\d+\.\d)%", note)]
    assert abs(np.mean(adapted) - np.mean(received)) > 0.02, (adapted, received)  # adapting changes something here
    np.testing.assert_allclose(figures, [100 * np.mean(adapted), 100 * np.mean(received)], atol=0.051)
    helps = np.mean(adapted) > np.mean(received)
    assert helps == (partition == "dirichlet"), (adapted, received)
    assert note.endswith("; where that holds on your data, open the bundle with edge_sdk.open_bundle(..., "
                         "safeguard=False)" if helps else "; the rule holds here too"), note


TABULAR = '''
import numpy as np

from edge_sdk import Preprocess
from fl_server.data import load_dataset
from fl_server.recipes import DataSpec, Federation, Recipe

test = load_dataset("mnist", root={root!r}, split="test")
pixels = np.round(test.x[:900, 0] * 255)
# a user's feature vectors: the ink in each 7x7 block of a digit, in raw units (0..12495: no range a device knows)
ink = pixels.reshape(-1, 4, 7, 4, 7).sum(axis=(2, 4)).reshape(-1, 1, 1, 16).astype(np.float32)
mean, std = ink.reshape(-1, 16).mean(0), ink.reshape(-1, 16).std(0) + 1
tabular = Recipe(model="mlp", data=DataSpec.from_arrays(ink, test.y[:900], layout="NHWC"),
                 preprocess=Preprocess(layout="NHWC", mean=tuple(mean.tolist()), std=tuple(std.tolist())),
                 federation=Federation(partition="iid", num_clients=6, new_fraction=0.34), method="FedAvg",
                 rounds=3, local_iterations=20, batch_size=32)
'''


def test_feature_vectors_on_another_scale_warn_on_the_device(data_root: Path, tmp_path: Path) -> None:
    """Feature vectors in no value range a device recognises: the manifest records each feature's mean and
    standard deviation, and a device given features normalised already (its own preprocessing before the
    bundle's) is warned, where it used to predict on them in silence; raw features pass without a word."""
    import warnings

    from edge_sdk import InputScaleWarning, open_bundle
    from fl_server.device_samples import client_samples

    (tmp_path / "tabular.py").write_text(TABULAR.format(root=str(data_root)))
    for argv in (["train", "--recipe", f"{tmp_path / 'tabular.py'}:tabular", "--out", str(tmp_path / "run"),
                  "--no-progress", "--device", "cpu"], ["export", str(tmp_path / "run"), "--out", str(tmp_path / "b")]):
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 0
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["preprocess"]["raw"]["range"] is None
    assert len(manifest["input_moments"]["mean"]) == len(manifest["input_moments"]["std"]) == 16
    device = open_bundle(tmp_path / "b")
    with contextlib.chdir(tmp_path):
        samples = client_samples(device.bundle.manifest)
    x, y = samples["x"], samples["y"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", InputScaleWarning)
        accuracy = (device.predict(x).argmax(1) == y).mean()  # raw features: as the recipe's data held them
    assert accuracy > 0.6, accuracy
    flat = x.reshape(len(x), 16)
    normalised = ((flat - flat.mean(0)) / (flat.std(0) + 1)).reshape(x.shape).astype(np.float32)
    with pytest.warns(InputScaleWarning, match=r"^this batch is on another scale than the bundle's data \(channel "
                                               r"means \[[^]]+\(16 channels\)\], standard deviations \[[^]]+\]\): "
                                               r"for the median channel, its values lie [0-9.]+ of those standard "
                                               r"deviations from the mean \(root mean square\) and spread 0\.00\d+ "
                                               r"times as widely, so its predictions are unlikely to mean anything; "
                                               r"pass values as the recipe's data held them \(normalised there if it "
                                               r"was, raw if not\)$"):
        wrong = (device.predict(normalised).argmax(1) == y).mean()
    assert wrong < accuracy - 0.2, (wrong, accuracy)  # what the warning is for: the scores were silently wrong
