"""The run directory: the one module that names, writes and reads its files.

==================  =====================================================================================
``run.json``        what the run was (method, hyperparameters, model, data, recipe source): ``fl-server
                    export`` rebuilds the model from it
``metrics.jsonl``   one JSON row per round (the coordinator's progress)
``best.npz``        the server state of the best validation round (and its round in the metadata)
``checkpoint.npz``  the state to resume from, with its metadata; ``checkpoint.json`` mirrors the metadata
``best.ckpt.npz``   the best state as of the last checkpoint (a hard link)
``final.npz``       a Flower run's last server state
``device.npz``      what a bundle of ``best.npz`` needs that only the clients' data gives, written by the run's
                    finalize step: the population statistics of a batch-normalised model (``stats``) and the
                    method's finalize weights (BTFL's global DLE, ``btfl``), with the round of the state they
                    belong to; export reads them from here and needs no data set
==================  =====================================================================================

>>> from pathlib import Path
>>> import tempfile
>>> from fl_server import rundir
>>> d = Path(tempfile.mkdtemp())
>>> rundir.write_run(d, {"method": "FedAvg"}); rundir.read_run(d)["method"]
'FedAvg'
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_server.atomic import atomic_write_json, atomic_write_npz
from fl_server.functional import State, from_numpy_flat, to_numpy_flat

RUN, METRICS, BEST, DEVICE = "run.json", "metrics.jsonl", "best.npz", "device.npz"
FINAL = "final.npz"  # a Flower run's last server state
CHECKPOINT, CHECKPOINT_JSON, BEST_AT_CHECKPOINT = "checkpoint.npz", "checkpoint.json", "best.ckpt.npz"
META_KEY = "__checkpoint__"  # a checkpoint's metadata (JSON bytes) inside its own .npz


def complete_rows(text: str) -> list[dict[str, Any]]:
    """The JSON rows of a metrics file up to the first incomplete one (a process killed mid-write)."""
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def save_state(path: Path, state: State, meta: dict[str, Any] | None = None) -> None:
    """``state`` (nested dicts of tensors) and an optional JSON ``meta`` as one .npz, replaced atomically."""
    _save_arrays(path, to_numpy_flat(state), meta)


def _save_arrays(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any] | None) -> None:
    """Flat ``arrays`` and an optional JSON ``meta`` (under :data:`META_KEY`) as one .npz, replaced atomically."""
    if meta is not None:
        arrays = {**arrays, META_KEY: np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    atomic_write_npz(path, arrays)


def load_state(path: Path, device: torch.device | None = None) -> State:
    with np.load(path, allow_pickle=False) as arrays:
        return from_numpy_flat({k: arrays[k] for k in arrays.files if k != META_KEY}, device)


def checkpoint_meta(path: Path) -> dict[str, Any] | None:
    """The JSON metadata stored by :func:`save_state` (None when the file has none)."""
    with np.load(path, allow_pickle=False) as arrays:
        return json.loads(arrays[META_KEY].tobytes()) if META_KEY in arrays.files else None


# ---------------------------------------------------------------------- what consumers read
def write_run(run_dir: Path, description: dict[str, Any]) -> None:
    """``run.json`` (atomic)."""
    atomic_write_json(Path(run_dir) / RUN, description, indent=1, default=str)


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """``run.json`` of a finished run; FileNotFoundError (one line) unless it and ``best.npz`` exist."""
    run_dir = Path(run_dir)
    for needed in (RUN, BEST):
        if not (run_dir / needed).is_file():
            raise FileNotFoundError(f"{run_dir / needed}: not found; train first (fl-server train --out {run_dir})")
    return json.loads((run_dir / RUN).read_text())


def load_best(run_dir: str | Path) -> State:
    """The best-validation server state (``best.npz``)."""
    return load_state(Path(run_dir) / BEST)


def best_arrays(run_dir: str | Path, prefix: str) -> dict[str, np.ndarray]:
    """The flat arrays of ``best.npz`` under ``prefix/`` (e.g. ODPFL-HN's ``hn``), keys without the prefix."""
    with np.load(Path(run_dir) / BEST, allow_pickle=False) as arrays:
        return {k[len(prefix) + 1:]: arrays[k] for k in arrays.files if k.startswith(prefix + "/")}


def write_device(run_dir: str | Path, weights: dict[str, dict[str, np.ndarray]], round_: int) -> None:
    """``device.npz``: named weight sets (``{"stats": {...}, "btfl": {...}}``) for the state of round ``round_``."""
    arrays = {f"{name}/{key}": np.asarray(v) for name, ws in weights.items() for key, v in ws.items()}
    _save_arrays(Path(run_dir) / DEVICE, arrays, {"round": round_, "sets": sorted(weights)})


def read_device(run_dir: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """The weight sets of ``device.npz``, checked to belong to ``best.npz``'s round; FileNotFoundError (one line)
    for a run whose training did not finalize (trained before the finalize step existed: train it again)."""
    run_dir = Path(run_dir)
    path = run_dir / DEVICE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; the run did not finalize (train it again with this version: "
                                "the finalize step writes what its bundle needs from the clients' data)")
    meta = checkpoint_meta(path) or {}
    best = checkpoint_meta(run_dir / BEST) or {}
    if "round" in best and meta.get("round") != best["round"]:
        raise ValueError(f"{path} belongs to round {meta.get('round')}, best.npz to round {best['round']}; "
                         "resume the run to finalize it again")
    out: dict[str, dict[str, np.ndarray]] = {name: {} for name in meta.get("sets", [])}
    with np.load(path, allow_pickle=False) as arrays:
        for k in arrays.files:
            if k != META_KEY:
                name, key = k.split("/", 1)
                out.setdefault(name, {})[key] = arrays[k]
    return out


def rounds_done(run_dir: str | Path) -> int:
    """Rounds the last checkpoint holds (0 before the first)."""
    path = Path(run_dir) / CHECKPOINT_JSON
    return int(json.loads(path.read_text())["rounds_done"]) if path.is_file() else 0


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Complete rows of ``metrics.jsonl`` (a line being written is skipped until it is whole)."""
    path = Path(run_dir) / METRICS
    return complete_rows(path.read_text()) if path.is_file() else []
