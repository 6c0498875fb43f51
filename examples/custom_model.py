"""Your own model and data, end to end: a ResNet-style net of your own, trained from an image folder with TENT and
FedTTA, exported, published to a running coordinator; then a torch-free device joins, personalises on raw images
and streams them.

    python examples/custom_model.py                        # starts a coordinator of its own, then stops it
    python examples/custom_model.py --server http://127.0.0.1:8000 --admin-token $FL_ADMIN_TOKEN
    python examples/custom_model.py --device-python sdk-venv/bin/python   # the device in a venv of edge_sdk alone

1. an image folder (one subfolder per class, PNG) is written from the real Fashion-MNIST files
   (``--data-dir`` or ``$FL_DATA_DIR``), ``--per-class`` training images per class;
2. :func:`resnet` is the user's model: residual blocks with GroupNorm and a linear head ``fc``; the recipes
   :func:`tent_recipe` and :func:`fedtta_recipe` put it together with the folder, a Dirichlet federation and
   the preprocessing (uint8 -> [0, 1] -> mean/std), which goes into the bundle manifest;
3. each recipe is trained (``fl_server.recipes.train``) and exported (``fl_server.export.run.export_run``, the same as
   ``fl-server export``), and the bundle is published to the coordinator (``POST /v1/bundles``, what
   ``fl-server publish --server`` does), which serves it signed with its key;
4. the device (``examples/custom_model_device.py``, edge_sdk + numpy only) gets raw uint8 images of Fashion-MNIST's
   *test* split (images no client trained on), joins for each method, verifies the signature, personalises on
   an unlabeled warm-up window and streams the rest one image at a time.

``fl-server export`` of these runs rebuilds the model from this file (``run.json`` names
``examples/custom_model.py:tent_recipe``), with the image folder named by ``$CUSTOM_MODEL_IMAGES``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
IMAGES_ENV = "CUSTOM_MODEL_IMAGES"  # where the recipes find the image folder
NUM_CLASSES = 10


# ---------------------------------------------------------------------------------------------- the user's model
def resnet(input_shape: tuple[int, int, int], num_classes: int):  # type: ignore[no-untyped-def]
    """A small ResNet: a strided stem, a residual block that halves the resolution again (projection shortcut),
    GroupNorm throughout, global average pooling and a linear head ``fc`` (the recipe names it)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.norm1 = nn.GroupNorm(4, cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.norm2 = nn.GroupNorm(4, cout)
            self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(4, cout))

        def forward(self, x):  # type: ignore[no-untyped-def]
            h = self.norm1(self.conv1(x)).relu()
            return (self.norm2(self.conv2(h)) + self.skip(x)).relu()

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(input_shape[0], 16, 3, 2, 1, bias=False), nn.GroupNorm(4, 16), nn.ReLU())
            self.block = Block(16, 32, 2)
            self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.fc = nn.Linear(32, num_classes)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.fc(self.pool(self.block(self.stem(x))))

    return ResNet()


# ---------------------------------------------------------------------------------------------- the recipes
def _recipe(method: str, hyper: dict, rounds: int, local_iterations: int):  # type: ignore[no-untyped-def]
    from fl_server.recipes import DataSpec, Federation, ModelSpec, Preprocess, Recipe

    folder = os.environ.get(IMAGES_ENV)
    if not folder:
        raise RuntimeError(f"set ${IMAGES_ENV} to the image folder (examples/custom_model.py writes one)")
    return Recipe(model=ModelSpec(resnet, head="fc", name="small-resnet-gn"),
                  data=DataSpec.from_image_folder(folder),
                  federation=Federation(partition="dirichlet", alpha=0.5, num_clients=10, new_fraction=0.2),
                  method=method, hyper=hyper, rounds=rounds, local_iterations=local_iterations, batch_size=32,
                  preprocess=Preprocess(layout="NHWC", scale=1 / 255, mean=(0.286,), std=(0.353,)))


def tent_recipe():  # type: ignore[no-untyped-def]
    """TENT: FedAvg training; the device takes one entropy-minimisation step on every weight."""
    return _recipe("TENT", {"lr": 0.3, "tent_lr": 0.01, "steps": 1}, rounds=10, local_iterations=10)


def fedtta_recipe():  # type: ignore[no-untyped-def]
    """FedTTA: a meta-learned adaptation step the device takes on its unlabeled data (meta-training costs
    several times a FedAvg round: fewer, shorter rounds)."""
    return _recipe("FedTTA", {}, rounds=4, local_iterations=5)


# ---------------------------------------------------------------------------------------------- the steps
def write_image_folder(out: Path, data_dir: str | None, per_class: int) -> Path:
    """``per_class`` Fashion-MNIST training images per class as PNGs in ``out/<class>/``."""
    from PIL import Image

    from fl_server.data import load_dataset

    ds = load_dataset("fashion_mnist", root=data_dir, split="train")
    rng = np.random.default_rng(0)
    for c in range(NUM_CLASSES):
        (out / f"class_{c}").mkdir(parents=True, exist_ok=True)
        for i in rng.choice(np.flatnonzero(ds.y == c), per_class, replace=False):
            Image.fromarray(np.round(ds.x[i, 0] * 255).astype(np.uint8), mode="L").save(out / f"class_{c}" / f"{i}.png")
    return out


def write_device_images(out: Path, data_dir: str | None, n: int) -> Path:
    """Raw uint8 NHWC test images (no client trained on them) and their labels, for the device."""
    from fl_server.data import load_dataset

    ds = load_dataset("fashion_mnist", root=data_dir, split="test")
    idx = np.random.default_rng(1).choice(len(ds.y), n, replace=False)
    np.savez(out, x=np.round(ds.x[idx].transpose(0, 2, 3, 1) * 255).astype(np.uint8), y=ds.y[idx])
    return out


def train_export_publish(name: str, work: Path, server: str, token: str) -> dict:
    """Train the recipe ``name`` of this file, export its bundle, publish it to ``server``."""
    from fl_server.export.run import export_run
    from fl_server.recipes import load_recipe, train
    from fl_server.service.publish import upload

    recipe = load_recipe(f"{Path(__file__).resolve()}:{name}")
    t0 = time.perf_counter()
    record = train(recipe, work / "runs" / name, progress=False)
    bundle = export_run(work / "runs" / name, work / "bundles" / name)
    out = upload(bundle, server, token)
    print(f"{recipe.method}: trained {recipe.rounds} rounds on {len(recipe.data.y)} images of your folder (best "
          f"validation {record['val']:.1f}%), exported and published as bundle {out['bundle_id'][:12]} "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return out


def start_coordinator(work: Path, token: str) -> tuple[subprocess.Popen, str]:
    """A coordinator of its own (``fl-server serve``) that trains nothing: it serves what is published."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FL_SERVE_DEFAULT_METHODS": "", "FL_ADMIN_TOKEN": token,
           "FL_SERVE_ENROLLMENT": "open"}  # loopback only: the device joins without an enrollment token
    log = open(work / "coordinator.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "fl_server.cli", "serve", "--port", str(port), "--store",
                             str(work / "store"), "--log-level", "warning"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=HERE.parent)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        if proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited; see {work / 'coordinator.log'}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the coordinator did not come up")


def coordinator(args: argparse.Namespace, work: Path) -> subprocess.Popen | None:
    """``args.server`` with ``args.admin_token`` to publish to, or, without ``--server``, a coordinator of its own
    (returned, to stop; ``args`` updated with its URL and token)."""
    if args.server is None:
        args.admin_token = args.admin_token or "example-admin-token-" + os.urandom(8).hex()
        proc, args.server = start_coordinator(work, args.admin_token)
        print(f"coordinator at {args.server} (store {work / 'store'})", flush=True)
        return proc
    if not args.admin_token:
        raise SystemExit("error: --server needs --admin-token (or $FL_ADMIN_TOKEN) to publish")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default=None, help="a running coordinator (default: start one for this example)")
    ap.add_argument("--admin-token", default=os.environ.get("FL_ADMIN_TOKEN"), help="with --server")
    ap.add_argument("--work", default="runs/custom-model", help="image folder, runs, bundles, the device's data")
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST IDX files (default: $FL_DATA_DIR)")
    ap.add_argument("--per-class", type=int, default=60, help="training images per class in the folder")
    ap.add_argument("--device-images", type=int, default=160, help="raw test images the device gets")
    ap.add_argument("--device-python", default=sys.executable,
                    help="the device's interpreter (e.g. a venv with edge_sdk alone)")
    ap.add_argument("--json", default=None, help="the device's summary (JSON)")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ[IMAGES_ENV] = str(write_image_folder(work / "images", args.data_dir, args.per_class))
    print(f"image folder: {os.environ[IMAGES_ENV]} ({NUM_CLASSES} classes x {args.per_class} PNGs)", flush=True)
    proc = coordinator(args, work)
    try:
        import httpx

        published = [train_export_publish(name, work, args.server, args.admin_token)
                     for name in ("tent_recipe", "fedtta_recipe")]
        key = httpx.get(f"{args.server}/v1/signing-key", timeout=10).json()["public_key"]
        assert all(p["signing_key"] == key for p in published)
        data = write_device_images(work / "device.npz", args.data_dir, args.device_images)
        cmd = [args.device_python, str(HERE / "custom_model_device.py"), "--server", args.server, "--public-key", key,
               "--data", str(data), "--cache", str(work / "device-cache"), "--methods", "TENT", "FedTTA"]
        if args.json:
            cmd += ["--json", args.json]
        print(f"device: {' '.join(cmd[:2])} ...", flush=True)
        return subprocess.run(cmd, cwd=work).returncode
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
