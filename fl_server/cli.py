"""``fl-server``: train, bench, export, report, data, serve (the coordinator)."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

from fl_server.data.errors import FetchError


def _add_run_flags(p: argparse.ArgumentParser) -> None:
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
    return recipe.replace(**changes) if changes else recipe


def cmd_train(args: argparse.Namespace) -> int:
    from fl_server.recipes import federate, train

    recipe = train_recipe(args)  # built and checked before any data is read: a mistake fails at once
    print(federate(recipe, args.seed, args.data_dir).summary())
    record = train(recipe, Path(args.out), args.seed, args.device, not args.no_progress, args.mode, args.data_dir)
    record.pop("curve")
    print(json.dumps(record, indent=1))
    test = "n/a" if record["test"] is None else f"{record['test']:.2f}%"
    print(f"{recipe.method} on {recipe.data.name}: best val {record['val']:.2f}% at round {record['best_round']}, "
          f"new-client test {test}, {record['wall_s']:.1f}s on {record['device']}; run files in {args.out} "
          f"(bundle: fl-server export {args.out} --out BUNDLE)")
    return 0


def _table_argv(argv: list[str], seed_numbers: list[int] | None) -> list[str]:
    """The arguments that reproduce the whole table: ``--seed N`` runs (one process per seed) are recorded as
    ``--seeds max(N)+1``, since the resumable harness then runs every seed that is missing."""
    if not seed_numbers:
        return argv
    kept, i = [], 0
    while i < len(argv):
        if argv[i] in ("--seed", "--seeds"):
            i += 2  # the flag and its value
            continue
        if not argv[i].startswith(("--seed=", "--seeds=")):
            kept.append(argv[i])
        i += 1
    return [*kept, "--seeds", str(max(seed_numbers) + 1)]


def cmd_bench(args: argparse.Namespace) -> int:
    from fl_server.bench.experiments import get_experiment
    from fl_server.bench.report import split_label, write_report
    from fl_server.bench.runner import run_experiment

    if args.experiment == "list":
        from fl_server.bench.experiments import EXPERIMENTS

        for name, e in EXPERIMENTS.items():
            print(f"{name:<22} {', '.join(e.protocols)}")
        return 0
    exp = get_experiment(args.experiment)
    datasets = args.dataset or [d for d in exp.protocols if d != "digits"]
    methods = args.methods or list(exp.methods)
    results = Path(args.results_dir or ("runs/quick/results" if args.quick else "docs/results"))
    seeds = args.seed_numbers or args.seeds
    command = "fl-server " + " ".join(shlex.quote(a) for a in _table_argv(sys.argv[1:], args.seed_numbers))
    runs = Path(args.runs_dir or ("runs/quick/runs" if args.quick else "runs/bench"))
    rows = run_experiment(exp, datasets, methods, seeds, results, runs, args.quick,
                          args.device, args.mode, not args.no_progress, args.data_dir, command)
    for r in (r for r in rows if r["dataset"] in datasets and r["method"] in methods):  # the table holds every row
        paper = "" if r["paper"] is None else f" (paper {r['paper']:.2f})"
        print(f"{r['dataset']:>14} {r['method']:>10} {split_label(r):>4}: {r['mean']:.2f} +- {r['std']:.2f} "
              f"over {r['seeds']} seed(s){paper}")
    if results == Path("docs/results"):
        print(f"wrote {write_report(Path('docs'))}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from export.run import export_run
    from fl_server.signing import ManifestSigner

    signer = ManifestSigner.from_pem(Path(args.signing_key)) if args.signing_key else None
    path = export_run(args.run_dir, args.out, int8=args.int8, signer=signer)
    how = f"load_bundle(dir, public_key='{signer.public_hex}')" if signer else "load_bundle (unsigned: hashes only)"
    print(f"bundle written to {path} (verify and use it on a device with edge_sdk.bundle.{how})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from fl_server.bench.report import write_report

    docs = Path(args.docs)
    if not (docs / "results").is_dir():
        raise FileNotFoundError(f"{docs} has no results/ folder (the docs directory of this repository)")
    print(f"wrote {write_report(docs)}")
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


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from fl_server.service import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    import importlib.util

    import torch

    # hypernetwork forwards run on one worker thread with one intra-op thread: a burst of generates must not
    # take every core from the event loop (training runs in subprocesses with their own thread budget)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process (the CLI called twice, e.g. from a test)
        pass
    overrides = {k: v for k, v in {"default_rounds": args.rounds, "workers": args.workers}.items() if v is not None}
    app = create_app(args.store, **overrides)
    print(f"coordinator on http://{args.host}:{args.port} (store {args.store}; dashboard at /, API docs at /docs)")
    signer = app.state.service.signer
    print(f"manifest signing key (Ed25519; pin it on devices: EdgeClient(url, public_key=...)): {signer.public_hex}"
          f" (from {signer.source})", flush=True)
    fast = {"loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
            "http": "httptools" if importlib.util.find_spec("httptools") else "h11"}
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                backlog=args.backlog, **fast)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fl-server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a recipe: your own (--recipe FILE.py:NAME) or a built-in one "
                                     "(default: FedAvg on the embedded digits)")
    p.add_argument("--recipe", default=None, metavar="FILE.py[:NAME]",
                   help="a Recipe defined in a Python file (NAME defaults to `recipe`); the flags below change it")
    p.add_argument("--dataset", default="digits", choices=("digits", "mnist", "fashion_mnist"),
                   help="built-in recipe (UPFL Table 1's protocol) when no --recipe is given")
    p.add_argument("--method", default=None,
                   help="method name, any letter case (fl-server train --method tent); default: the recipe's, FedAvg")
    p.add_argument("--model", default=None, help="model from the zoo (default: the recipe's)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--clients", type=int, default=None, help="number of clients (default: the protocol's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/train", help="run directory (metrics.jsonl, checkpoints; resumable)")
    _add_run_flags(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("bench", help="run a named experiment and write docs/results/<experiment>.json")
    p.add_argument("experiment", help="e.g. upfl-table1, btgfl, fedicon-shift, map-incomplete, odpfl-dirichlet "
                                      "(`fl-server bench list` names them all)")
    p.add_argument("--dataset", action="append", help="repeatable; default: every paper data set of the experiment")
    p.add_argument("--methods", nargs="+", default=None)
    p.add_argument("--seeds", type=int, default=3, help="run seeds 0..SEEDS-1 (default 3)")
    p.add_argument("--seed", type=int, action="append", dest="seed_numbers", metavar="N",
                   help="repeatable; run only these seeds (e.g. one seed per process) instead of --seeds")
    p.add_argument("--quick", action="store_true",
                   help="CI-sized protocol: results in runs/quick/results, run dirs in runs/quick/runs")
    p.add_argument("--results-dir", default=None, help="default: docs/results (runs/quick/results with --quick)")
    p.add_argument("--runs-dir", default=None,
                   help="run dirs, resumable (default: runs/bench; runs/quick/runs with --quick)")
    _add_run_flags(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("export", help="export a trained run's best model and device steps as an ONNX bundle")
    p.add_argument("run_dir", help="run directory of `fl-server train --out` (holds run.json and best.npz)")
    p.add_argument("--out", required=True, help="bundle directory to write (replaced atomically)")
    p.add_argument("--int8", action="store_true", help="also ship forward_int8 (frozen, int8-quantized received model)")
    p.add_argument("--signing-key", default=None,
                   help="Ed25519 private key (PEM, e.g. a coordinator store's signing_key.pem): write manifest.sig")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="regenerate docs/RESULTS.md")
    p.add_argument("--docs", default="docs")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("data", help="obtain or inspect data sets")
    p.add_argument("action", choices=("fetch", "info"))
    p.add_argument("name", choices=("mnist", "fashion_mnist", "digits", "cifar10"))
    p.add_argument("--dir", default=None,
                   help="target/source directory (default: $FL_DATA_DIR, else ~/.cache/fl-edge/data)")
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("serve", help="run the coordinator API (trains the default bundles when the store is empty)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--store", default="runs/store", help="state directory: SQLite, artifacts, job runs")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of the default jobs (default: $FL_SERVE_ROUNDS or 60)")
    p.add_argument("--workers", type=int, default=None, help="concurrent training jobs (default: $FL_SERVE_WORKERS or 1)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--backlog", type=int, default=4096, help="listen backlog (a burst of device connections)")
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FetchError) as exc:  # data/config/recipe errors: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
