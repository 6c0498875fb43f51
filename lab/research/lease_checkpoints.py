"""Run folders across GPU leases: what a lease sends back, in as few bytes as resuming needs.

A call carries at most 64 MiB (the tree, Fashion-MNIST's 30 MB and the checkpoints) and returns 8 files of at most
16 MiB. A simulation's run folder holds three states of about 6.7 MB each: checkpoint.npz, best.npz (moves on
after the checkpoint; a resumed run replays those rounds and finds it again) and best.ckpt.npz (the best state as
of the checkpoint). A hetero run folder holds checkpoint.npz and best.npz, written at the same validation round.
Resuming needs the checkpoint and the best state as of it (best.ckpt.npz, else best.npz), and not even that when
the best round is the checkpoint's own: then both hold the same arrays (checked before it is left out) and
``restore`` writes it back from the checkpoint. ``restore`` also puts best.npz back beside a carried
best.ckpt.npz (as a hard link: states are replaced by rename, never written through), so a resumed run that does
not improve again still has its best.npz.

    python lab/research/lease_checkpoints.py pack RUNS REL OUT.tgz   # a cut-off run folder RUNS/REL, slim
    python lab/research/lease_checkpoints.py restore RUNS           # after unpacking: best files put back
    python lab/research/lease_checkpoints.py bests RUNS RESULTS OUT.tgz  # finished rows' best.npz (probes)
    python lab/research/lease_checkpoints.py keep DIR                # a lease's ckpt-*.tgz[.partNN] -> STORE

A lease's machine and its files are gone with the lease, and so is this machine's ignored folder by the next
session: ``keep`` joins a call's checkpoint archives into :data:`STORE`, a tracked folder committed with the call's
results, which the next call carries as part of the tree (gpu_engine_session.sh resumes from it) and drops every
archive whose run has its raw result in docs/results (a probe's run: its row).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fl_server.rundir import (BEST, BEST_AT_CHECKPOINT, CHECKPOINT, CHECKPOINT_JSON, META_KEY,  # noqa: E402
                              METRICS, RUN)

RUN_FILES = (METRICS, CHECKPOINT_JSON, RUN, CHECKPOINT)
STORE = Path("lab/research/lease-checkpoints")  # from the repository's root


def read_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = arrays.pop(META_KEY, None)
    return arrays, None if meta is None else json.loads(meta.tobytes())


def same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def best_at_checkpoint(run: Path) -> Path | None:
    """The file holding the best state as of the checkpoint: best.ckpt.npz (simulations), else best.npz (hetero)."""
    return next((run / n for n in (BEST_AT_CHECKPOINT, BEST) if (run / n).exists()), None)


def best_is_checkpoint(run: Path) -> bool:
    """Whether the best state as of the checkpoint is the checkpoint's own state (its best round is the checkpoint's
    last round and, where a best file exists, that file holds the same arrays)."""
    state, meta = read_npz(run / CHECKPOINT)
    if meta is None or meta.get("best_round") != meta.get("rounds_done", 0) - 1:
        return False
    best = best_at_checkpoint(run)
    if best is None:
        return True  # after a slim pack: the checkpoint's meta alone says so
    best_state, best_meta = read_npz(best)
    return (best_meta is None or best_meta.get("round") == meta["best_round"]) and same_arrays(state, best_state)


def pack(runs: Path, rel: str, out: Path) -> list[str]:
    """tar.gz of RUNS/REL with what resuming needs; returns the member names."""
    run = runs / rel
    names = [f for f in RUN_FILES if (run / f).exists()]
    best = best_at_checkpoint(run)
    if best is not None and not best_is_checkpoint(run):
        names.append(best.name)
    with tarfile.open(out, "w:gz") as tar:
        for name in names:
            tar.add(run / name, arcname=f"{rel}/{name}")
    return names


def restore(runs: Path) -> list[Path]:
    """Put the best files back into every run folder whose archive left them out; returns the folders touched."""
    done = []
    for ckpt in sorted(runs.rglob(CHECKPOINT)):
        run = ckpt.parent
        if (run / BEST_AT_CHECKPOINT).exists():
            if not (run / BEST).exists():
                os.link(run / BEST_AT_CHECKPOINT, run / BEST)
                done.append(run)
            continue
        if (run / BEST).exists() or not best_is_checkpoint(run):
            continue
        state, meta = read_npz(ckpt)
        assert meta is not None
        state[META_KEY] = np.frombuffer(json.dumps({"round": meta["best_round"], "val": meta["best_val"]}).encode(),
                                    dtype=np.uint8)
        np.savez(run / BEST, **state)
        os.link(run / BEST, run / BEST_AT_CHECKPOINT)
        done.append(run)
    return done


def bests(runs: Path, results: Path, out: Path) -> list[str]:
    """tar.gz of best.npz, run.json and checkpoint.json of every run folder whose row has a raw result."""
    members = []
    with tarfile.open(out, "w:gz") as tar:
        for best in sorted(runs.rglob(BEST)):
            rel = best.parent.relative_to(runs)
            if not (results / "raw" / rel).with_suffix(".json").exists():
                continue
            for name in (BEST, RUN, CHECKPOINT_JSON):
                if (best.parent / name).exists():
                    tar.add(best.parent / name, arcname=f"{rel}/{name}")
                    members.append(f"{rel}/{name}")
    return members


def archive_run(archive: Path) -> str:
    """The run folder an archive of :func:`pack` holds: <experiment>/<dataset>/<method>/seedK; ValueError for an
    archive that cannot be read (a missing part) or holds other than one run's checkpoint."""
    try:
        with tarfile.open(archive) as tar:
            runs = {str(Path(name).parent) for name in tar.getnames() if Path(name).name == CHECKPOINT}
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ValueError(f"{archive}: not a readable checkpoint archive ({e})") from e
    if len(runs) != 1 or ".." in Path(next(iter(runs))).parts:
        raise ValueError(f"{archive}: not one run folder's checkpoint archive ({sorted(runs)})")
    return runs.pop()


def probe_runs(results: Path) -> set[str]:
    """The run folders named by the rows (``run``) of ``results``' *-probe.json files: those runs are finished."""
    runs = set()
    for path in results.glob("*-probe.json"):
        rows = json.loads(path.read_text())
        rows = rows if isinstance(rows, list) else []
        runs |= {row["run"] for row in rows if isinstance(row, dict) and "run" in row}
    return runs


def keep(lease: Path, store: Path, results: Path) -> tuple[list[str], list[str]]:
    """Join ``lease``'s ckpt-*.tgz (and split ckpt-*.tgz.partNN) into ``store``, replacing an older archive of the
    same run, then drop the store's archives whose run has a raw result in ``results``, or a row (``run``) in one
    of its ``*-probe.json`` files; returns (kept, dropped)."""
    joined = {}  # every archive of the call is joined and checked before the store changes: all or nothing
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted({p.name.split(".tgz")[0] + ".tgz" for p in lease.glob("ckpt-*.tgz*")}):
            parts = [lease / name] if (lease / name).exists() else sorted(lease.glob(f"{name}.part*"))
            (Path(tmp) / name).write_bytes(b"".join(p.read_bytes() for p in parts))
            archive_run(Path(tmp) / name)  # refuses a missing part, or what is not one run's checkpoint
            joined[name] = Path(tmp) / name
        if joined:
            store.mkdir(parents=True, exist_ok=True)
        for name, path in joined.items():
            shutil.move(path, store / name)
    kept = list(joined)
    probed = probe_runs(results)
    dropped = []
    for archive in sorted(store.glob("ckpt-*.tgz")):
        run = archive_run(archive)
        if (results / "raw" / run).with_suffix(".json").exists() or run in probed:
            archive.unlink()
            dropped.append(archive.name)
    return kept, dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("pack")
    p.add_argument("runs", type=Path)
    p.add_argument("rel")
    p.add_argument("out", type=Path)
    r = sub.add_parser("restore")
    r.add_argument("runs", type=Path)
    b = sub.add_parser("bests")
    b.add_argument("runs", type=Path)
    b.add_argument("results", type=Path)
    b.add_argument("out", type=Path)
    k = sub.add_parser("keep")
    k.add_argument("lease", type=Path, help="a lease's files (its files_at)")
    k.add_argument("--store", type=Path, default=STORE)
    k.add_argument("--results", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    if args.what == "keep":
        kept, dropped = keep(args.lease, args.store, args.results)
        print(f"kept {', '.join(kept) or 'nothing'}; dropped (row finished) {', '.join(dropped) or 'nothing'}")
    elif args.what == "pack":
        print(f"{args.out.name}: {', '.join(pack(args.runs, args.rel, args.out))}")
    elif args.what == "restore":
        for run in restore(args.runs):
            print(f"restored the best files of {run}")
    else:
        print(f"{args.out.name}: {len(bests(args.runs, args.results, args.out))} files")


if __name__ == "__main__":
    main()
