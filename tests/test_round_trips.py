"""Round trips without leaks: a run records how to rebuild its model (a recipe file, or nothing when the recipe was
built in Python: export and device-data then ask for it in one line); a user's data is never taken for a built-in
data set of the same name; ``device-data`` hands out the run's own new clients only, verified against the run's
``new_clients`` fingerprint, never a split re-made from a changed recipe."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_sdk._bundle import load_bundle
from fl_server import rundir
from fl_server.cli import main
from fl_server.recipes import DataSpec, Federation, ModelSpec, Recipe, RecipeError, federate, load_recipe, train


def _rows(x: np.ndarray) -> set[bytes]:
    return {np.ascontiguousarray(r).tobytes() for r in x}


def _split(fed, raw: np.ndarray) -> tuple[set[bytes], set[bytes]]:  # type: ignore[no-untyped-def]
    """(the training clients' samples, the new clients' samples) of ``fed`` as raw image bytes."""
    seen = np.concatenate([*fed.train, *fed.val])
    return _rows(raw[seen]), _rows(raw[np.concatenate(fed.new)])


PYTHON_RECIPE = ("the run of 'digits' names no recipe file (its recipe was built in Python): pass the recipe in "
                 "Python (export_run(run_dir, dest, recipe=recipe); device_samples.client_samples(manifest, "
                 "recipe=recipe)) or train with fl-server train --recipe FILE.py:NAME")


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_a_python_recipe_over_a_folder_named_digits_round_trips_with_the_recipe(
        mnist_all, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from PIL import Image

    from fl_server.export.run import export_run
    from fl_server.device_samples import client_samples

    folder = tmp_path / "digits"  # the name of a built-in data set: it must never be taken for it
    for label in range(10):
        (folder / str(label)).mkdir(parents=True)
        for i in np.flatnonzero(mnist_all.y == label)[:12]:
            Image.fromarray(np.round(mnist_all.x[i, 0] * 255).astype(np.uint8), mode="L").save(
                folder / str(label) / f"{i}.png")
    recipe = Recipe(model="mlp", data=DataSpec.from_image_folder(folder), method="TENT", rounds=1,
                    federation=Federation(partition="iid", num_clients=6, new_fraction=0.34), local_iterations=2,
                    batch_size=16)
    run_dir = tmp_path / "run"
    train(recipe, run_dir, device="cpu", progress=False)
    run = rundir.read_run(run_dir)
    assert run["recipe"] is None and run["dataset"] == "digits" and run["data"]["builtin"] is None
    assert run["new_clients"]["clients"] == 2 and run["new_clients"]["samples"] == 40

    assert main(["export", str(run_dir), "--out", str(tmp_path / "refused")]) == 2
    refusal = _one_line_error(capsys)
    assert refusal == f"error: {PYTHON_RECIPE}\n"  # not an error about the layout of the built-in digits
    assert not (tmp_path / "refused").exists()

    bundle = load_bundle(export_run(run_dir, tmp_path / "bundle", recipe=recipe))
    assert bundle.manifest["new_clients"] == run["new_clients"] and bundle.manifest.get("recipe") is None
    assert main(["device-data", str(tmp_path / "bundle"), "--kind", "clients", "--out", str(tmp_path / "d.npz")]) == 2
    assert _one_line_error(capsys) == refusal  # device-data reaches the same refusal, not another error first

    samples = client_samples(bundle.manifest, recipe=recipe)
    assert samples["x"].dtype == np.uint8 and samples["x"].shape[1:] == (28, 28, 1)  # raw images, as a device gets
    training, held_out = _split(federate(recipe, run["seed"]), recipe.data.x)
    assert _rows(samples["x"]) == held_out and not _rows(samples["x"]) & training


MNIST_RECIPE = '''
from fl_server.recipes import DataSpec, Federation, Recipe

spread = Recipe(model="mlp", data=DataSpec.builtin("{dataset}"), method="TENT", rounds=1, local_iterations=2,
                batch_size=16, federation=Federation(partition="dirichlet", alpha=0.5, num_clients=8, max_samples=600))
'''


def test_device_data_hands_out_the_runs_new_clients_only(data_root: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe file trained with a changed federation (--clients): device-data takes the run's new clients, not
    the file's split (whose "new" clients hold training samples); after the recipe file changes its data, it
    refuses in one line."""
    from fl_server.data import load_dataset

    file = tmp_path / "mine.py"
    file.write_text(MNIST_RECIPE.format(dataset="mnist"))
    run_dir, bundle, out = tmp_path / "run", tmp_path / "bundle", tmp_path / "new.npz"
    assert main(["train", "--recipe", f"{file}:spread", "--clients", "5", "--out", str(run_dir), "--no-progress",
                 "--device", "cpu"]) == 0
    assert main(["export", str(run_dir), "--out", str(bundle)]) == 0
    monkeypatch.chdir(file.parent)  # a bundle names its recipe FILE.py:NAME, relative to the working directory
    assert main(["device-data", str(bundle), "--kind", "clients", "--out", str(out)]) == 0, capsys.readouterr().err
    with np.load(out, allow_pickle=False) as f:
        written = _rows(f["x"])
        assert len(f["x"]) == rundir.read_run(run_dir)["new_clients"]["samples"] == f["offsets"][-1]

    trained = load_recipe(f"{file}:spread")
    trained = trained.replace(federation=dataclasses.replace(trained.federation, num_clients=5))
    fed = federate(trained, 0)  # the run's clients (max_samples: indices into its 600 samples)
    training, held_out = _split(fed, fed.dataset.x)
    assert written == held_out and not written & training
    file_training, file_new = _split(federate(load_recipe(f"{file}:spread"), 0), fed.dataset.x)
    assert file_new & training  # what a split re-made from the file would have handed out
    mnist = load_dataset("mnist", root=data_root, split="all")
    assert written <= _rows(mnist.x)  # raw images of the data set, not of another index space

    file.write_text(MNIST_RECIPE.format(dataset="fashion_mnist"))  # the recipe file changed since training
    out.unlink()
    assert main(["device-data", str(bundle), "--kind", "clients", "--out", str(out)]) == 2
    err = _one_line_error(capsys)
    assert re.fullmatch(rf"error: the new clients rebuilt from {re.escape(str(file))}:spread and the data \(seed 0\) "
                        r"are not the run's \(\d+ clients / \d+ samples, sha256 [0-9a-f]{12}; the run held out 2 / \d+, "
                        r"[0-9a-f]{12}\): the recipe file or the data \(--data-dir\) changed since training, and a "
                        r"different split would hand out training samples; restore them or give the device your own "
                        r"samples\n", err), err
    assert not out.exists()
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest.pop("new_clients")
    (bundle / "old.json").write_text(json.dumps(manifest))
    assert main(["device-data", str(bundle / "old.json"), "--kind", "clients", "--out", str(out)]) == 2
    assert "does not identify its run's new clients" in _one_line_error(capsys)


class Tiny(torch.nn.Module):
    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(input_shape)), 16))
        self.fc = torch.nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


def test_a_python_model_over_built_in_data_is_asked_for_in_one_line() -> None:
    """Built-in data but the user's own model, built in Python: the run cannot be rebuilt from run.json alone."""
    from fl_server.recipes.run import describe_run, recipe_of_run

    recipe = Recipe(model=ModelSpec(Tiny), data=DataSpec.builtin("digits"), federation=Federation("iid", num_clients=4),
                    method="FedAvg", rounds=1)
    fed = federate(recipe, 0)
    run = json.loads(json.dumps(describe_run(recipe, recipe.build_algorithm(recipe.build_model(0), 2), fed, 0)))
    assert run["recipe"] is None and run["data"]["builtin"] == "digits" and run["model"] == "Tiny"
    with pytest.raises(RecipeError, match=f"^{re.escape(PYTHON_RECIPE)}$"):
        recipe_of_run(run)


def test_a_recipe_job_without_a_method_is_not_checked_against_the_default_one(tmp_path: Path) -> None:
    """FL_SERVE_METHODS without TENT (the request's default method): a recipe job that names no method trains
    the recipe's own and is accepted; one naming TENT is refused."""
    import httpx
    from coordinator_proc import ADMIN, auth, start

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "mine.py").write_text(MNIST_RECIPE.format(dataset="digits").replace("TENT", "FedAvg"))
    coord = start(tmp_path / "store", methods="", env={"FL_SERVE_RECIPES_DIR": str(tmp_path / "recipes"),
                                                       "FL_SERVE_METHODS": "FedAvg"})
    try:
        url = f"{coord.url}/v1/jobs"
        named = httpx.post(url, json={"recipe": "mine:spread", "method": "TENT"}, headers=auth(ADMIN), timeout=10)
        assert named.status_code == 422 and "method 'TENT' is not served here" in named.text
        own = httpx.post(url, json={"recipe": "mine:spread"}, headers=auth(ADMIN), timeout=10)
        assert own.status_code == 201 and own.json()["spec"]["overrides"] == [], own.text
        assert httpx.delete(f"{url}/{own.json()['id']}", headers=auth(ADMIN), timeout=10).status_code in (200, 204)
    finally:
        coord.stop()


NATURAL_RECIPE = '''
import numpy as np
from fl_server.recipes import DataSpec, Recipe

rng = np.random.default_rng(0)
mine = Recipe(model="mlp", data=DataSpec.from_arrays(rng.integers(0, 256, (60, 8, 8, 1), dtype=np.uint8),
                                                     np.arange(60) % 3, client_ids=np.arange(60) % 6), rounds=1)
'''


def test_a_flag_that_would_change_nothing_is_refused_in_one_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--clients on a recipe whose clients are the data's own (the natural partition) would train the same
    federation as without it: refused before any training, the run folder never made."""
    file = tmp_path / "natural.py"
    file.write_text(NATURAL_RECIPE)
    assert main(["train", "--recipe", f"{file}:mine", "--clients", "5", "--out", str(tmp_path / "run"),
                 "--no-progress", "--device", "cpu"]) == 2
    assert _one_line_error(capsys) == (
        "error: federation: the natural partition's clients are the data's client_ids, so a number of clients "
        "(--clients, num_clients) would change nothing; drop it or choose a partition\n")
    assert not (tmp_path / "run").exists()


class TinyTanh(Tiny):
    """Tiny with a tanh between body and head: the same parameter shapes, another function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.body(x)))


def test_a_recipe_edited_after_training_is_refused_not_resumed_or_exported(tmp_path: Path) -> None:
    """Other preprocessing than the run's, or model code that computes otherwise with the same parameter shapes:
    training into the same folder would resume the old run and report its accuracy, export would ship the run's
    weights in a pipeline that normalises or computes otherwise; both refuse in one line."""
    from fl_server.export.run import export_run

    recipe = Recipe(model=ModelSpec(Tiny), data=DataSpec.builtin("digits"), rounds=1, local_iterations=2,
                    batch_size=16, federation=Federation(partition="iid", num_clients=4))
    run_dir = tmp_path / "run"
    train(recipe, run_dir, device="cpu", progress=False)
    assert recipe.preprocess is not None
    edited = recipe.replace(preprocess=dataclasses.replace(recipe.preprocess, mean=(0.5,)))
    recoded = recipe.replace(model=ModelSpec(TinyTanh))
    for other, what in ((edited, "preprocessing"), (recoded, "model code (the same weights compute other outputs)")):
        with pytest.raises(RecipeError) as info:
            train(other, run_dir, device="cpu", progress=False)
        assert str(info.value) == (f"{run_dir} holds a run trained with other {what} than this recipe's; train "
                                   f"into another folder (--out), or delete it to start over")
    with pytest.raises(RecipeError, match=r"^the recipe's preprocessing is not the run's \(run.json: .*\"mean\": "
                                          r"\[0.0\].*; the recipe now: .*\"mean\": \[0.5\].*\); restore the recipe"):
        export_run(run_dir, tmp_path / "bundle", recipe=edited)
    with pytest.raises(RecipeError) as info:
        export_run(run_dir, tmp_path / "bundle", recipe=recoded)
    assert str(info.value) == ("the recipe's model code (the same weights compute other outputs) is not the run's; "
                               "restore the recipe the run was trained with, or train again")
    assert not (tmp_path / "bundle").exists()
    train(recipe, run_dir, device="cpu", progress=False)  # the recipe as trained: resumes
    export_run(run_dir, tmp_path / "bundle", recipe=recipe)
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert manifest["model_forward"] == json.loads((run_dir / "run.json").read_text())["model_forward"]


@pytest.mark.parametrize("source, expected", [
    ("from fl_server.recipes import Recipe\nrecipe = Recipe(model='mlp', data=foo(\n",
     "error: {dir}/mine.py line 2: SyntaxError: '(' was never closed; python mine.py shows the whole traceback\n"),
    ("import helper\n", "error: {dir}/helper.py line 2: NameError: name 'Yy' is not defined; python mine.py shows the "
                        "whole traceback\n"),
])
def test_a_recipe_file_whose_code_fails_says_where_in_one_line(source: str, expected: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A syntax or run-time error in a recipe file (or a module beside it): the file, the line and the error in one
    line, where a traceback through the package's own frames came before."""
    (tmp_path / "mine.py").write_text(source)
    (tmp_path / "helper.py").write_text("def y():\n    return Yy\ny()\n")
    assert main(["train", "--recipe", f"{tmp_path / 'mine.py'}:recipe", "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 2
    assert _one_line_error(capsys) == expected.format(dir=tmp_path)
