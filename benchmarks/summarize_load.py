"""Summarise repeated runs of ``coordinator_load.py`` (on a machine shared with other jobs one run proves little):

    python benchmarks/summarize_load.py --out docs/benchmarks/coordinator-load-series.json \\
        before=runs/bench/before-1.json before=runs/bench/before-2.json after=runs/bench/after-1.json ...

One row per run (client-observed p50/p99 per endpoint, the server's own mean latency per route, throughput,
errors, CPU seconds of each side, 1-minute load average before/after) and one per variant with the median and
the best of the runs' p99s for join and generate against the 200 ms target.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

TARGET_MS = 200.0


def run_row(variant: str, path: Path) -> dict[str, Any]:
    rows = json.loads(path.read_text())
    by = {(r["endpoint"], r["metric"]): r for r in rows}
    first = rows[0]
    out: dict[str, Any] = {"variant": variant, "file": path.name, "command": first["command"],
                           "loadavg_1m_before_after": first["loadavg_1m_before_after"],
                           "cpu_s_server": first.get("cpu_s_server"), "cpu_s_client": first.get("cpu_s_client"),
                           "cores": first.get("cores", "shared (no pinning)"), "client": first.get("client", "httpx")}
    for ep in ("join", "manifest", "artifact", "generate"):
        for q in ("p50", "p99"):
            out[f"{ep}_{q}_ms"] = by[(ep, f"latency_{q}_ms")]["value"]
        server = by.get((ep, "server_side_mean_ms"))
        out[f"{ep}_server_mean_ms"] = None if server is None else server["value"]
    out["throughput_rps"] = by[("all", "throughput_rps")]["value"]
    out["errors"] = by[("all", "errors")]["value"]
    return out


def variant_row(variant: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"variant": variant, "runs": len(runs), "target_p99_ms": TARGET_MS}
    for ep in ("join", "generate"):
        p99 = [r[f"{ep}_p99_ms"] for r in runs]
        out[f"{ep}_p99_ms_median"] = round(statistics.median(p99), 2)
        out[f"{ep}_p99_ms_best"] = min(p99)
        out[f"{ep}_runs_under_target"] = sum(v < TARGET_MS for v in p99)
    out["throughput_rps_median"] = round(statistics.median(r["throughput_rps"] for r in runs), 1)
    out["errors_total"] = sum(r["errors"] for r in runs)
    out["loadavg_1m_range"] = [min(r["loadavg_1m_before_after"][0] for r in runs),
                               max(r["loadavg_1m_before_after"][1] for r in runs)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="VARIANT=PATH of one coordinator_load.py output")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {}
    for spec in args.runs:
        variant, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"error: {spec!r} is not VARIANT=PATH")
        runs.setdefault(variant, []).append(run_row(variant, Path(path)))
    summary = [variant_row(v, rs) for v, rs in runs.items()]
    Path(args.out).write_text(json.dumps({"variants": summary, "runs": [r for rs in runs.values() for r in rs]},
                                         indent=1) + "\n")
    for s in summary:
        print(f"{s['variant']:>28}: join p99 median {s['join_p99_ms_median']} (best {s['join_p99_ms_best']}), "
              f"generate p99 median {s['generate_p99_ms_median']} (best {s['generate_p99_ms_best']}), "
              f"{s['throughput_rps_median']} rps, errors {s['errors_total']}, load {s['loadavg_1m_range']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
