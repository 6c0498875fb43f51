"""The map-incomplete experiment (lab.map_incomplete) end to end at CI size."""
from __future__ import annotations

from lab.experiments import get_experiment
from lab.runner import run_experiment


def test_map_incomplete_quick_experiment(tmp_path, data_root) -> None:  # type: ignore[no-untyped-def]
    exp = get_experiment("map-incomplete")
    rows = run_experiment(exp, ["fashion_mnist"], ["FedAvg", "MAP"], 1, tmp_path / "results", tmp_path / "runs",
                          quick=True, progress=False, data_root=str(data_root))
    got = {(r["method"], r["split"]): r for r in rows}
    assert set(got) == {(m, s) for m in ("FedAvg", "MAP") for s in ("personalization", "aggregation")}
    assert got[("MAP", "personalization")]["paper"] == 92.1
    assert all(10.0 < r["mean"] <= 100.0 for r in rows)
