"""lab/research/device_rows.tsv, the GPU queue's rows: every step of every row is a `bench` command that names a
known experiment, one of its data sets and its methods, or a call of the gap study's probe with a method of the
family, a data set of the table and hyperparameters the method has (a malformed row fails only on the lent GPU,
hours later)."""
from __future__ import annotations

import shlex
from pathlib import Path

from lab.experiments import get_experiment

ROWS = Path(__file__).resolve().parents[2] / "lab" / "research" / "device_rows.tsv"
PROBE = "lab/research/probe_family_training.py"  # the gap study's validation-only runs (gap-* rows)


def _option_values(args: list[str], flag: str) -> list[str]:
    if flag not in args:
        return []
    values = []
    for a in args[args.index(flag) + 1:]:
        if a.startswith("--"):
            break
        values.append(a)
    return values


def _check_probe_step(name: str, args: list[str]) -> None:
    """The probe's own parser takes the step, and its data set and --set keys exist."""
    import dataclasses
    import importlib.util

    from fl_server.algorithms import ALGORITHMS

    spec = importlib.util.spec_from_file_location("probe_family_training", ROWS.parents[2] / PROBE)
    assert spec and spec.loader
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    parsed = probe.parser().parse_args(args)  # an unknown flag or value exits: the row is malformed
    assert parsed.dataset in get_experiment("upfl-table1").protocols, f"{name}: no data set {parsed.dataset!r}"
    fields = {f.name for f in dataclasses.fields(ALGORITHMS[parsed.method].Config)}
    for key in probe.parse_sets(parsed.sets):
        assert key in fields, f"{name}: {parsed.method} has no hyperparameter {key!r}"


def test_every_queue_row_is_a_valid_bench_command() -> None:
    names = []
    for line in ROWS.read_text().splitlines():
        if not line.strip():
            continue
        name, sep, rest = line.partition("\t")
        assert sep and name and " " not in name, f"row {line!r}: NAME<TAB>bench ..."
        names.append(name)
        for step in rest.split("&&"):  # device_queue.sh splits steps on && and evals each
            args = shlex.split(step)
            if args[0] == PROBE:
                _check_probe_step(name, args[1:])
                continue
            assert args[0] == "bench", f"{name}: step {step!r} is neither a bench command nor {PROBE}"
            exp = get_experiment(args[1])
            for dataset in _option_values(args, "--dataset"):
                assert dataset in exp.protocols, f"{name}: {exp.name} has no data set {dataset!r}"
            for method in _option_values(args, "--methods"):
                assert method in exp.methods, f"{name}: {exp.name} has no method {method!r}"
            assert "&&" not in args and args.count("bench") == 1, f"{name}: steps not split: {step!r}"
    assert len(names) == len(set(names)), "row names must be unique (they name the done/ markers)"
