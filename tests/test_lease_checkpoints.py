"""scripts/research/lease_checkpoints.py: a run folder packed slim for the next GPU lease resumes to exactly the run
that was never cut (a wrong best state would silently change the reported round and test accuracy)."""
from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import numpy as np

from fl_server.recipes.presets import builtin_recipe
from fl_server.recipes.run import train

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "research" / "lease_checkpoints.py"
spec = importlib.util.spec_from_file_location("lease_checkpoints", SCRIPT)
assert spec and spec.loader
lease = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lease)

REL = "upfl-table1/digits/FedTTA/seed0"


def _train(run_dir: Path, rounds: int) -> dict:
    # validated every round: a finished shorter run can then be extended, as a run cut off by its lease is
    recipe = builtin_recipe("digits", "FedTTA", rounds=rounds).replace(eval_every=1)
    return train(recipe, run_dir, seed=0, device="cpu", progress=False, checkpoint_every=1)


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files if k != lease.META}


def test_slim_checkpoint_resumes_to_the_uncut_run(tmp_path: Path) -> None:
    cut = tmp_path / "lease1" / REL
    _train(cut, rounds=2)
    archive = tmp_path / "ckpt.tgz"
    names = lease.pack(tmp_path / "lease1", REL, archive)
    meta = json.loads((cut / "checkpoint.json").read_text())
    # the best state travels only when the checkpoint cannot stand in for it; here it can (seed 0's validation
    # rises every early round), so restore must rebuild it
    assert meta["best_round"] == meta["rounds_done"] - 1 == 1
    assert "best.ckpt.npz" not in names
    assert "best.npz" not in names and "checkpoint.npz" in names
    with tarfile.open(archive) as tar:
        assert sorted(m.name for m in tar.getmembers()) == sorted(f"{REL}/{n}" for n in names)
        tar.extractall(tmp_path / "lease2", filter="data")
    assert lease.restore(tmp_path / "lease2") == [tmp_path / "lease2" / REL]

    resumed = _train(tmp_path / "lease2" / REL, rounds=4)
    uncut = _train(tmp_path / "uncut" / REL, rounds=4)
    for key in ("best_round", "val", "test"):
        assert resumed[key] == uncut[key], key
    a, b = _arrays(tmp_path / "lease2" / REL / "best.npz"), _arrays(tmp_path / "uncut" / REL / "best.npz")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_restore_leaves_a_folder_whose_best_is_older_than_its_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / REL
    _train(run, rounds=2)
    meta = json.loads((run / "checkpoint.json").read_text())
    (run / "best.ckpt.npz").unlink()
    (run / "best.npz").unlink()
    if meta["best_round"] == meta["rounds_done"] - 1:
        assert lease.restore(tmp_path) == [run]
        restored = lease.read_npz(run / "best.ckpt.npz")[1]
        assert restored == {"round": meta["best_round"], "val": meta["best_val"]}
    # a checkpoint whose best round is earlier cannot stand in for the best state: nothing is made up
    state, ckpt_meta = lease.read_npz(run / "checkpoint.npz")
    assert ckpt_meta is not None
    ckpt_meta["best_round"] = ckpt_meta["rounds_done"] - 2
    for name in ("best.ckpt.npz", "best.npz"):
        (run / name).unlink(missing_ok=True)
    np.savez(run / "checkpoint.npz", **state,
             **{lease.META: np.frombuffer(json.dumps(ckpt_meta).encode(), dtype=np.uint8)})
    assert lease.restore(tmp_path) == []
    assert not (run / "best.ckpt.npz").exists()
