"""Benchmark result files: JSON lists of rows, merged by (what, device) so runs on different machines
(CPU, GPU) accumulate in one file. Standard library only (the numpy-only benchmarks use it too)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def merge_rows(path: str | os.PathLike, rows: list[dict], key: tuple[str, ...] = ("what", "device")) -> list[dict]:
    """Replace the rows of ``path`` that share ``key`` (default (what, device)) with ``rows``; keep the others.
    Atomic write."""
    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() else []
    keys = {tuple(r[k] for k in key) for r in rows}
    merged = [r for r in old if tuple(r.get(k) for k in key) not in keys] + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(merged, indent=1) + "\n")
    os.replace(tmp, path)
    return merged
