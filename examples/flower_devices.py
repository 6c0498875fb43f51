"""Devices that hold their own images train on Flower; the coordinator serves the result; a new device personalises.

    python examples/flower_devices.py                   # Fashion-MNIST from $FL_DATA_DIR (or --data-dir)
    python examples/flower_devices.py --smoke           # a small size (CI: tests/test_examples_flower.py)
    python examples/flower_devices.py --server http://127.0.0.1:8000 --admin-token $FL_ADMIN_TOKEN

1. four nodes' own image folders (one subfolder per class, PNG) are written from real Fashion-MNIST training
   images, disjoint: ``node0`` .. ``node2`` train, ``node3`` is a new client that never trains;
2. a SuperLink and three SuperNodes start on loopback (:class:`loopback_flower.LocalDeployment`, beside this file: the
   commands of docs/flower.md, ``--insecure``, so loopback only), SuperNode k with ``--node-config
   "data='nodeK'"``: each one reads its own folder, nothing else;
3. ``flwr run examples/flower`` trains FedTTA, then BTFL (Fashion-MNIST's preset recipe on the zoo MLP); BTFL's
   local heads stay on the nodes, its global DLE is averaged from the nodes' uploads;
4. each run directory is exported (``fl-server export``'s function) and published to the coordinator (``POST
   /v1/bundles``, what ``fl-server publish`` does): a coordinator of its own (``fl-server serve``, started here,
   serving only what is published) or ``--server``;
5. the fourth node is a device with edge_sdk + numpy only (this file's ``device`` command, another process, no
   torch, no fl_server): it joins, downloads each bundle and checks its signature against the coordinator's key,
   personalises on half of its own images (FedTTA unlabeled; BTFL with their labels, its local head) and scores
   the other half, before (the received model) and after.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
METHODS = ("FedTTA", "BTFL")


def write_nodes(work: Path, data_dir: str | None, per_node: int, nodes: int = 4) -> list[Path]:
    """``nodes`` disjoint draws of ``per_node`` Fashion-MNIST training images, each an image folder
    ``work/nodeK/<label>/<index>.png`` (uint8 PNG, class folders named by label 0..9)."""
    from PIL import Image

    from fl_server.data import load_dataset

    ds = load_dataset("fashion_mnist", root=data_dir, split="train")
    idx = np.random.default_rng(0).permutation(len(ds.y))[:nodes * per_node].reshape(nodes, per_node)
    folders = []
    for k, rows in enumerate(idx):
        for i in rows:
            folder = work / f"node{k}" / str(int(ds.y[i]))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.round(ds.x[i, 0] * 255).astype(np.uint8)).save(folder / f"{i}.png")
        folders.append(work / f"node{k}")
    return folders


def train_on_flower(work: Path, data_dir: str | None, rounds: int, local_iterations: int) -> dict[str, Path]:
    """The three training nodes on a loopback Flower deployment; one ``flwr run`` per method. Returns the run
    directories."""
    from loopback_flower import LocalDeployment  # beside this file

    runs = {}
    env = {"FL_DATA_DIR": data_dir} if data_dir else {}
    with LocalDeployment(3, work, env=env, node_configs=[f"data='node{k}'" for k in range(3)]) as dep:
        for method in METHODS:
            t0 = time.perf_counter()
            output = dep.run({"dataset": "fashion_mnist", "method": method, "model": "mlp", "rounds": rounds,
                              "local-iterations": local_iterations, "batch-size": 32,
                              "run-dir": str(work / f"run-{method}")}, HERE / "flower", timeout=900)
            runs[method] = work / f"run-{method}"
            last = [ln.strip() for ln in output.splitlines() if f"round {rounds}/{rounds}" in ln]
            print(f"{method} on Flower, 3 SuperNodes ({time.perf_counter() - t0:.0f} s): "
                  f"{last[-1].split('round ', 1)[-1] if last else 'done'}", flush=True)
    return runs


def export_and_publish(runs: dict[str, Path], work: Path, server: str, token: str) -> None:
    from fl_server.export.run import export_run
    from fl_server.service.publish import upload

    for method, run_dir in runs.items():
        bundle = export_run(run_dir, work / f"bundle-{method}")
        out = upload(bundle, server, token)
        print(f"{method}: exported and published as bundle {out['bundle_id'][:12]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/flower-devices", help="the nodes' folders, runs, bundles, logs")
    ap.add_argument("--data-dir", default=os.environ.get("FL_DATA_DIR"), help="Fashion-MNIST IDX files")
    ap.add_argument("--per-node", type=int, default=600, help="images each node holds")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--local-iterations", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="120 images a node, 2 rounds of 10 steps")
    ap.add_argument("--server", default=None, help="a running coordinator (default: start one for this example)")
    ap.add_argument("--admin-token", default=os.environ.get("FL_ADMIN_TOKEN"), help="with --server")
    ap.add_argument("--json", default=None, help="the device's summary (JSON)")
    args = ap.parse_args()
    if args.smoke:
        args.per_node, args.rounds, args.local_iterations = 120, 2, 10
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    folders = write_nodes(work, args.data_dir, args.per_node)
    print(f"4 nodes, {args.per_node} images each: {', '.join(f.name for f in folders)} (node3: the new client)",
          flush=True)
    runs = train_on_flower(work, args.data_dir, args.rounds, args.local_iterations)
    from custom_model import coordinator  # beside this file: --server, or a coordinator serving what is published

    proc = coordinator(args, work)
    try:
        import httpx

        export_and_publish(runs, work, args.server, args.admin_token)
        key = httpx.get(f"{args.server}/v1/signing-key", timeout=10).json()["public_key"]
        cmd = [sys.executable, str(Path(__file__).resolve()), "device", "--server", args.server, "--public-key", key,
               "--images", str(folders[3]), "--cache", str(work / "device-cache"), *(["--json", args.json]
                                                                                    if args.json else [])]
        return subprocess.run(cmd, cwd=work).returncode
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


# ------------------------------------------------------------------ the fourth node: edge_sdk + numpy, no torch
def read_folder(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """An image folder as the bundle's raw images (float32 [N, 1, 28, 28] in [0, 1], the preset's form) and labels."""
    from PIL import Image

    files = sorted(folder.glob("*/*.png"))
    x = np.stack([np.asarray(Image.open(f), np.float32)[None] / 255 for f in files])
    return x, np.array([int(f.parent.name) for f in files])


def device(argv: list[str]) -> int:
    import edge_sdk

    ap = argparse.ArgumentParser(prog="flower_devices.py device", description="the new client, on the device")
    ap.add_argument("--server", required=True)
    ap.add_argument("--public-key", required=True, help="the coordinator's signing key (hex), pinned")
    ap.add_argument("--images", required=True, help="the device's image folder (class subfolders: the labels)")
    ap.add_argument("--cache", default="device-cache")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    x, y = read_folder(Path(args.images))
    order = np.random.default_rng(0).permutation(len(y))
    own, held = order[:len(y) // 2], order[len(y) // 2:]  # personalise on one half, score on the other
    results = []
    with edge_sdk.EdgeClient(args.server, cache_dir=args.cache, public_key=args.public_key) as client:
        for method in METHODS:
            info = client.join(method)
            dev = edge_sdk.open_bundle(client.download(info.manifest, method=method), client=client)
            before = float((edge_sdk.open_bundle(dev.bundle, method="none").predict(x[held]).argmax(1)
                            == y[held]).mean())
            result = dev.personalize(x[own], y[own] if method == "BTFL" else None)
            after = float((dev.predict(x[held]).argmax(1) == y[held]).mean())
            decision = result.safeguard  # the bundle's label-free rule (None for BTFL's labeled stream)
            results.append({"method": method, "bundle_id": info.manifest["bundle_id"], "steps": result.steps,
                            "safeguard": None if decision is None else decision.action,
                            "accuracy_received": round(100 * before, 2),
                            "accuracy_personalized": round(100 * after, 2)})
            print(f"device (node3), {method}: personalised on {len(own)} of its images "
                  f"({'with' if method == 'BTFL' else 'without'} labels, {result.steps} step(s)"
                  f"{'' if decision is None else '; ' + decision.message}); accuracy on its other {len(held)}: "
                  f"{100 * before:.1f}% (received) -> {100 * after:.1f}% (personalised)", flush=True)
    summary = {"results": results, "torch_imported": "torch" in sys.modules,
               "fl_server_imported": "fl_server" in sys.modules}
    print(f"device: torch imported: {summary['torch_imported']}; fl_server imported: {summary['fl_server_imported']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(device(sys.argv[2:]) if sys.argv[1:2] == ["device"] else main())
