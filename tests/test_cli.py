"""The fl-server console script, run as a user would (subprocess), on real data."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np


ROOT = Path(__file__).resolve().parents[1]


def fl_server(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fl_server.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=600)


def test_train_on_embedded_digits(tmp_path: Path) -> None:
    out = fl_server("train", "--dataset", "digits", "--method", "tent", "--rounds", "5", "--out", str(tmp_path),
                    "--no-progress")  # method names in any letter case
    assert out.returncode == 0, out.stderr
    assert "TENT on digits: best val" in out.stdout
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["val"] > 0.3
    assert (tmp_path / "checkpoint.npz").exists() and (tmp_path / "best.npz").exists()
    # another run refused on this directory leaves its run.json alone (export reads it to label best.npz)
    other = fl_server("train", "--dataset", "digits", "--method", "FedAvg", "--rounds", "5", "--out", str(tmp_path),
                      "--no-progress")
    assert other.returncode != 0 and "holds a checkpoint of a different run" in other.stderr
    assert json.loads((tmp_path / "run.json").read_text())["method"] == "TENT"


def test_data_info_and_clear_errors(tmp_path: Path, data_root: Path) -> None:
    ok = fl_server("data", "info", "mnist", "--dir", str(data_root))
    assert ok.returncode == 0 and "train: 60000 samples" in ok.stdout
    bad = fl_server("data", "info", "mnist", "--dir", str(tmp_path))
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "fl-server data fetch" in bad.stderr and "Traceback" not in bad.stderr


def test_data_fetch_defaults_to_the_data_root_and_fails_in_one_line(tmp_path: Path, data_root: Path) -> None:
    present = fl_server("data", "fetch", "mnist", env={"FL_DATA_DIR": str(data_root)})  # no --dir: $FL_DATA_DIR
    assert present.returncode == 0, present.stderr
    assert present.stdout.strip() == f"mnist: files in {data_root / 'mnist'}"
    cifar = fl_server("data", "fetch", "cifar10", "--dir", str(tmp_path))
    assert cifar.returncode == 2 and "Traceback" not in cifar.stderr
    assert cifar.stderr.startswith("error: cifar10 cannot be fetched automatically") and cifar.stderr.count("\n") == 1


def test_unknown_method_is_one_clear_line(tmp_path: Path) -> None:
    out = fl_server("train", "--method", "Nope", "--rounds", "1", "--out", str(tmp_path))
    assert out.returncode == 2 and "unknown method 'Nope'" in out.stderr
    assert "Building" not in out.stdout and "clients" not in out.stdout  # refused before the data set is built
    gpu = fl_server("train", "--device", "gpu", "--rounds", "1", "--out", str(tmp_path))
    assert gpu.returncode == 2 and gpu.stderr == "error: unknown device 'gpu'; use auto, cpu, cuda or cuda:N\n"


def test_bench_and_report_hand_over_to_the_lab_or_say_how_to_run_it(tmp_path: Path) -> None:
    """From a clone `fl-server bench|report` runs the lab (lab/, beside fl_server/); an installed wheel has no lab:
    one line says how to run it."""
    listed = fl_server("bench", "list", cwd=tmp_path)  # not the clone's root: lab/ found beside fl_server/
    assert listed.returncode == 0 and listed.stdout.startswith("upfl-table1"), listed.stderr
    shutil.copytree(ROOT / "fl_server", tmp_path / "fl_server", ignore=shutil.ignore_patterns("static", "__pycache__"))
    alone = fl_server("report", env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path)  # a package without lab/ beside it
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1, alone.stderr
    assert "not part of the installed package" in alone.stderr and "python -m lab report" in alone.stderr


def test_train_export_and_personalize_on_device(tmp_path: Path) -> None:
    """The `make run` chain on a short run: train -> export -> torch-free device personalisation."""
    trained = fl_server("train", "--dataset", "digits", "--method", "TENT", "--rounds", "8", "--out",
                        str(tmp_path / "run"), "--no-progress")
    assert trained.returncode == 0, trained.stderr
    exported = fl_server("export", str(tmp_path / "run"), "--out", str(tmp_path / "bundle"), "--int8")
    assert exported.returncode == 0 and (tmp_path / "bundle" / "manifest.json").exists(), exported.stderr
    # what forward_int8 costs the new clients, from the bundle; its float32 figure is training's received model
    line = next(s for s in exported.stdout.splitlines() if s.startswith("int8: "))
    received = json.loads(trained.stdout[trained.stdout.index("{\n"):trained.stdout.index("\n}") + 2])["received_test"]
    assert f", {received:.2f}% in float32 (" in line, (line, received)
    data = fl_server("device-data", str(tmp_path / "bundle"), "--kind", "clients", "--out", str(tmp_path / "new.npz"))
    assert data.returncode == 0, data.stderr
    assert data.stdout.strip() == f"the 10 new clients of TENT's run on digits (900 samples) written to {tmp_path}/new.npz"
    nowhere = fl_server("device-data", str(tmp_path / "nowhere"), "--kind", "clients", "--out", str(tmp_path / "x.npz"))
    assert nowhere.returncode == 2 and nowhere.stderr == (
        f"error: {tmp_path}/nowhere: no bundle there; give a bundle folder (fl-server export's --out), its "
        f"manifest.json or a coordinator's URL\n")
    import edge_sdk

    with np.load(tmp_path / "new.npz") as arrays, warnings.catch_warnings():  # its int8 figure: each client's device
        warnings.simplefilter("ignore")  # (the unsigned bundle's warning: checked on the example's stderr below)
        int8 = edge_sdk.open_bundle(tmp_path / "bundle", method="none", int8=True)
        x, y, offsets = arrays["x"], arrays["y"], arrays["offsets"]
        hits = [(int8.predict(x[lo:hi]).argmax(1) == y[lo:hi]).mean() for lo, hi in zip(offsets[:-1], offsets[1:])]
    assert f"new-client accuracy {100 * np.mean(hits):.2f}% with forward_int8 (" in line, (line, hits)
    device = subprocess.run([sys.executable, "examples/personalize_on_device.py", "--bundle", str(tmp_path / "bundle"),
                             "--data", str(tmp_path / "new.npz")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert device.returncode == 0, device.stderr
    assert "artifacts verified (sha256 only: no --public-key" in device.stdout
    assert "is not signed and no public key was given" in device.stderr  # an unsigned bundle is not silent
    assert "torch imported: False; fl_server imported: False" in device.stdout
    assert "(TENT on onnxruntime; " in device.stdout  # with what the safeguard decided on how many clients
    torch_acc = float(trained.stdout.split("new-client test ")[1].split("%")[0])  # at the best-val round
    summary = next(line for line in device.stdout.splitlines() if "new clients: mean accuracy" in line)
    device_acc = float(summary.split("-> ")[1].split("%")[0])
    assert abs(device_acc - torch_acc) < 0.5  # the device reproduces the torch TENT evaluation


def test_training_says_when_every_device_keeps_the_received_model(tmp_path: Path) -> None:
    """FedTTA++ declares the safeguard rule 'rollback': its devices adapt nothing, so the new-client number is the
    received model's, and the summary says so rather than pass it off as FedTTA++'s personalisation."""
    trained = fl_server("train", "--dataset", "digits", "--method", "FedTTA++", "--rounds", "2", "--out",
                        str(tmp_path / "run"), "--no-progress")
    assert trained.returncode == 0, trained.stderr
    assert '"safeguard": "rollback"' in trained.stdout
    assert ("(the received model: FedTTA++'s safeguard rule 'rollback' keeps it on every device; "
            "edge_sdk.open_bundle(..., safeguard=False) personalises)") in trained.stdout


def test_export_says_what_a_btfl_device_gets_after_its_labeled_personalisation(tmp_path: Path) -> None:
    """Training scores BTFL's received model only (a device personalises on its own labels); export measures the
    device: each new client personalises on a labeled random half of its samples and predicts the other half.
    The line's figure is what the torch-free SDK gives from the bundle on the samples device-data hands out."""
    import edge_sdk
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    trained = fl_server("train", "--dataset", "digits", "--method", "BTFL", "--rounds", "3", "--out",
                        str(tmp_path / "run"), "--no-progress")
    assert trained.returncode == 0 and "fl-server export measures a device's)" in trained.stdout, trained.stderr
    key = Ed25519PrivateKey.generate()  # a signed export measures the bundle it verified, and warns of nothing
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    exported = fl_server("export", str(tmp_path / "run"), "--out", str(tmp_path / "bundle"), "--signing-key",
                         str(tmp_path / "key.pem"))
    assert exported.returncode == 0 and "Warning" not in exported.stderr, exported.stderr
    line = next(s for s in exported.stdout.splitlines() if s.startswith("BTFL on a device: "))
    data = fl_server("device-data", str(tmp_path / "bundle"), "--kind", "clients", "--out", str(tmp_path / "new.npz"))
    assert data.returncode == 0, data.stderr
    with np.load(tmp_path / "new.npz") as arrays:
        x, y, offsets = arrays["x"], arrays["y"], arrays["offsets"]
    accuracies, rng = [], np.random.default_rng(0)  # a random half of each client's rows, drawn in client order
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        rows = lo + rng.permutation(hi - lo)
        learn, score = rows[:(hi - lo) // 2], rows[(hi - lo) // 2:]
        device = edge_sdk.open_bundle(tmp_path / "bundle", public_key=key.public_key().public_bytes_raw())
        device.personalize(x[learn], y[learn])
        accuracies.append((device.predict(x[score]).argmax(1) == y[score]).mean())
    assert f"samples, {100 * np.mean(accuracies):.2f}% on the other half (" in line, (line, accuracies)
    example = subprocess.run([sys.executable, "examples/personalize_on_device.py", "--bundle", str(tmp_path / "bundle"),
                              "--data", str(tmp_path / "new.npz"), "--public-key",
                              key.public_key().public_bytes_raw().hex()], capture_output=True, text=True, cwd=ROOT,
                             timeout=300)
    assert example.returncode == 0, example.stderr  # the device example learns and scores the same halves
    assert f"-> {100 * np.mean(accuracies):.2f}% (BTFL on onnxruntime; no safeguard)" in example.stdout, example.stdout


def test_a_labeled_half_is_drawn_at_random_not_the_first_rows() -> None:
    """A client's rows keep the data set's order (an image folder is read class by class): BTFL's export score
    learns on a random half of each client, which meets every class of a class-sorted client, and scores the rest."""
    from fl_server.export.device_scores import labeled_halves

    y = np.repeat([0, 1, 0, 1, 2], [30, 30, 25, 25, 1])  # two class-sorted clients of 60 and 50 rows, one of 1
    offsets = np.array([0, 60, 110, 111])
    halves = labeled_halves(offsets)
    assert len(halves) == 2  # a client of one row has no half to learn from
    for (learn, score), lo, hi in zip(halves, offsets[:-1], offsets[1:]):
        assert sorted([*learn, *score]) == list(range(lo, hi)) and len(learn) == (hi - lo) // 2
        assert set(y[learn]) == set(y[score]) == {0, 1}  # the first rows would hold class 0 alone


def test_export_without_a_run_is_one_clear_line(tmp_path: Path) -> None:
    out = fl_server("export", str(tmp_path), "--out", str(tmp_path / "b"))
    assert out.returncode == 2 and "run.json: not found" in out.stderr


def test_help_lists_the_registries_and_serve_shows_its_defaults() -> None:
    from fl_server.algorithms import ALGORITHMS
    from fl_server.models import MODELS

    train = fl_server("train", "--help")
    assert train.returncode == 0, train.stderr
    text = " ".join(train.stdout.split())  # argparse wraps lines
    assert all(m in text for m in ALGORITHMS) and "any letter case" in text
    assert "{" + ",".join(MODELS) + "}" in text and "{digits,mnist,fashion_mnist}" in text
    assert "default: the recipe's, FedAvg" in text and "(default: digits)" in text
    serve = " ".join(fl_server("serve", "--help").stdout.split())
    for default in ("(default: 127.0.0.1)", "(default: 8000)", "(default: runs/store)", "(default: info)",
                    "(default: 4096)", "(default: $FL_SERVE_ROUNDS or 60)"):
        assert default in serve, default
    assert "(default: None)" not in serve
    bad = fl_server("train", "--model", "resnet50")
    assert bad.returncode == 2 and "invalid choice: 'resnet50'" in bad.stderr
