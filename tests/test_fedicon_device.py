"""FedICON on the device: a FedICON run trained through a recipe on real MNIST exports a bundle whose
``fedicon_step`` graph the torch-free SDK runs; the device's personalised model is the server's
``FedICON.personalize`` (same views, same order), to 1e-4."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

HYPER = {"encoder_rounds": 2, "lr": 0.05, "head_lr": 0.1, "ft_iterations": 2, "tta_lr": 0.05, "tta_batch": 32,
         "tta_epochs": 2}


def _recipe(data_root: Path, **hyper: object):  # type: ignore[no-untyped-def]
    from fl_server.recipes import DataSpec, Federation, Recipe

    return Recipe(model="mlp", data=DataSpec.builtin("mnist", str(data_root)), method="FedICON",
                  federation=Federation(partition="pathological", num_clients=6, max_samples=1500),
                  hyper={**HYPER, **hyper}, rounds=3, local_iterations=4, batch_size=32)


def _server_personalised(run: Path, recipe, data_root: Path, x: np.ndarray) -> tuple[np.ndarray, dict]:  # type: ignore[no-untyped-def]
    from fl_server.recipes.run import rebuild
    from fl_server.rundir import load_best, read_run

    _, _, algorithm = rebuild(read_run(run), str(data_root), recipe=recipe)
    state = {k: {n: v.float() for n, v in d.items()} for k, d in load_best(run).items() if isinstance(d, dict)}
    xt = torch.from_numpy(x).float()
    tuned = algorithm.personalize(state, xt)
    return algorithm.predict(tuned, xt).detach().numpy(), {n: v.detach().numpy() for n, v in tuned.items()}


@pytest.mark.parametrize("projection", ["mlp", "none"])
def test_device_fedicon_is_the_servers(projection: str, data_root: Path, tmp_path: Path) -> None:
    from edge_sdk import open_bundle
    from export.run import export_run
    from fl_server.recipes import federate, train
    from fl_server.service.publish import verify_bundle_dir

    recipe = _recipe(data_root, projection=projection)
    train(recipe, tmp_path / "run", device="cpu", progress=False, data_root=str(data_root))
    bundle = export_run(tmp_path / "run", tmp_path / "bundle", data_root=str(data_root), recipe=recipe)
    names = {a["name"] for a in open_bundle(bundle).bundle.manifest["artifacts"]}
    assert {"forward", "params", "fedicon_step"} <= names and ("proj" in names) == (projection == "mlp")
    verify_bundle_dir(bundle, 1 << 28)  # the coordinator would publish it

    fed = federate(recipe, 0, str(data_root))
    x = fed.dataset.x[fed.new[0]]
    device = open_bundle(bundle)
    assert device.method == "FedICON" and not device.needs_labels
    before = device.predict(x)
    adaptation = device.personalize(x)
    steps = 2 * -(-len(x) // 32) - 2 * (len(x) % 32 == 1)  # two passes of 32-sample batches (a 1-sample one skipped)
    assert adaptation.steps == steps and len(adaptation.details["contrastive_loss"]) == steps
    after = device.predict(x)
    assert np.abs(after - before).max() > 1e-3  # the encoder moved

    server_logits, tuned = _server_personalised(tmp_path / "run", recipe, data_root, x)
    np.testing.assert_allclose(after, server_logits, atol=1e-4)
    for name, value in device.weights.items():  # the head is frozen (Sec. 4.2), the encoder is the server's
        np.testing.assert_allclose(value, tuned[name], atol=1e-5)
        if name.startswith("head."):
            np.testing.assert_array_equal(value, device.bundle.weights("params")[name])


def test_the_devices_views_are_the_servers() -> None:
    """The device draws the server's uniforms bit for bit (keys over 2^32 included)."""
    from edge_sdk.fedicon import hash_uniform
    from fl_server.data.augment import hash_uniform as server_hash_uniform

    for key in (0, 7, 1_000_003 * 3 + 11 * 7_919, 2**33 + 5, 2**40 + 123_456_789):
        np.testing.assert_array_equal(hash_uniform(key, 6, 789),
                                      server_hash_uniform(torch.tensor(key), 6, 789).numpy())
    with pytest.raises(ValueError, match="key must be >= 0"):
        hash_uniform(-1, 2, 2)


def test_fedicon_bundles_the_device_cannot_run_are_refused(data_root: Path, tmp_path: Path) -> None:
    """Online TTA has no device graph (export says so); a bundle without its step is refused by the coordinator;
    a manifest with a bad batch size is refused by the device."""
    import json
    import shutil

    from edge_sdk import open_bundle
    from edge_sdk.errors import BundleError
    from export.run import export_run
    from fl_server.recipes import train
    from fl_server.service.publish import PublishError, verify_bundle_dir

    recipe = _recipe(data_root, tta_mode="online")
    train(recipe, tmp_path / "run", device="cpu", progress=False, data_root=str(data_root))
    with pytest.raises(ValueError, match="FedICON's online TTA has no device graph: the device runs batch-mode"):
        export_run(tmp_path / "run", tmp_path / "bundle", data_root=str(data_root), recipe=recipe)

    run_json = tmp_path / "run" / "run.json"
    run = json.loads(run_json.read_text())
    run["hyper"]["tta_mode"] = "batch"
    run_json.write_text(json.dumps(run))
    bundle = export_run(tmp_path / "run", tmp_path / "bundle", data_root=str(data_root),
                        recipe=recipe.replace(hyper={**recipe.hyper, "tta_mode": "batch"}))

    def edited(name: str, edit) -> Path:  # type: ignore[no-untyped-def]
        copy = tmp_path / name
        shutil.copytree(bundle, copy)
        (copy / "manifest.sig").unlink(missing_ok=True)
        manifest = json.loads((copy / "manifest.json").read_text())
        edit(manifest)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        return copy

    def drop_step(m: dict) -> None:
        step = next(a for a in m["artifacts"] if a["name"] == "fedicon_step")
        m["artifacts"].remove(step)
        (tmp_path / "no-step" / step["file"]).unlink()

    with pytest.raises(PublishError, match="a FedICON bundle needs the artifacts fedicon_step; export it"):
        verify_bundle_dir(edited("no-step", drop_step), 1 << 28)
    bad = edited("bad-batch", lambda m: m["hyperparameters"].update(tta_batch=1))
    with pytest.raises(BundleError, match="the bundle's tta_batch must be an integer >= 2, got 1"):
        open_bundle(bad)


def test_the_coordinator_trains_serves_and_a_device_runs_fedicon(tmp_path: Path) -> None:
    """A real coordinator's FedICON job (embedded digits, 3 rounds: 2 encoder rounds, 1 classifier round, the
    schedule fitted to the job's length) is served; a torch-free device client joins, downloads and verifies the
    signed bundle and personalises on its unlabeled images."""
    import httpx

    from coordinator_proc import start
    from edge_sdk import EdgeClient, open_bundle
    from fl_server.data import load_dataset

    coord = start(tmp_path / "store", methods="FedICON", rounds=3)
    try:
        coord.wait_bundles(1)
        key = httpx.get(f"{coord.url}/v1/signing-key", timeout=10).json()["public_key"]
        with EdgeClient(coord.url, cache_dir=tmp_path / "cache", public_key=key) as client:
            bundle = client.download(client.join("FedICON").manifest, method="FedICON")
    finally:
        coord.stop()
    assert bundle.hyperparameters["encoder_rounds"] == 2 and "fedicon_step" in bundle.verified
    device = open_bundle(bundle)
    x = load_dataset("digits").x[-128:]
    before = device.predict(x)
    adaptation = device.personalize(x)
    assert adaptation.method == "FedICON" and adaptation.steps == 2  # 128 samples in batches of 64, one pass
    assert np.isfinite(adaptation.details["contrastive_loss"]).all()
    assert np.abs(device.predict(x) - before).max() > 1e-4
