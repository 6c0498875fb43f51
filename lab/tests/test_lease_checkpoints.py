"""lab/research/lease_checkpoints.py: a run folder packed slim for the next GPU lease resumes to exactly the run
that was never cut (a wrong best state would silently change the reported round and test accuracy)."""
from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from fl_server.recipes.presets import builtin_recipe
from fl_server.recipes.run import train

SCRIPT = Path(__file__).resolve().parents[2] / "lab" / "research" / "lease_checkpoints.py"
spec = importlib.util.spec_from_file_location("lease_checkpoints", SCRIPT)
assert spec and spec.loader
lease = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lease)

REL = "upfl-table1/digits/FedTTA/seed0"


def _train(run_dir: Path, rounds: int) -> dict:
    # validated every round: a finished shorter run can then be extended, as a run cut off by its lease is
    recipe = builtin_recipe("digits", "FedTTA", rounds=rounds).replace(eval_every=1)
    return train(recipe, run_dir, seed=0, device="cpu", progress=False, checkpoint_every=1)


def same_state(a: Path, b: Path) -> bool:
    return lease.same_arrays(lease.read_npz(a)[0], lease.read_npz(b)[0])


@pytest.fixture(scope="module")
def curve(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The validation accuracy of every round of the uncut 8-round run: which rounds dip and which improve is
    read from it (it depends on the platform's floating point), not assumed."""
    record = _train(tmp_path_factory.mktemp("curve") / REL, rounds=8)
    return [row["val"] for row in record["curve"]]


def _first_dip(curve: list[float]) -> int:
    """The first round that validates no higher than an earlier one (its run's best state is not its last)."""
    dip = next((r for r in range(1, len(curve)) if curve[r] <= max(curve[:r])), None)
    if dip is None:
        pytest.skip("validation rose in every round of the 8-round run: no cut leaves the best state behind")
    return dip


@pytest.mark.parametrize("case", ["best is the checkpoint", "best is earlier"])
def test_slim_checkpoint_resumes_to_the_uncut_run(tmp_path: Path, curve: list[float], case: str) -> None:
    """Cut when the best round is the checkpoint's, the best state stays behind and restore rebuilds it; cut after
    a round that validates lower than an earlier one, best.ckpt.npz travels and restore puts best.npz back beside
    it. Either way the resumed run ends as the uncut one."""
    slim = case == "best is the checkpoint"
    if slim:
        rise = next((r for r in range(1, len(curve)) if curve[r] > max(curve[:r])), None)
        if rise is None:
            pytest.skip("validation never rose in the 8-round run: no cut keeps the best state at the checkpoint")
        cut = rise + 1
    else:
        cut = _first_dip(curve) + 1
    total = min(cut + 2, len(curve))
    run = tmp_path / "lease1" / REL
    _train(run, rounds=cut)
    archive = tmp_path / "ckpt.tgz"
    names = lease.pack(tmp_path / "lease1", REL, archive)
    meta = json.loads((run / "checkpoint.json").read_text())
    best = int(np.argmax(curve[:cut]))  # the first of equal maxima, as the engine keeps it
    assert meta["rounds_done"] == cut and meta["best_round"] == best and (best == cut - 1) == slim
    assert ("best.ckpt.npz" in names) != slim and "best.npz" not in names and "checkpoint.npz" in names
    with tarfile.open(archive) as tar:
        assert sorted(m.name for m in tar.getmembers()) == sorted(f"{REL}/{n}" for n in names)
        tar.extractall(tmp_path / "lease2", filter="data")
    resumed_dir = tmp_path / "lease2" / REL
    assert lease.restore(tmp_path / "lease2") == [resumed_dir]
    assert same_state(resumed_dir / "best.npz", run / "best.ckpt.npz")
    assert same_state(resumed_dir / "best.ckpt.npz", run / "best.ckpt.npz")

    resumed = _train(resumed_dir, rounds=total)
    uncut = _train(tmp_path / "uncut" / REL, rounds=total)
    for key in ("best_round", "val", "test"):
        assert resumed[key] == uncut[key], key
    assert same_state(resumed_dir / "best.npz", tmp_path / "uncut" / REL / "best.npz")


def test_a_best_npz_without_best_ckpt_travels_unless_it_is_the_checkpoint(tmp_path: Path, curve: list[float]) -> None:
    """Hetero run folders keep best.npz (written at the checkpoint's validation round) and no best.ckpt.npz."""
    dip = _first_dip(curve)
    improves = next((r for r in range(dip + 1, len(curve)) if curve[r] > max(curve[:r])), None)
    if improves is None:
        pytest.skip("no round after the first dip improves on the best within 8 rounds")
    run = tmp_path / REL
    _train(run, rounds=dip + 1)  # the best round is before the checkpoint's
    (run / "best.ckpt.npz").unlink()
    assert "best.npz" in lease.pack(tmp_path, REL, tmp_path / "a.tgz")
    _train(run, rounds=improves + 1)  # the last round improves: the best state is now the checkpoint's
    (run / "best.ckpt.npz").unlink()
    assert "best.npz" not in lease.pack(tmp_path, REL, tmp_path / "b.tgz")


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
             **{lease.META_KEY: np.frombuffer(json.dumps(ckpt_meta).encode(), dtype=np.uint8)})
    assert lease.restore(tmp_path) == []
    assert not (run / "best.ckpt.npz").exists()


def test_keep_joins_a_leases_archives_and_drops_those_of_finished_rows(tmp_path: Path) -> None:
    """A lease's checkpoint archives (one split into parts, as the call splits what exceeds a returned file) land
    joined in the store; once a row's raw result is merged its archive is dropped; an archive that is not one run
    folder's checkpoint is refused."""
    other = "upfl-table1/digits/FedTTA/seed1"
    calls, store, results = tmp_path / "call", tmp_path / "store", tmp_path / "results"
    calls.mkdir()
    for rel, name in ((REL, "ckpt-a.tgz"), (other, "ckpt-b.tgz")):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "checkpoint.npz").write_bytes(np.random.default_rng(0).bytes(50_000))
        with tarfile.open(calls / name, "w:gz") as tar:
            tar.add(tmp_path / rel / "checkpoint.npz", arcname=f"{rel}/checkpoint.npz")
    whole = (calls / "ckpt-b.tgz").read_bytes()
    (calls / "ckpt-b.tgz").unlink()
    (calls / "ckpt-b.tgz.part00").write_bytes(whole[:20_000])
    (calls / "ckpt-b.tgz.part01").write_bytes(whole[20_000:])
    assert lease.keep(calls, store, results) == (["ckpt-a.tgz", "ckpt-b.tgz"], [])
    assert (store / "ckpt-b.tgz").read_bytes() == whole and lease.archive_run(store / "ckpt-b.tgz") == other

    (results / "raw" / REL).parent.mkdir(parents=True)
    (results / "raw" / f"{REL}.json").write_text("{}")
    (results / "other-probe.json").write_text(json.dumps({"not": "rows"}))  # a probe file that is no list of rows
    assert lease.keep(tmp_path / "nothing", store, results) == ([], ["ckpt-a.tgz"])
    assert sorted(p.name for p in store.iterdir()) == ["ckpt-b.tgz"]
    # a probe's run is finished once its row (naming the run) is in a *-probe.json file
    (results / "fedtta-family-gap-probe.json").write_text(json.dumps([{"what": "x", "run": "elsewhere"}]))
    assert lease.keep(tmp_path / "nothing", store, results) == ([], [])
    (results / "fedtta-family-gap-probe.json").write_text(json.dumps([{"what": "x", "run": other}]))
    assert lease.keep(tmp_path / "nothing", store, results) == ([], ["ckpt-b.tgz"])
    (calls / "ckpt-a.tgz").unlink()
    for part in calls.glob("ckpt-b.tgz.part*"):
        part.unlink()

    (store / "ckpt-b.tgz").write_bytes(whole)  # an archive kept from an earlier call
    with tarfile.open(calls / "ckpt-c.tgz", "w:gz") as tar:
        for rel in (REL, other):
            tar.add(tmp_path / rel / "checkpoint.npz", arcname=f"{rel}/checkpoint.npz")
    (calls / "ckpt-d.tgz.part00").write_bytes(whole[:20_000])  # its other part did not come back
    with pytest.raises(ValueError, match="ckpt-c.tgz: not one run folder's checkpoint archive"):
        lease.keep(calls, store, results)
    (calls / "ckpt-c.tgz").unlink()
    with pytest.raises(ValueError, match="ckpt-d.tgz: not a readable checkpoint archive"):
        lease.keep(calls, store, results)
    assert [p.name for p in store.iterdir()] == ["ckpt-b.tgz"]  # a refused call leaves the store as it was
