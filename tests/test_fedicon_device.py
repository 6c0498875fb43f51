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
    from fl_server.export.run import export_run
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
    device = open_bundle(bundle, safeguard=False)  # the adaptation itself (FedICON's declared rule rolls back)
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
        np.testing.assert_allclose(value, tuned[name], atol=2e-5)  # float32 steps, onnxruntime vs torch kernels
        if name.startswith("head."):
            np.testing.assert_array_equal(value, device.bundle.weights("params")[name])


def test_the_devices_views_are_the_servers() -> None:
    """The device draws the server's uniforms bit for bit (keys over 2^32 included)."""
    from edge_sdk._fedicon import hash_uniform
    from fl_server.data.augment import hash_uniform as server_hash_uniform

    for key in (0, 7, 1_000_003 * 3 + 11 * 7_919, 2**33 + 5, 2**40 + 123_456_789):
        np.testing.assert_array_equal(hash_uniform(key, 6, 789),
                                      server_hash_uniform(torch.tensor(key), 6, 789).numpy())
    with pytest.raises(ValueError, match="key must be >= 0"):
        hash_uniform(-1, 2, 2)


def test_fedicon_bundles_the_device_cannot_run_are_refused(data_root: Path, tmp_path: Path) -> None:
    """Online TTA has no device graph (export says so); a bundle without its step is refused by the coordinator;
    a manifest with a bad batch size or no seed, or projection weights that do not fit the graph, by the device."""
    import json
    import shutil

    from edge_sdk import open_bundle
    from edge_sdk._errors import BundleError
    from fl_server.export.run import export_run
    from fl_server.recipes import train
    from fl_server.service.publish import PublishError, verify_bundle_dir

    recipe = _recipe(data_root)
    train(recipe, tmp_path / "run", device="cpu", progress=False, data_root=str(data_root))
    run_json = tmp_path / "run" / "run.json"
    trained = run_json.read_text()
    run = json.loads(trained)
    run["hyper"]["tta_mode"] = "online"  # the same training; online mode changes only the test time
    run_json.write_text(json.dumps(run))
    with pytest.raises(ValueError, match="FedICON's online TTA has no device graph: the device runs batch-mode"):
        export_run(tmp_path / "run", tmp_path / "online", data_root=str(data_root),
                   recipe=recipe.replace(hyper={**recipe.hyper, "tta_mode": "online"}))
    run_json.write_text(trained)
    bundle = export_run(tmp_path / "run", tmp_path / "bundle", data_root=str(data_root), recipe=recipe)

    def edited(name: str, edit) -> Path:  # type: ignore[no-untyped-def]
        copy = tmp_path / name
        shutil.copytree(bundle, copy)
        (copy / "manifest.sig").unlink(missing_ok=True)
        manifest = json.loads((copy / "manifest.json").read_text())
        edit(manifest, copy)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        return copy

    def drop_step(m: dict, root: Path) -> None:
        step = next(a for a in m["artifacts"] if a["name"] == "fedicon_step")
        m["artifacts"].remove(step)
        (root / step["file"]).unlink()

    def proj_float64(m: dict, root: Path) -> None:
        import hashlib

        entry = next(a for a in m["artifacts"] if a["name"] == "proj")
        with np.load(root / entry["file"], allow_pickle=False) as f:
            arrays = {k: f[k].astype(np.float64) for k in f.files}
        np.savez(root / entry["file"], **arrays)
        data = (root / entry["file"]).read_bytes()
        entry.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))

    with pytest.raises(PublishError, match="a FedICON bundle needs the artifacts fedicon_step; export it"):
        verify_bundle_dir(edited("no-step", drop_step), 1 << 28)
    for name, edit, message in [
            ("bad-batch", lambda m, _: m["hyperparameters"].update(tta_batch=1),
             r"the bundle's tta_batch must be an integer >= 2, got 1"),
            ("big-seed", lambda m, _: m.update(seed=2**40),
             r"the bundle's seed must be an integer in \[0, 2147483647\], got 1099511627776"),
            ("no-seed", lambda m, _: m.pop("seed"), r"the FedICON bundle's manifest has no 'seed'"),
            ("proj-f64", proj_float64, r"the bundle's proj weights do not fit its fedicon_step graph: weight "
                                       r"'0.weight' must be a float32 array, got float64")]:
        with pytest.raises(BundleError, match=message):
            open_bundle(edited(name, edit))


def test_a_batch_normalised_model_steps_with_its_views_statistics_as_on_the_server(data_root: Path,
                                                                                   tmp_path: Path) -> None:
    """BN: every device step normalises with its 2B views' statistics, as the server's step, also for a last
    batch under the bundle's ``min_batch`` and under the "ema" rule; the device's statistics stay as shipped."""
    import dataclasses

    from edge_sdk import open_bundle
    from fl_server.export.bundle import export_specs, write_bundle
    from fl_server.models.norm import BATCH_NORM_RULE
    from fl_server.export.steps import device_specs
    from fl_server.algorithms import build_algorithm
    from fl_server.data import load_dataset
    from fl_server.functional import make_forward
    from fl_server.models import build_model
    from fl_server.models.norm import calibrate, norm_mode, statistics

    x_all = load_dataset("mnist", str(data_root), split="test").x
    model = build_model("btfl_cnn_bn", (1, 28, 28), 10, seed=0)
    icon = build_algorithm("FedICON", model, 1, seed=3, tta_lr=0.05, tta_batch=16)
    state = icon.init_state(torch.float32, torch.device("cpu"))
    forward, xt = make_forward(model), torch.from_numpy(x_all[:512])
    calibrate(model, lambda xb: forward(state["params"], xb), (xt[i:i + 128] for i in range(0, 512, 128)))
    shipped = {k: state[k] for k in icon.device_weights}
    with torch.no_grad():
        graphs = export_specs(device_specs(icon, shipped), tmp_path / "graphs")
    weights = {k: {n: v.detach().numpy() for n, v in d.items()} for k, d in shipped.items()}
    weights["stats"] = {n: v.float().numpy() for n, v in statistics(model).items()}
    bundle = write_bundle(tmp_path / "bundle", graphs, weights, "FedICON", dataclasses.asdict(icon.hp),
                          extra={"seed": 3, "batch_norm": {**BATCH_NORM_RULE, "small_batch": "ema"}})
    x = x_all[1000:1040]  # batches of 16, 16 and 8 (under min_batch)
    device = open_bundle(bundle, safeguard=False)  # the adaptation itself
    assert device.personalize(x).steps == 3
    with norm_mode(model, "batch"):
        tuned = icon.personalize(state, torch.from_numpy(x))
    for name, value in tuned.items():
        np.testing.assert_allclose(device.weights[name], value.detach().numpy(), atol=1e-5)
    assert max(float(np.abs(device.weights[n] - weights["params"][n]).max()) for n in tuned) > 1e-3
    for name, value in device.runner.current_stats.items():
        np.testing.assert_array_equal(value, weights["stats"][name])


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
    device = open_bundle(bundle, safeguard=False)  # the adaptation itself (FedICON's declared rule rolls back)
    x = load_dataset("digits").x[-128:]
    before = device.predict(x)
    adaptation = device.personalize(x)
    assert adaptation.method == "FedICON" and adaptation.steps == 2  # 128 samples in batches of 64, one pass
    assert np.isfinite(adaptation.details["contrastive_loss"]).all()
    assert np.abs(device.predict(x) - before).max() > 1e-4
