"""The btgfl experiment (BTFL Sec. 5.1, lab.btgfl): its test streams and the harness end to end."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lab import btgfl
from lab.experiments import get_experiment
from lab.runner import raw_path


def test_btgfl_streams_are_what_the_columns_claim(fashion_all) -> None:  # type: ignore[no-untyped-def]
    prot = get_experiment("btgfl").protocols["fashion_mnist"]
    data = btgfl.build_data(fashion_all, prot, 0, btgfl.StreamConfig(max_stream=30))
    p = len(data.x_test) // 2
    seen = np.concatenate(data.fed.train + data.fed.val)
    assert len(data.streams) == 20 and not data.fed.new
    starts = np.cumsum([0] + [len(s["orig_ind"]) for s in data.streams])
    for k, s in enumerate(data.streams):
        own = np.arange(starts[k], starts[k + 1])
        assert set(s["orig_ind"]) == set(own) and np.array_equal(s["shifted_ind"], s["orig_ind"] + p)
        assert not set(s["orig_exd"]) & set(own) and np.array_equal(s["shifted_exd"], s["orig_exd"] + p)
        assert len(s["orig_exd"]) == len(own)
        q = max(1, len(own) // 4)
        kinds = np.bincount(np.isin(s["synthetic"] % p, own) * 2 + (s["synthetic"] >= p), minlength=4)
        assert kinds.tolist() == [q, q, q, q]  # EXD orig / shifted, IND orig / shifted: a quarter each
    assert np.array_equal(data.y_test[:p], data.y_test[p:])
    changed = np.abs(data.x_test[p:] - data.x_test[:p]).reshape(p, -1).max(1) > 0.05
    assert changed.mean() > 0.95  # every shifted copy differs from its original
    assert len(seen) == len(np.unique(seen))  # train / val disjoint; test samples are neither
    assert data.x_test.dtype == np.float32


def test_btgfl_quick_via_harness(data_root: Path, tmp_path: Path) -> None:
    """The CI smoke test: `python -m lab bench btgfl --quick` end to end on real Fashion-MNIST (about a minute)."""
    from lab.cli import main

    results = tmp_path / "results"
    argv = ["bench", "btgfl", "--quick", "--seeds", "1", "--dataset", "fashion_mnist", "--results-dir",
            str(results), "--runs-dir", str(tmp_path / "runs"), "--data-dir", str(data_root), "--no-progress"]
    assert main(argv) == 0
    rows = json.loads((results / "btgfl.json").read_text())
    exp = get_experiment("btgfl")
    assert {(r["method"], r["column"]) for r in rows} == {(m, c) for m in exp.methods for c in (*btgfl.COLUMNS, "avg")}
    val = {(r["method"], r["column"]): r["mean"] for r in rows}
    assert all(0.0 <= v <= 100.0 for v in val.values())
    for m in exp.methods:
        assert val[(m, "avg")] == pytest.approx(np.mean([val[(m, c)] for c in btgfl.COLUMNS]), abs=0.011)
    for c in btgfl.COLUMNS:  # BTFL is sample-by-sample by definition: batch 1 and 32 agree exactly
        assert val[("BTFL (bs=1)", c)] == val[("BTFL (bs=32)", c)]
    # Dir(0.1) clients: the personalised head wins on its own distribution and loses on other clients'
    assert val[("FedAvg+FT", "orig_ind")] > val[("FedAvg+FT", "orig_exd")] + 10
    raw = json.loads(raw_path(results, "btgfl", "fashion_mnist", "BTFL (bs=32)", 0).read_text())
    assert raw_path(results, "btgfl", "fashion_mnist", "BTFL (bs=32)", 0).parent.name == "BTFL_bs32"
    assert raw["rounds"] == exp.protocols["fashion_mnist"].quick().rounds and raw["seed"] == 0
    # rerun: every raw file exists, nothing is retrained (fast) and the table is identical
    assert main(argv) == 0
    assert json.loads((results / "btgfl.json").read_text()) == rows
