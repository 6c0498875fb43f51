"""Long profile of the API fuzzing: schemathesis cases from the coordinator's OpenAPI schema against a real
server process (the same driver and checks as the CI profile, tests/test_api_fuzz.py, with more cases).

    python scripts/fuzz_api.py [--max-examples 100] [--seed N] [--trained DIR] [--out docs/reliability/fuzz.json]

Trains a store with TENT and ODPFL-HN bundles first (1 round on the embedded digits) unless --trained names
one, serves a copy of it, and writes cases per endpoint, failures, seconds and versions to --out. The exit
status is 1 when any check failed (the failures are printed and written too).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "edge_sdk"), str(REPO / "tests")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-examples", type=int, default=100, help="cases per operation and mode")
    ap.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random, recorded)")
    ap.add_argument("--trained", default=None, help="a trained store to copy (default: train one first)")
    ap.add_argument("--out", default="docs/reliability/fuzz.json")
    args = ap.parse_args()
    import hypothesis
    import schemathesis

    from api_fuzz import CHECKS, NEGATIVE_ONLY, NO_LIMITS, fuzz_coordinator
    from coordinator_proc import ADMIN, start_copy, train_store

    seed = args.seed if args.seed is not None else random.randrange(2**32)
    with tempfile.TemporaryDirectory(prefix="fuzz-api-") as tmp:
        t0 = time.perf_counter()
        trained = Path(args.trained).resolve() if args.trained else train_store(Path(tmp) / "trained")
        train_s = time.perf_counter() - t0
        coord = start_copy(trained, Path(tmp) / "store", env=NO_LIMITS)
        try:
            report = fuzz_coordinator(coord.url, ADMIN, args.max_examples, seed)
        finally:
            coord.stop()
    failures = list(report.failures)
    if report.server_5xx:
        failures.append(f"the server counted {report.server_5xx} 5xx answers")
    if report.jobs_created:
        failures.append(f"{report.jobs_created} training jobs were created")
    command = "python scripts/fuzz_api.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = {
        "experiment": "api-fuzz", "command": command, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "schemathesis_version": schemathesis.__version__, "hypothesis_version": hypothesis.__version__,
        "python": platform.python_version(), "seed": seed, "max_examples": args.max_examples,
        "cases_run": {"total": sum(report.cases.values()), "per_endpoint": dict(sorted(report.cases.items()))},
        "failures": len(failures), "failure_details": failures,
        "seconds": round(report.seconds, 1), "seconds_training_store": round(train_s, 1),
        "skipped": report.skipped, "server_5xx": report.server_5xx, "jobs_created": report.jobs_created,
        "modes": "positive (schema-valid), negative (schema-invalid) and targeted (valid embedding dimension / "
                 f"probability rows) per operation; {', '.join(sorted(NEGATIVE_ONLY))} negative only",
        "checks": [c.__name__ for c in CHECKS],
        "server": "one uvicorn process (fl-server serve) on a copy of a trained store, rate limits off",
    }
    out = REPO / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for label, n in sorted(report.cases.items()):
        print(f"{n:6d}  {label}")
    print(f"{result['cases_run']['total']} cases, {len(failures)} failures, {result['seconds']} s; wrote {out}")
    for f in failures:
        print("\n" + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
