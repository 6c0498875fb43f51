"""The compact experiment tables of docs/RESULTS.md: per experiment one method x split table of mean +- std
(the paper's number beside it) with the seeds, and per data set the command that reproduces it, once.

Every row of a result table stays on the research page (``docs/research/results-detail.md``) with its note,
recorded command, device and wall time; this module only chooses what a reader sees first.

Example::

    >>> rows = [{"dataset": "mnist", "method": "FedAvg", "split": "test", "mean": 93.2, "std": 0.4,
    ...          "seeds": 3, "paper": 94.69, "device": "cpu:1 threads",
    ...          "command": "python -m lab bench upfl-table1 --dataset mnist --seeds 3 --no-progress"}]
    >>> print(summary_section("upfl-table1", rows, "UPFL Table 1: 100 clients. Reading the rows: ..."))
    ## upfl-table1
    <BLANKLINE>
    UPFL Table 1: 100 clients. Every row, its note and the per-row command: [research page](research/results-detail.md#upfl-table1).
    <BLANKLINE>
    - mnist: `python -m lab bench upfl-table1 --dataset mnist --seeds 3` (cpu:1 threads)
    <BLANKLINE>
    | dataset | method | seeds | test |
    |---|---|---|---|
    | mnist | FedAvg | 3 | 93.20 +- 0.40 (paper 94.69) |
    <BLANKLINE>
"""
from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable
from typing import Any

Row = dict[str, Any]

# A table wider than this many split columns is drawn transposed (one line per split, one column per method).
MAX_SPLIT_COLUMNS = 6

# experiment -> which rows its summary shows (every row when absent); the rest are on the research page.
# fedicon-shift: the clean test set, the covariate-shift means per severity and the 8x8-digits domain (the
# per-corruption rows, the validation conditions and the rate search are detail).
SUMMARY_ROWS: dict[str, Callable[[Row], bool]] = {
    "fedicon-shift": lambda r: r["split"] == "test" and r.get("shift") in
    {"clean", "covariate-s1", "covariate-s3", "covariate-s5", "digits"},
}

# abbreviations after which ". " does not end a sentence
_ABBREVIATIONS = {"Sec", "App", "Eq", "Eqs", "Fig", "Figs", "Tab", "vs", "e.g", "i.e", "cf", "al"}


def lead(description: str) -> str:
    """The description's first sentence (the protocol in one line; the rest is on the research page).

    >>> lead("UPFL concept shift (Sec. 4.5, App. F): 1,000 samples. Reading the rows: more.")
    'UPFL concept shift (Sec. 4.5, App. F): 1,000 samples.'
    """
    for m in re.finditer(r"\.\s+(?=[A-Z(])", description):
        word = re.search(r"([\w.]+)$", description[:m.start()])
        if word is None or word.group(1) not in _ABBREVIATIONS:
            return description[:m.start() + 1]
    return description


def split_label(row: Row) -> str:
    """The row's split with the experiment-specific field that tells its rows apart."""
    split = row["split"]
    if "column" in row:  # btgfl: one row per test-stream column
        split = f"{split}: {row['column']}"
    if "shift" in row:  # fedicon-shift: one row per shift
        split = f"{split} {row['shift']}"
    if "fraction" in row:  # upfl-data-size: one row per fraction of the new clients' data
        split = f"{split} a={row['fraction']}"
    if "group" in row:  # upfl-hetero: one row per model-size group
        split = f"{split} {row['group']}"
    if "setting" in row:  # odpfl-dp: one row per (|D|, eps)
        split = f"{split}: {row['setting']}"
    return split


def table_command(experiment: str, rows: list[Row]) -> str:
    """The one command that reproduces a data set's rows: ``python -m lab bench EXP --dataset DS [--device D]
    --seeds N``; every method, the most seeds any row has, and --device only where every recorded command
    named the same one (``bench`` skips the results already present, so it also completes a table)."""
    devices = set()
    for r in rows:
        args = shlex.split(r.get("command", ""))
        devices.add(args[args.index("--device") + 1] if "--device" in args[:-1] else None)
    device = f" --device {devices.pop()}" if len(devices) == 1 and None not in devices else ""
    return f"python -m lab bench {experiment} --dataset {rows[0]['dataset']}{device} --seeds {max(r['seeds'] for r in rows)}"


def _cell(r: Row) -> str:
    """mean +- std (one seed: the value alone), then the paper's number and the seeds that diverged (weights not
    finite) or trained to chance on validation."""
    paper = "" if r.get("paper") is None else f" (paper {r['paper']:.2f})"
    spread = f" +- {r['std']:.2f}" if r["seeds"] > 1 else ""
    return f"{r['mean']:.2f}{spread}{paper}{seed_marks(r)}"


def seed_marks(r: Row) -> str:
    """" (diverged: seed 0) (at chance: seed 1)": the row's seeds whose weights went non-finite or whose training
    collapsed to chance on validation (the aggregate's ``diverged_seeds``, ``chance_seeds``); "" when none."""
    return "".join(f" ({label}: seed {', '.join(map(str, seeds))})"
                   for label, seeds in (("diverged", r.get("diverged_seeds")), ("at chance", r.get("chance_seeds")))
                   if seeds)


def _joined(values: Iterable[Any], sep: str = "/") -> str:
    return sep.join(str(v) for v in dict.fromkeys(values))


def md_cell(text: Any) -> str:
    """A table cell's text with its pipes escaped (odpfl-dp's settings read "|D|=100")."""
    return str(text).replace("|", "\\|")


def _ordered_splits(rows: list[Row]) -> list[str]:
    """Split labels, new clients ("test") first, each group in the order the table holds them."""
    labels = list(dict.fromkeys(split_label(r) for r in rows))
    return sorted(labels, key=lambda s: not s.startswith("test"))


def _table(rows: list[Row]) -> list[str]:
    splits = _ordered_splits(rows)
    keys = list(dict.fromkeys((r["dataset"], r["method"]) for r in rows))
    cells = {(r["dataset"], r["method"], split_label(r)): r for r in rows}
    if len(splits) <= MAX_SPLIT_COLUMNS:  # one line per (data set, method)
        lines = ["| dataset | method | seeds | " + " | ".join(map(md_cell, splits)) + " |", "|---" * (3 + len(splits)) + "|"]
        # a method's line equal, number for number, to an earlier data set's (a training both share, e.g. the
        # baselines of a variant that changes only FedICON) is shown once and named under the table
        seen: dict[tuple[str, ...], str] = {}
        repeats = []
        for ds, method in keys:
            mine = [r for r in rows if (r["dataset"], r["method"]) == (ds, method)]
            row = [_cell(c) if (c := cells.get((ds, method, s))) else "-" for s in splits]
            line = (method, _joined([r["seeds"] for r in mine]), *row)
            if line in seen and any(c != "-" for c in row):
                repeats.append(f"{ds} {method} = {seen[line]}")
                continue
            seen.setdefault(line, ds)
            lines.append(f"| {ds} | {method} | {line[1]} | " + " | ".join(row) + " |")
        if repeats:
            lines += ["", f"Lines equal to an earlier data set's, not repeated: {'; '.join(repeats)}."]
        return lines
    methods = list(dict.fromkeys(r["method"] for r in rows))  # transposed: one line per (data set, split)
    lines = ["| dataset | split | seeds | " + " | ".join(methods) + " |", "|---" * (3 + len(methods)) + "|"]
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        for s in splits:
            mine = [c for m in methods if (c := cells.get((ds, m, s)))]
            if mine:
                row = [_cell(c) if (c := cells.get((ds, m, s))) else "-" for m in methods]
                lines.append(f"| {ds} | {md_cell(s)} | {_joined([r['seeds'] for r in mine])} | " + " | ".join(row) + " |")
    return lines


def summary_section(name: str, rows: list[Row], description: str = "") -> str:
    """One experiment's section of docs/RESULTS.md: the protocol's first sentence, a link to every row on the
    research page, per data set its protocol note (when all its rows share one) and its command once, and one
    compact method x split table."""
    shown = [r for r in rows if SUMMARY_ROWS.get(name, lambda _: True)(r)]
    link = f"[research page](research/results-detail.md#{name})"
    intro = f"{lead(description)} " if description else ""
    lines = [f"## {name}", "", f"{intro}Every row, its note and the per-row command: {link}.", ""]
    for ds in dict.fromkeys(r["dataset"] for r in shown):
        mine = [r for r in shown if r["dataset"] == ds]
        devices = _joined((d.strip() for r in mine for d in r["device"].split(",")), ", ")
        notes = {r.get("note", "") for r in mine}  # a note every row shares describes the protocol: shown once
        protocol = f" {notes.pop().rstrip('.')}." if len(notes) == 1 and "" not in notes else ""
        lines.append(f"- {ds}:{protocol} `{table_command(name, mine)}` ({devices})")
    return "\n".join([*lines, "", *_table(shown)]) + "\n"
