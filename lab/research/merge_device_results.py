"""Merge the raw result files a device run packed (`lab/research/device_queue.sh status` -> results.tgz) into
docs/results: each record's "command" loses the queue's own --results-dir / --runs-dir and its --methods (one
table command covers every method), records already present are kept, the touched experiments are
re-aggregated and docs/RESULTS.md is rewritten.

    python lab/research/merge_device_results.py DIR/results.tgz [--docs docs]

Rows of research probes the lease ran (``results/<name>-probe.json``, e.g. probe_family_training.py's) are merged
into docs/results/<name>-probe.json by their ``what``, their command cleaned likewise.

The archive's folder (a lease's files) may hold checkpoints of rows cut off (ckpt-*.tgz[.partNN]): they are kept
for the next lease (``lab/research/lease_checkpoints.py keep``), and the kept ones of rows now merged are dropped.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: lab/ is not installed
from lab.experiments import get_experiment  # noqa: E402
from lab.report import write_report  # noqa: E402
from lab.research.lease_checkpoints import STORE, keep  # noqa: E402
from lab.research.probe_family_training import OUT_NAME as PROBE_OUT, fill_table_val  # noqa: E402
from lab.rows import merge_rows, write_atomic  # noqa: E402
from lab.runner import aggregate_experiment  # noqa: E402


def table_command(command: str) -> str:
    """The queue row's recorded command as the table's reproduction command: without --results-dir / --runs-dir
    (one value each) and --methods (every value up to the next flag)."""
    kept, dropping = [], 0  # dropping: values still to skip; -1 = every value up to the next flag
    for token in shlex.split(command):
        if token.startswith("--"):
            dropping = {"--results-dir": 1, "--runs-dir": 1, "--methods": -1}.get(token, 0)
            if dropping:
                continue
        elif dropping:
            if dropping > 0:
                dropping -= 1
            continue
        kept.append(token)
    return shlex.join(kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archive")
    ap.add_argument("--docs", default="docs")
    ap.add_argument("--store", type=Path, default=STORE, help="where the lease's checkpoints are kept")
    args = ap.parse_args()
    results = Path(args.docs) / "results"
    touched: set[str] = set()
    with tarfile.open(args.archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if ".." in parts:
                raise ValueError(f"unsafe path in archive: {member.name}")
            if member.isfile() and len(parts) == 2 and parts[0] == "results" and parts[1].endswith("-probe.json"):
                rows = json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
                rows = [{**r, "command": table_command(r.get("command", ""))} for r in rows]
                if parts[1] == PROBE_OUT:  # the table's validation, aside during the lease call
                    rows = [fill_table_val(r, results) for r in rows]
                merge_rows(results / parts[1], rows, key=("what",))
                print(f"merged {len(rows)} row(s) into {results / parts[1]}")
                continue
            if not (member.isfile() and parts[:2] == ("results", "raw") and member.name.endswith(".json")):
                continue
            out = results.joinpath(*parts[1:])
            if out.exists():
                print(f"kept (already present): {out}")
                continue
            record = json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
            record["command"] = table_command(record.get("command", ""))
            out.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(out, json.dumps(record, indent=1))
            touched.add(parts[2])
            print(f"added {out}")
    for name in sorted(touched):
        aggregate_experiment(get_experiment(name), results)
    print(f"re-aggregated {', '.join(sorted(touched)) or 'nothing'}; wrote {write_report(Path(args.docs))}")
    kept, dropped = keep(Path(args.archive).parent, args.store, results)
    print(f"checkpoints kept in {args.store}: {', '.join(kept) or 'none'}; dropped (row finished): "
          f"{', '.join(dropped) or 'none'}")


if __name__ == "__main__":
    main()
