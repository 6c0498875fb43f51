"""Benchmark result files: JSON lists of rows, merged by (what, device) so runs on different machines
(CPU, GPU) accumulate in one file. Standard library only (the numpy-only benchmarks use it too)."""
from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def invocation() -> str:
    """This process's command line as a user would type it: ``fl-server train ...``, ``python -m lab bench
    ...``, or ``python benchmarks/x.py ...`` (a script inside the repository named from its root). Recorded with
    results (run.json, benchmark rows) so that they say how they were produced."""
    script = Path(sys.argv[0])
    if script.name in ("fl-server", "cli.py"):
        head = ["fl-server"]
    elif script.name == "__main__.py" and script.resolve().parent == REPO / "lab":
        head = ["python", "-m", "lab"]
    else:
        try:
            head = ["python", script.resolve().relative_to(REPO).as_posix()]
        except ValueError:  # outside the repository: as given
            head = ["python", sys.argv[0]]
    return " ".join([*head, *(shlex.quote(a) for a in sys.argv[1:])])


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a per-process temporary file and a rename: seeds run as parallel
    processes (``python -m lab bench --seed N``) each rewrite the aggregated table and the report."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def merge_rows(path: str | os.PathLike, rows: list[dict], key: tuple[str, ...] = ("what", "device")) -> list[dict]:
    """Replace the rows of ``path`` that share ``key`` (default (what, device)) with ``rows``; keep the others.
    Atomic write."""
    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() else []
    keys = {tuple(r[k] for k in key) for r in rows}
    merged = [r for r in old if tuple(r.get(k) for k in key) not in keys] + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(merged, indent=1) + "\n")
    return merged
