"""``fl-server``: train, bench, export, publish, report, data, serve (the coordinator)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from fl_server.data.errors import FetchError


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1 ...")
    p.add_argument("--mode", default="auto", choices=("auto", "vmap", "loop"),
                   help="step same-architecture clients together (vmap) or one by one (reference loop); "
                        "auto: vmap on CUDA and for conv-free models on CPU")
    p.add_argument("--data-dir", default=None,
                   help="directory with the IDX files (default: $FL_DATA_DIR, else ~/.cache/fl-edge/data)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def train_recipe(args: argparse.Namespace):  # -> fl_server.recipes.Recipe
    """``--recipe FILE.py[:NAME]`` or the built-in recipe of ``--dataset``, with the flags' changes."""
    import dataclasses

    from fl_server.recipes import load_recipe
    from fl_server.recipes.presets import builtin_recipe
    from fl_server.recipes.recipe import refuse_idle_overrides

    if args.recipe is None:
        changes = {k: v for k, v in {"rounds": args.rounds, "num_clients": args.clients, "model": args.model}.items()
                   if v is not None}
        return builtin_recipe(args.dataset, args.method or "FedAvg", args.data_dir, **changes)
    recipe = load_recipe(args.recipe)
    changes = {k: v for k, v in {"rounds": args.rounds, "model": args.model}.items() if v is not None}
    if args.method is not None:
        changes.update(method=args.method, hyper={})  # the recipe's hyperparameters belong to its own method
    if args.clients is not None:
        changes["federation"] = dataclasses.replace(recipe.federation, num_clients=args.clients)
    recipe = recipe.replace(**changes) if changes else recipe
    return refuse_idle_overrides(recipe, {"num_clients"} if args.clients is not None else set())


def cmd_train(args: argparse.Namespace) -> int:
    from fl_server.diagnostics import scored_model
    from fl_server.recipes import federate, train

    recipe = train_recipe(args)  # built and checked before any data is read: a mistake fails at once
    print(federate(recipe, args.seed, args.data_dir).summary())
    record = train(recipe, Path(args.out), args.seed, args.device, not args.no_progress, args.mode, args.data_dir)
    record.pop("curve")
    print(json.dumps(record, indent=1))
    test = "n/a" if record["test"] is None else f"{record['test']:.2f}%"
    subject = scored_model(record["test_of"], record["safeguard"], recipe.method)
    if record["test"] is not None and subject:
        test += f" ({subject})"
    print(f"{recipe.method} on {recipe.data.name}: best val {record['val']:.2f}% at round {record['best_round']}, "
          f"new-client test {test}, {record['wall_s']:.1f}s on {record['device']}; run files in {args.out} "
          f"(bundle: fl-server export {args.out} --out BUNDLE)")
    for line in (record["warning"], record["adaptation_note"]):
        if line:
            print(line)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fl_server import rundir
    from fl_server.algorithms import ALGORITHMS
    from fl_server.export.device_scores import export_scores
    from fl_server.export.run import export_run
    from fl_server.signing import ManifestSigner

    signer = ManifestSigner.from_pem(Path(args.signing_key)) if args.signing_key else None
    path = export_run(args.run_dir, args.out, int8=args.int8, signer=signer)
    how = f"load_bundle(dir, public_key='{signer.public_hex}')" if signer else "load_bundle (unsigned: hashes only)"
    print(f"bundle written to {path} (verify and use it on a device with edge_sdk.{how}; fl-server publish serves "
          "it as a release numbered by the coordinator)")
    run = rundir.read_run(args.run_dir)
    if run.get("warning"):  # recorded by fl-server train (fl_server.diagnostics)
        print(run["warning"])
    # what training could not score, measured on the bundle by the SDK: a labeled personalisation, int8's cost
    device_labels = bool(getattr(ALGORITHMS.get(run.get("method", "")), "device_labels", False))
    for line in export_scores(path, device_labels, args.int8, args.data_dir,
                              signer.public_hex if signer else None):
        print(line)
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    import os

    from fl_server.service import publish

    root = Path(args.bundle)
    if not (root / "manifest.json").is_file():
        raise FileNotFoundError(f"{root / 'manifest.json'}: not found (is {root} a bundle directory from fl-server export?)")
    if args.server:
        token = args.admin_token or os.environ.get("FL_ADMIN_TOKEN")
        if not token:
            raise ValueError("--server needs the admin token: --admin-token or $FL_ADMIN_TOKEN")
        out = publish.upload(root, args.server, token)
        print(f"published {out['method']} bundle {out['bundle_id']} to {args.server} as release {out['version']}; "
              f"served signed with its key {out['signing_key']}")
        return 0
    from fl_server.service.artifacts import ArtifactStore
    from fl_server.service.config import ServiceConfig, load_plugins
    from fl_server.service.store import Store
    from fl_server.signing import ManifestSigner

    load_plugins()  # the methods the coordinator of this store serves from its FL_SERVE_PLUGINS
    store_dir = Path(args.store)
    store = Store(store_dir / "coordinator.sqlite3")
    try:
        out = publish.publish_dir(store, ArtifactStore(store_dir / "objects"), root,
                                  ServiceConfig(store_dir=store_dir).max_bundle_bytes)
    finally:
        store.close()
    key = ManifestSigner.load_or_create(store_dir).public_hex
    print(f"published {out['method']} bundle {out['bundle_id']} into {store_dir} as release {out['version']}; "
          f"fl-server serve --store {store_dir} serves it signed with {key} (a coordinator already running on this store serves it after "
          "a restart; publish to it with --server URL instead)")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    """Revoke an enrollment token (and by default its clients) or one client at a running coordinator."""
    import os

    import httpx

    token = args.admin_token or os.environ.get("FL_ADMIN_TOKEN")
    if not token:
        raise ValueError("revoke needs the admin token: --admin-token or $FL_ADMIN_TOKEN")
    if args.enrollment:
        path, params = f"/v1/enrollments/{args.enrollment}", {"clients": str(not args.keep_clients).lower()}
    else:
        path, params = f"/v1/clients/{args.client}", {}
    try:
        r = httpx.delete(args.server.rstrip("/") + path, params=params, timeout=30,
                         headers={"Authorization": f"Bearer {token}"})
    except httpx.TransportError as exc:
        raise ValueError(f"{args.server}: unreachable ({exc})") from None
    if r.status_code != 200:
        raise ValueError(f"DELETE {path}: HTTP {r.status_code}: {r.text[:300]}")
    out = r.json()
    print(f"revoked {path.split('/')[2][:-1]} {out['id']}: {out['clients_revoked']} client(s) revoked, "
          f"{out['dles_removed']} DLE(s) removed from the global DLE")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from fl_server.data import fetch, load_dataset
    from fl_server.data.datasets import resolve_root

    if args.action == "fetch":
        path = fetch(args.name, resolve_root(args.dir))
        from fl_server.data.fetch import NO_FETCH_NEEDED

        key = args.name.strip().lower().replace("-", "_")
        print(NO_FETCH_NEEDED[key] if key in NO_FETCH_NEEDED else f"{args.name}: files in {path}")
        return 0
    for split in ("train", "test"):
        ds = load_dataset(args.name, root=args.dir, split=split)
        counts = np.bincount(ds.y, minlength=ds.num_classes).tolist()
        print(f"{args.name} {split}: {len(ds)} samples, images {list(ds.x.shape[1:])}, class counts {counts}")
    return 0


def _served_manifest(url: str, method: str | None, wait: float) -> dict:
    """The coordinator's manifest for ``method`` (any letter case; 'none': the default bundle), waiting up to
    ``wait`` seconds while it is still training (503)."""
    import time

    import httpx

    from fl_server.algorithms import canonical_method

    method = None if method is None or method.lower() == "none" else canonical_method(method)
    deadline, told = time.monotonic() + wait, False
    while True:
        try:
            r = httpx.get(f"{url.rstrip('/')}/v1/manifest", params={"method": method} if method else None, timeout=30)
        except httpx.TransportError as exc:
            r, problem = None, f"unreachable ({exc})"
        if r is not None and r.status_code == 200:
            return r.json()
        if r is not None:
            problem = f"HTTP {r.status_code}: {r.text[:200]}"
        if (r is not None and r.status_code != 503) or time.monotonic() > deadline:
            raise ValueError(f"{url}: no manifest for {method or 'the default method'} ({problem})")
        if not told:
            print(f"waiting for the coordinator's {method or 'default'} bundle (up to {wait:.0f}s) ...", flush=True)
            told = True
        time.sleep(2)


def cmd_device_data(args: argparse.Namespace) -> int:
    from fl_server import device_samples as ds

    if args.source.startswith(("http://", "https://")):
        manifest = _served_manifest(args.source, args.method, args.wait)
        if manifest.get("recipe") and not args.recipe:  # a server must not pick which local file runs here
            raise ValueError(f"{args.source} serves a bundle of the recipe {manifest['recipe']}; a coordinator's "
                             f"manifest does not choose a Python file to run on this machine: pass --recipe "
                             f"FILE.py:NAME, the recipe file you trust")
    else:
        path = Path(args.source)
        path = path / "manifest.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"{args.source}: no bundle there; give a bundle folder (fl-server export's --out), its "
                             f"manifest.json or a coordinator's URL")
        manifest = json.loads(path.read_text())
    if args.recipe:
        manifest = {**manifest, "recipe": args.recipe}
    if args.kind == "stream":
        arrays = ds.stream_samples(manifest, args.client, args.warmup, args.per_phase, args.corruption,
                                   args.severity, args.seed, args.data_dir)
    else:
        arrays = ds.client_samples(manifest, args.data_dir)
    out = ds.write_samples(Path(args.out), arrays)
    run = f"{manifest['method']}'s run on {manifest['dataset']}"
    print(f"new client {args.client}'s warm-up window and stream, of {run}, written to {out}" if args.kind == "stream"
          else f"the {len(arrays['offsets']) - 1} new clients of {run} ({len(arrays['y'])} samples) written to {out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from fl_server.service import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")

    import torch

    # hypernetwork forwards run on one worker thread with one intra-op thread: a burst of generates must not
    # take every core from the event loop (training runs in subprocesses with their own thread budget)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process (the CLI called twice, e.g. from a test)
        pass
    tls = _tls_files(args)
    overrides = {k: v for k, v in {"default_rounds": args.rounds, "workers": args.workers}.items() if v is not None}
    app = create_app(args.store, **overrides)
    scheme = "https" if tls else "http"
    print(f"coordinator on {scheme}://{args.host}:{args.port} (store {args.store}; dashboard at /, API docs at /docs)")
    if not tls and args.host not in ("127.0.0.1", "localhost", "::1"):
        print("WARNING: plain HTTP on a non-loopback address: bearer tokens travel in clear; pass --tls-cert and "
              "--tls-key (or terminate TLS in a proxy in front)", file=sys.stderr, flush=True)
    signer = app.state.service.signer
    print(f"manifest signing key (Ed25519; pin it on devices: EdgeClient(url, public_key=...)): {signer.public_hex}"
          f" (from {signer.source})", flush=True)
    from fl_server.service.accept import batch_accept
    from fl_server.service.server import ServerLimits, uvicorn_options

    # HTTP limits (deadlines, head size, connection cap, trusted proxies) and the loop (uvloop where installed):
    # FL_SERVE_* (docs/coordinator.md); a burst of connections is accepted in one pass (fl_server/service/accept.py)
    limits = ServerLimits()
    options = uvicorn_options(limits)
    options["loop"] = batch_accept(options["loop"], handshake_timeout_s=limits.head_timeout_s)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            backlog=args.backlog, **options, **tls)  # configures uvicorn's loggers
    from fl_server.service.logging_limits import install

    install()  # the same line repeated under attack is collapsed (FL_SERVE_LOG_RATE / _BURST)
    uvicorn.Server(config).run()
    return 0


def _tls_files(args: argparse.Namespace) -> dict[str, str]:
    """uvicorn's ssl_certfile / ssl_keyfile from --tls-cert / --tls-key (or $FL_TLS_CERT / $FL_TLS_KEY): both
    or neither, each a readable file; {} for plain HTTP."""
    import os

    cert = args.tls_cert or os.environ.get("FL_TLS_CERT") or None
    key = args.tls_key or os.environ.get("FL_TLS_KEY") or None
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together (the certificate chain and its private key, PEM)")
    if cert is None:
        return {}
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file")
    return {"ssl_certfile": cert, "ssl_keyfile": key}


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` where a default exists and the help text does not already explain it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from fl_server.algorithms import ALGORITHMS  # the registries (imports torch: ~2 s, also for --help)
    from fl_server.models import MODELS

    methods = ", ".join(ALGORITHMS)
    parser = argparse.ArgumentParser(prog="fl-server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_parser(name: str, **kwargs: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, formatter_class=DefaultsFormatter, **kwargs)

    p = add_parser("train", help="train a recipe: your own (--recipe FILE.py:NAME) or a built-in one "
                                 "(default: FedAvg on the embedded digits)")
    p.add_argument("--recipe", default=None, metavar="FILE.py[:NAME]",
                   help="a Recipe defined in a Python file (NAME defaults to `recipe`); the flags below change it")
    p.add_argument("--dataset", default="digits", choices=("digits", "mnist", "fashion_mnist"),
                   help="built-in recipe (UPFL Table 1's protocol) when no --recipe is given")
    p.add_argument("--method", default=None, metavar="METHOD",
                   help=f"one of {methods} (any letter case: --method tent); default: the recipe's, FedAvg")
    p.add_argument("--model", default=None, choices=MODELS, help="model from the zoo (default: the recipe's)")
    p.add_argument("--rounds", type=int, default=None, help="communication rounds (default: the recipe's)")
    p.add_argument("--clients", type=int, default=None, help="number of clients (default: the protocol's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the partition, initialisation and sampling")
    p.add_argument("--out", default="runs/train", help="run directory (metrics.jsonl, checkpoints; resumable)")
    add_run_flags(p)
    p.set_defaults(func=cmd_train)

    for name, what in (("bench", "run a named experiment"), ("report", "regenerate docs/RESULTS.md")):
        p = sub.add_parser(name, add_help=False, help=f"{what} (the lab, in a clone: python -m lab {name} ...)")
        p.add_argument("args", nargs=argparse.REMAINDER)

    p = add_parser("export", help="export a trained run's best model and device steps as an ONNX bundle")
    p.add_argument("run_dir", help="run directory of `fl-server train --out` (holds run.json and best.npz)")
    p.add_argument("--out", required=True, help="bundle directory to write (replaced atomically)")
    p.add_argument("--int8", action="store_true", help="also ship forward_int8 (frozen, int8-quantized received model) "
                                                       "and print its new-client accuracy against float32")
    p.add_argument("--data-dir", default=None, help="where the run's data set is, for what is measured on the new "
                                                    "clients (--int8; BTFL's labeled personalisation) (default: "
                                                    "$FL_DATA_DIR, else ~/.cache/fl-edge/data)")
    p.add_argument("--signing-key", default=None,
                   help="Ed25519 private key (PEM, e.g. a coordinator store's signing_key.pem): write manifest.sig, "
                        "a signed candidate without a version (load_bundle verifies it; devices take releases only "
                        "from the coordinator, which numbers it when it is published)")
    p.set_defaults(func=cmd_export)

    p = add_parser("publish", help="verify a bundle exported elsewhere and serve it from a coordinator")
    p.add_argument("bundle", help="bundle directory (fl-server export --out)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", help="the coordinator's state directory (fl-server serve --store)")
    where.add_argument("--server", help="a running coordinator's URL (POST /v1/bundles with the admin token)")
    p.add_argument("--admin-token", default=None, help="with --server (default: $FL_ADMIN_TOKEN)")
    p.set_defaults(func=cmd_publish)

    p = add_parser("revoke", help="revoke an enrollment token or a client at a running coordinator (admin)")
    p.add_argument("--server", required=True, help="the coordinator's URL")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--enrollment", help="an enrollment id (POST /v1/enrollments): no further join spends it")
    what.add_argument("--client", help="a client id: its token stops working and its DLE leaves the global DLE")
    p.add_argument("--keep-clients", action="store_true",
                   help="with --enrollment: leave the clients that joined with it (default: revoke them too)")
    p.add_argument("--admin-token", default=None, help="default: $FL_ADMIN_TOKEN")
    p.set_defaults(func=cmd_revoke)

    p = add_parser("data", help="obtain or inspect data sets")
    p.add_argument("action", choices=("fetch", "info"))
    p.add_argument("name", choices=("mnist", "fashion_mnist", "digits", "cifar10"))
    p.add_argument("--dir", default=None,
                   help="target/source directory (default: $FL_DATA_DIR, else ~/.cache/fl-edge/data)")
    p.set_defaults(func=cmd_data)

    p = add_parser("device-data", help="write a device's samples (.npz) for a bundle's protocol, for the "
                                           "device examples")
    p.add_argument("source", help="a bundle directory, its manifest.json, or a coordinator URL")
    p.add_argument("--method", default=None, help="with a URL: the method whose bundle (default: the default one)")
    p.add_argument("--wait", type=float, default=0, help="with a URL: seconds to wait while the bundle is training")
    p.add_argument("--kind", choices=("stream", "clients"), default="stream",
                   help="stream: one new client's warm-up + a three-phase stream; clients: every new client")
    p.add_argument("--out", required=True, help=".npz to write")
    p.add_argument("--client", type=int, default=0, help="stream: which held-out new client")
    p.add_argument("--warmup", type=int, default=32, help="stream: warm-up samples")
    p.add_argument("--per-phase", type=int, default=200, help="stream: samples per phase (at most)")
    p.add_argument("--corruption", default="gaussian_noise", help="stream: the corrupted phase's corruption")
    p.add_argument("--severity", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--recipe", default=None, help="FILE.py[:NAME]: where the recipe the bundle names is (default: "
                                                  "its FILE.py:NAME in the working directory; required with a URL "
                                                  "whose bundle names a recipe file)")
    p.set_defaults(func=cmd_device_data)

    p = add_parser("serve", help="run the coordinator API (trains the default bundles when the store is empty)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--store", default="runs/store", help="state directory: SQLite, artifacts, job runs")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of the default jobs (default: $FL_SERVE_ROUNDS or 60)")
    p.add_argument("--workers", type=int, default=None, help="concurrent training jobs (default: $FL_SERVE_WORKERS or 1)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's log level")
    p.add_argument("--backlog", type=int, default=4096, help="listen backlog (a burst of device connections)")
    p.add_argument("--tls-cert", default=None, help="serve HTTPS: certificate chain, PEM (default: $FL_TLS_CERT)")
    p.add_argument("--tls-key", default=None,
                   help="serve HTTPS: the certificate's private key, PEM (default: $FL_TLS_KEY)")
    p.set_defaults(func=cmd_serve)
    return parser


def run_lab(argv: list[str]) -> int:
    """``fl-server bench|report ...``: the lab's ``python -m lab bench|report ...``. The lab (lab/) lives in the
    repository beside fl_server/, not in the installed package: found on the path or beside an editable install."""
    try:
        from lab.cli import main as lab_main
    except ModuleNotFoundError as exc:
        clone = Path(__file__).resolve().parents[1]
        if exc.name != "lab" or not (clone / "lab" / "cli.py").is_file():
            print(f"error: `fl-server {argv[0]}` runs the results lab (lab/), which is not part of the installed "
                  f"package: from the root of a clone of the repository run `python -m lab {argv[0]} ...`",
                  file=sys.stderr)
            return 2
        sys.path.insert(0, str(clone))  # an editable install from a clone: lab/ sits beside fl_server/
        from lab.cli import main as lab_main
    return lab_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["bench"], ["report"]):
        return run_lab(argv)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FetchError) as exc:  # data/config/recipe errors: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
