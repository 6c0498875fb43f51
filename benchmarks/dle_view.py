"""The coordinator's BTFL DLE view (``GET /v1/btfl/dle``) as the number of uploading clients grows: the running
sums of ``fl_server/service/dle.py`` against what they replaced (decode every client's row from SQLite, then
``edge_sdk._btfl.average_dles`` twice: with and without the caller), in one run, the calls alternating.

Rows: DLE [64, 2] (the BTFL CNN's D = 64, binary fsq levels), a served bundle's training DLE as the base,
N clients with a latest upload each, in a real SQLite store. Both variants' views are checked equal.

    python benchmarks/dle_view.py [--clients 100 1000 10000] [--repeats 20]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

from edge_sdk import _btfl as btfl
from fl_server.service.dle import DLEAggregate
from fl_server.service.store import Store

from timing import command_line, interleaved_median_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.rows import merge_rows  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "dle-view.json"
SHAPE = (64, 2)


def direct_view(store: Store, client_id: str, base: tuple[str, np.ndarray, int]) -> tuple[np.ndarray, np.ndarray]:
    """What the running sums replaced: every row decoded, the aggregate computed from scratch (with today's
    per-client weights, so that the two views can be checked equal)."""
    rows = [r for r in store.dles() if (r["dims"], r["levels"]) == SHAPE]
    freqs = [base[1], *(np.asarray(r["freqs"]) for r in rows)]
    weights = [base[2], *(1 for _ in rows)]  # one weight per client; the bundle counts as its clients
    others = [i for i, r in enumerate(rows, start=1) if r["client_id"] != client_id]
    return (btfl.average_dles(freqs, weights),
            btfl.average_dles([freqs[0], *(freqs[i] for i in others)], [weights[0], *(weights[i] for i in others)]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    base = ("bundle", btfl.fit_dle(rng.exponential(size=(500, SHAPE[0]))), 90)
    rows = []
    for n in args.clients:
        with tempfile.TemporaryDirectory() as tmp:
            store = Store(Path(tmp) / "db.sqlite3")
            agg = DLEAggregate(store, uploads_share=math.inf)  # no cap on all uploads: direct_view has none
            for i in range(n):
                freqs = btfl.fit_dle(rng.exponential(size=(int(rng.integers(20, 200)), SHAPE[0])))
                agg.put(f"c{i}", freqs.tolist(), int(rng.integers(20, 200)), base)
            asker = "c0"
            view = agg.view(asker, base)
            g, o = direct_view(store, asker, base)
            assert view is not None and view.others_dle is not None
            err = max(float(np.abs(view.global_dle - g).max()), float(np.abs(view.others_dle - o).max()))
            ms = interleaved_median_ms({"running sums": lambda: agg.view(asker, base),
                                        "decode every row": lambda: direct_view(store, asker, base)},
                                       args.repeats, warmup=2)
            store.close()
        row = {"what": f"DLE view, {n} clients", "metric": "speedup_running_sums_vs_decode_every_row",
               "value": round(ms["decode every row"] / ms["running sums"], 1), "clients": n, "dle_shape": list(SHAPE),
               "running_sums_ms": round(ms["running sums"], 4), "decode_every_row_ms": round(ms["decode every row"], 3),
               "max_abs_difference": err,
               "repeats": args.repeats, "device": f"cpu ({platform.machine()})",
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
               "command": command_line()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    merge_rows(Path(args.out), rows, key=("what",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
