"""Footprint of the device SDK alone: installed size of a fresh venv with only ``pip install ./edge_sdk`` and
the time of ``import edge_sdk`` (fresh interpreter, median of repeats, minus an empty interpreter start).
Standard library only; rows merged into docs/benchmarks/edge-sdk.json by (what, device).

    python benchmarks/edge_sdk_footprint.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.rows import merge_rows  # noqa: E402  (standard library only)

ROOT = Path(__file__).resolve().parents[1]


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def start_ms(python: Path, code: str, repeats: int, cwd: str) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([str(python), "-c", code], check=True, cwd=cwd)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks/edge-sdk.json"))
    args = ap.parse_args()
    command = "python benchmarks/edge_sdk_footprint.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        env_dir = Path(tmp) / "sdk"
        venv.create(env_dir, with_pip=True)
        python = env_dir / "bin" / "python"
        bare = tree_bytes(env_dir)
        subprocess.run([str(python), "-m", "pip", "install", "-q", str(ROOT / "edge_sdk")], check=True)
        installed = tree_bytes(env_dir) - bare
        has_torch = subprocess.run([str(python), "-m", "pip", "show", "torch"], capture_output=True).returncode == 0
        empty = start_ms(python, "pass", args.repeats, tmp)
        full = start_ms(python, "import edge_sdk, edge_sdk._runners", args.repeats, tmp)
    device = f"cpu:{platform.machine()}, load {os.getloadavg()[0]:.1f}"
    common = {"benchmark": "edge-sdk", "device": device, "python": platform.python_version(), "command": command}
    rows = [
        {**common, "what": "installed size, fresh venv with only edge_sdk", "metric": "MB",
         "value": round(installed / 1e6, 1), "torch_installed": has_torch},
        {**common, "what": "import edge_sdk (+ its runners), fresh interpreter", "metric": "ms",
         "value": round(full - empty, 1), "interpreter_start_ms": round(empty, 1), "repeats": args.repeats},
    ]
    merge_rows(args.out, rows, key=("what",))
    for r in rows:
        print(f"{r['what']}: {r['value']} {r['metric']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
