"""The coordinator's running DLE sums (fl_server/service/dle.py) against a direct re-computation with
edge_sdk._btfl.average_dles over every client's latest row (a served bundle's DLE weighs as many as its training
clients; one source's clients together at most FL_SERVE_DLE_SOURCE_SHARE of that, all uploads together at most
FL_SERVE_DLE_UPLOADS_SHARE of it), on a real SQLite store,
through uploads, replacements, removals, a shape change and a restart."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_sdk import _btfl as btfl
from fl_server.service.dle import DLEAggregate, ShapeMismatch
from fl_server.service.store import Store


def _direct(latest: dict[str, tuple[np.ndarray, int]], exclude: str | None, base: tuple | None,
            share: float = 0.02, uploads: float = 0.02) -> np.ndarray | None:
    """Clients without a source: each its own, weighing min(1, share * K) with a bundle of K clients, else 1;
    with a bundle all of them together at most uploads * K (scaled down alike)."""
    w = 1.0 if base is None else min(1.0, share * base[2])
    if base is not None and latest:
        w *= min(1.0, uploads * base[2] / (w * len(latest)))
    rows = [(f, w) for cid, (f, _) in latest.items() if cid != exclude]  # the claimed sample count is no weight
    if base is not None:
        rows.insert(0, (base[1], base[2]))
    return _weighted([f for f, _ in rows], [n for _, n in rows]) if rows else None


def _weighted(dles: list[np.ndarray], weights: list[float]) -> np.ndarray:
    total = sum(w * f for f, w in zip(dles, weights))
    return total / total.sum(axis=1, keepdims=True)


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


def test_one_source_weighs_at_most_its_share_and_a_revoked_client_leaves(tmp_path: Path) -> None:
    """Four clients of one source split its cap (share * K); a client of another source keeps its own; the
    aggregate equals the direct weighted average, a poisoned source moves no row by more than 2*share/(1+share)
    (L1), and removing a client re-weighs its source's others."""
    rng = np.random.default_rng(1)
    shape, share = (5, 4), 0.05
    base = ("bundle", _random_dle(rng, shape), 10)
    store = Store(tmp_path / "db.sqlite3")
    agg = DLEAggregate(store, source_share=share, uploads_share=2 * share)  # the two sources fit the uploads' cap
    sybils = [store.add_client("BTFL", "b", source="enr:sybil")[0] for _ in range(4)]
    honest = store.add_client("BTFL", "b", source="enr:honest")[0]
    poison = np.zeros(shape)
    poison[:, 0] = 1.0  # every row's mass on one level
    for cid in sybils:
        agg.put(cid, poison.tolist(), 10**6, base, "enr:sybil", per_source=16)
    view = agg.view(sybils[0], base, "enr:sybil")
    assert view is not None and view.clients == 4
    cap = share * base[2]  # 0.5: each sybil weighs 0.125
    np.testing.assert_allclose(view.global_dle, _weighted([base[1], poison], [10, cap]), atol=1e-12)
    np.testing.assert_allclose(view.others_dle, _weighted([base[1], poison], [10, cap - cap / 4]), atol=1e-12)
    moved = np.abs(view.global_dle - base[1]).sum(axis=1).max()
    assert 0.01 < moved <= 2 * share / (1 + share) + 1e-12
    mine = _random_dle(rng, shape)
    agg.put(honest, mine.tolist(), 3, base, "enr:honest", per_source=16)
    view = agg.view(honest, base, "enr:honest")
    np.testing.assert_allclose(view.global_dle, _weighted([base[1], poison, mine], [10, cap, cap]), atol=1e-12)
    np.testing.assert_allclose(view.others_dle, _weighted([base[1], poison], [10, cap]), atol=1e-12)
    assert agg.remove(sybils[0], "enr:sybil") and not agg.remove(sybils[0], "enr:sybil")
    for cid in sybils[1:]:
        assert agg.remove(cid, "enr:sybil")
    view = agg.view(honest, base, "enr:honest")
    assert view.clients == 1 and store.dle(sybils[1]) is None
    np.testing.assert_allclose(view.global_dle, _weighted([base[1], mine], [10, cap]), atol=1e-12)
    restarted = DLEAggregate(Store(tmp_path / "db.sqlite3"), source_share=share,
                             uploads_share=2 * share).view(honest, base, "enr:honest")
    np.testing.assert_allclose(restarted.global_dle, view.global_dle, atol=1e-12)


def test_many_sources_together_weigh_at_most_the_uploads_share(tmp_path: Path) -> None:
    """Sybil: ten sources (tokens or addresses) each uploading a poisoned DLE split FL_SERVE_DLE_UPLOADS_SHARE
    instead of adding up their per-source caps, so together they move no row by more than one source could,
    2*u/(1+u) (L1); an honest source that joins them takes its part of that share and still moves the aggregate."""
    rng = np.random.default_rng(2)
    shape, share = (5, 4), 0.02
    base = ("bundle", _random_dle(rng, shape), 10)
    store = Store(tmp_path / "db.sqlite3")
    agg = DLEAggregate(store, source_share=share, uploads_share=share)
    poison = np.zeros(shape)
    poison[:, 0] = 1.0
    sybils = [(store.add_client("BTFL", "b", source=f"enr:sybil{i}")[0], f"enr:sybil{i}") for i in range(10)]
    for cid, source in sybils:
        agg.put(cid, poison.tolist(), 10**6, base, source, per_source=16)
    view = agg.view(sybils[0][0], base, sybils[0][1])
    assert view is not None and view.clients == 10
    cap = share * base[2]  # 0.2: each of the ten weighs 0.02 (it was 0.2 each, 2.0 together)
    np.testing.assert_allclose(view.global_dle, _weighted([base[1], poison], [10, cap]), atol=1e-12)
    np.testing.assert_allclose(view.others_dle, _weighted([base[1], poison], [10, cap * 9 / 10]), atol=1e-12)
    moved = np.abs(view.global_dle - base[1]).sum(axis=1).max()
    assert 0.001 < moved <= 2 * share / (1 + share) + 1e-12
    honest = store.add_client("BTFL", "b", source="enr:honest")[0]
    mine = np.full(shape, 0.25)
    agg.put(honest, mine.tolist(), 3, base, "enr:honest", per_source=16)
    after = agg.view(honest, base, "enr:honest")
    np.testing.assert_allclose(after.global_dle, _weighted([base[1], poison, mine], [10, cap * 10 / 11, cap / 11]),
                               atol=1e-12)
    assert np.abs(after.global_dle - view.global_dle).max() > 1e-4  # the honest upload still counts
