"""``python -m lab``: run a named experiment (``bench``) and regenerate docs/RESULTS.md (``report``), from the
repository's root. The lab is not part of the installed package; ``fl-server bench|report`` hands over to it."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from fl_server.cli import DefaultsFormatter, add_run_flags
from fl_server.data.errors import FetchError

PROG = "python -m lab"


def _table_argv(argv: list[str], seed_numbers: list[int] | None) -> list[str]:
    """The arguments that reproduce the whole table: ``--seed N`` runs (one process per seed) are recorded as
    ``--seeds max(N)+1``, since the resumable harness then runs every seed that is missing; ``--threads`` (how
    this process ran, not what) is left out."""
    dropped = ("--seed", "--seeds", "--threads") if seed_numbers else ("--threads",)
    kept, i = [], 0
    while i < len(argv):
        if argv[i] in dropped:
            i += 2  # the flag and its value
            continue
        if not argv[i].startswith(tuple(f"{flag}=" for flag in dropped)):
            kept.append(argv[i])
        i += 1
    return [*kept, "--seeds", str(max(seed_numbers) + 1)] if seed_numbers else kept


def cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    from lab.experiments import get_experiment
    from lab.report import split_label, write_report
    from lab.runner import run_experiment
    from lab.summary import seed_marks

    if args.experiment == "list":
        from lab.experiments import EXPERIMENTS

        for name, e in EXPERIMENTS.items():
            print(f"{name:<22} {', '.join(e.protocols)}")
        return 0
    exp = get_experiment(args.experiment)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    datasets = args.dataset or [d for d in exp.protocols if d != "digits"]
    methods = args.methods or list(exp.methods)
    results = Path(args.results_dir or ("runs/quick/results" if args.quick else "docs/results"))
    seeds = args.seed_numbers or args.seeds
    command = f"{PROG} " + " ".join(shlex.quote(a) for a in _table_argv(argv, args.seed_numbers))
    runs = Path(args.runs_dir or ("runs/quick/runs" if args.quick else "runs/bench"))
    rows = run_experiment(exp, datasets, methods, seeds, results, runs, args.quick,
                          args.device, args.mode, not args.no_progress, args.data_dir, command, args.stack_seeds,
                          args.stack_variants)
    for r in (r for r in rows if r["dataset"] in datasets and r["method"] in methods):  # the table holds every row
        paper = "" if r["paper"] is None else f" (paper {r['paper']:.2f})"
        print(f"{r['dataset']:>14} {r['method']:>10} {split_label(r):>4}: {r['mean']:.2f} +- {r['std']:.2f} "
              f"over {r['seeds']} seed(s){paper}{seed_marks(r)}")
    if results == Path("docs/results"):
        print(f"wrote {write_report(Path('docs'))}")
    return 0


def cmd_report(args: argparse.Namespace, argv: list[str]) -> int:
    from lab.report import write_report

    docs = Path(args.docs)
    if not (docs / "results").is_dir():
        raise FileNotFoundError(f"{docs} has no results/ folder (the docs directory of this repository)")
    print(f"wrote {write_report(docs)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fl_server.algorithms import ALGORITHMS  # the registry (imports torch)

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("bench", formatter_class=DefaultsFormatter,
                       help="run a named experiment and write docs/results/<experiment>.json")
    p.add_argument("experiment", help="e.g. upfl-table1, btgfl, fedicon-shift, map-incomplete, odpfl-dirichlet "
                                      f"(`{PROG} bench list` names them all)")
    p.add_argument("--dataset", action="append", help="repeatable; default: every paper data set of the experiment")
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help=f"default: the experiment's; any of {', '.join(ALGORITHMS)}")
    p.add_argument("--seeds", type=int, default=3, help="run seeds 0..SEEDS-1")
    p.add_argument("--seed", type=int, action="append", dest="seed_numbers", metavar="N",
                   help="repeatable; run only these seeds (e.g. one seed per process) instead of --seeds")
    p.add_argument("--quick", action="store_true",
                   help="CI-sized protocol: results in runs/quick/results, run dirs in runs/quick/runs")
    p.add_argument("--results-dir", default=None, help="default: docs/results (runs/quick/results with --quick)")
    p.add_argument("--runs-dir", default=None,
                   help="run dirs, resumable (default: runs/bench; runs/quick/runs with --quick)")
    p.add_argument("--stack-seeds", action="store_true",
                   help="train a method's missing seeds together in this process, one vmapped round over all their "
                        "clients (vmap mode; on a GPU each kernel gets the work of every seed); each seed keeps its "
                        "own run folder and result: its solo run's in float64, in float32 a run with other rounding, "
                        "as on another GPU")
    p.add_argument("--stack-variants", action="store_true",
                   help="train the named methods of each seed together in this process where the experiment's "
                        "variants share their round shapes (upfl-hetero's lambda variants: one vmapped round per size "
                        "group over every variant's clients); each keeps its own run folder and result")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch's CPU threads for this process (default: torch's, one per core): with several bench "
                        "processes on one machine, give each cores / processes, else they slow each other down")
    add_run_flags(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("report", formatter_class=DefaultsFormatter, help="regenerate docs/RESULTS.md")
    p.add_argument("--docs", default="docs")
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, argv)
    except (ValueError, FileNotFoundError, FetchError) as exc:  # data/config errors: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
