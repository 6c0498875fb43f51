"""The coordinator's running DLE sums (fl_server/service/dle.py) against a direct re-computation with
edge_sdk._btfl.average_dles over every client's latest row (one weight per client; a served bundle's DLE weighs
as many as its training clients), on a real SQLite store, through uploads, replacements, a shape change and a
restart."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_sdk import _btfl as btfl
from fl_server.service.dle import DLEAggregate, ShapeMismatch
from fl_server.service.store import Store


def _direct(latest: dict[str, tuple[np.ndarray, int]], exclude: str | None, base: tuple | None) -> np.ndarray | None:
    rows = [(f, 1) for cid, (f, _) in latest.items() if cid != exclude]  # the claimed sample count is no weight
    if base is not None:
        rows.insert(0, (base[1], base[2]))
    return btfl.average_dles([f for f, _ in rows], [n for _, n in rows]) if rows else None


def _random_dle(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return btfl.fit_dle(rng.exponential(rng.uniform(0.2, 3.0), size=(int(rng.integers(5, 80)), shape[0])),
                        levels=shape[1])


@pytest.mark.parametrize("with_base", [False, True])
def test_running_sums_equal_a_direct_average(tmp_path: Path, with_base: bool) -> None:
    rng = np.random.default_rng(0)
    shape = (6, 3)
    base = ("bundle", _random_dle(rng, shape), 12) if with_base else None
    store = Store(tmp_path / "db.sqlite3")
    agg = DLEAggregate(store)
    assert agg.view("nobody", None) is None
    latest: dict[str, tuple[np.ndarray, int]] = {}
    clients = [f"c{i}" for i in range(40)]
    for step in range(300):  # uploads and replacements (the same client uploading again)
        cid = clients[int(rng.integers(len(clients)))]
        freqs, n = _random_dle(rng, shape), int(rng.integers(1, 10**6))
        agg.put(cid, freqs.tolist(), n, base)
        latest[cid] = (np.asarray(freqs.tolist()), n)
        if step % 50 == 49:
            asker = clients[int(rng.integers(len(clients)))]
            view = agg.view(asker, base)
            assert view is not None and view.clients == len(latest)
            np.testing.assert_allclose(view.global_dle, _direct(latest, None, base), atol=1e-12)
            others = _direct(latest, asker, base)
            if others is None:
                assert view.others_dle is None
            else:
                np.testing.assert_allclose(view.others_dle, others, atol=1e-12)
    before = agg.view("c0", base)
    store.close()
    restarted = DLEAggregate(Store(tmp_path / "db.sqlite3"))  # rebuilt from the rows
    after = restarted.view("c0", base)
    assert before is not None and after is not None and after.clients == before.clients
    np.testing.assert_allclose(after.global_dle, before.global_dle, atol=1e-12)
    np.testing.assert_allclose(after.others_dle, before.others_dle, atol=1e-12)


def test_shape_rules(tmp_path: Path) -> None:
    agg = DLEAggregate(Store(tmp_path / "db.sqlite3"))
    half = [[0.5, 0.5]]
    agg.put("a", half, 1, None)
    agg.put("a", [[0.5, 0.5]] * 4, 3, None)  # alone: a client may change its own shape
    view = agg.view("a", None)
    assert view is not None and view.clients == 1 and view.global_dle.shape == (4, 2) and view.others_dle is None
    with pytest.raises(ShapeMismatch, match=r"^DLE shape \[1, 2\] differs from the other clients' \[4, 2\]$"):
        agg.put("b", half, 1, None)
    base = ("bundle", np.full((3, 2), 0.5), 10)
    with pytest.raises(ShapeMismatch, match=r"differs from the served BTFL bundle's \[3, 2\]$"):
        agg.put("b", [[0.5, 0.5]] * 4, 1, base)
    served = agg.view("a", base)  # a's [4, 2] row is left out once a [3, 2] bundle is served
    assert served is not None and served.clients == 0
    np.testing.assert_allclose(served.global_dle, base[1])
    np.testing.assert_allclose(served.others_dle, base[1])
