"""BTFL's global DLE on the coordinator (BTFL Sec. 4.1: the server averages the local DLEs): the weighted
average of every client's latest uploaded DLE and, when a BTFL bundle is served, its K training clients' DLE
counted as K clients.

A client's claimed sample count is recorded but is no weight. Weights bound what uploads can do (a source is
where clients come from: one enrollment token, or one join address in open mode; a client without one is its
own source). While a BTFL bundle with K training clients is served:

- one source's clients together weigh at most ``cap = source_share * K`` (FL_SERVE_DLE_SOURCE_SHARE, 0.02): a
  source with n clients gives each min(1, cap / n) (at most FL_SERVE_DLE_PER_SOURCE clients of it are in);
- all uploaded DLEs together weigh at most ``uploads_share * K`` (FL_SERVE_DLE_UPLOADS_SHARE, 0.02): when the
  sources' weights add up to more, every one is scaled down by the same factor, so they split that share.

So however many tokens or addresses an attacker holds, the uploads move a row of the global DLE by at most
``2 * u / (1 + u)`` of the row (L1, u = uploads_share; 3.9% at 0.02), the bound one source had before: new
clients cannot outweigh the training federation, however many there are. Without a served bundle every client
weighs 1 (there is no federation's DLE to protect).

The aggregate is kept as running sums, one per [D, levels] shape: sum_i w_i f_i, sum_i w_i and the number of
clients, with the per-source weights (the common scale of the uploads' share is applied when they are read).
An upload replaces its source's terms (the source's rows, at most FL_SERVE_DLE_PER_SOURCE, are read back: a new
client re-weighs its source's others); a view reads the sums and the caller's own row. The sums are rebuilt from
the store at start and when the served bundle's K changes.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from fl_server.service.store import Store

Shape = tuple[int, int]
Base = tuple[str, np.ndarray, int]  # (bundle id, training clients' average DLE [D, L], how many clients)


class ShapeMismatch(ValueError):
    """An upload's [D, levels] differs from the shape the aggregate is fixed to."""


class SourceFull(PermissionError):
    """An upload from a client whose source (enrollment or join address) has its quota of DLEs already."""


@dataclass
class _Sums:
    total: np.ndarray  # sum_i w_i f_i, float64 [D, L]
    weight: float  # sum_i w_i
    clients: int


@dataclass(frozen=True)
class DLEView:
    clients: int  # clients whose latest DLE is in the aggregate
    global_dle: np.ndarray
    others_dle: np.ndarray | None  # the aggregate without the caller's own DLE (None: nobody else)


class DLEAggregate:
    def __init__(self, store: Store, source_share: float = 0.02, uploads_share: float = 0.02) -> None:
        self._store = store
        self._share, self._uploads_share = source_share, uploads_share
        self._lock = threading.Lock()
        self._cap: float | None = None  # a source's weight at most (None: no bundle, every client weighs 1)
        self._uploads_cap = math.inf  # all uploads' weight together at most
        self._sums: dict[Shape, _Sums] = {}
        self._newest: Shape | None = None  # shape of the newest upload: fixes the view while no bundle does
        self._rebuild(None)

    def _rebuild(self, cap: float | None) -> None:
        self._cap, self._sums = cap, {}
        groups: dict[str, list[np.ndarray]] = {}
        for row in self._store.dles():  # ordered by upload time
            freqs = np.asarray(row["freqs"], dtype=np.float64)
            groups.setdefault(_key(row["source"], row["client_id"]), []).append(freqs)
            self._newest = (freqs.shape[0], freqs.shape[1])
        for rows in groups.values():
            self._apply(rows, +1)

    def _weigh(self, base: Base | None) -> None:
        """Fix the per-source cap to ``base``'s (rebuilding the sums when it changed)."""
        cap = None if base is None else self._share * base[2]
        self._uploads_cap = math.inf if base is None else self._uploads_share * base[2]
        if cap != self._cap:
            self._rebuild(cap)

    def _scale(self, weight: float) -> float:
        """The factor every upload's weight is scaled by when their sum ``weight`` is over the uploads' cap."""
        return min(1.0, self._uploads_cap / weight) if weight > 0 else 1.0

    def _client_weight(self, n: int) -> float:
        """The weight of each client of a source with ``n`` clients in the aggregate."""
        return 1.0 if self._cap is None else min(1.0, self._cap / n)

    def _apply(self, rows: list[np.ndarray], sign: int) -> None:
        """Add (sign +1) or remove (-1) one source's terms: its rows, grouped by shape."""
        by_shape: dict[Shape, list[np.ndarray]] = {}
        for f in rows:
            by_shape.setdefault((f.shape[0], f.shape[1]), []).append(f)
        for shape, group in by_shape.items():
            w = self._client_weight(len(group))
            sums = self._sums.setdefault(shape, _Sums(np.zeros(shape), 0.0, 0))
            sums.total += sign * w * np.sum(group, axis=0)
            sums.weight += sign * w * len(group)
            sums.clients += sign * len(group)

    def _source_rows(self, source: str | None, client_id: str) -> dict[str, np.ndarray]:
        """client id -> DLE of every client of the source (``client_id`` alone when it has none)."""
        if source:
            rows = self._store.dles_of_source(source)
        else:
            own = self._store.dle(client_id)
            rows = {} if own is None else {client_id: own["freqs"]}
        return {cid: np.asarray(f, dtype=np.float64) for cid, f in rows.items()}

    def put(self, client_id: str, freqs: list[list[float]], num_samples: int, base: Base | None,
            source: str | None = None, per_source: int = 0) -> None:
        """Replace ``client_id``'s DLE (``num_samples`` is recorded, not a weight). A served BTFL bundle fixes
        the shape; else the other clients' DLEs do (the caller's own previous DLE is replaced, so it does not).
        At most ``per_source`` (> 0) clients of one ``source`` (enrollment or join address) have a DLE, and
        together they weigh at most the cap (module docstring). Raises :class:`ShapeMismatch` or
        :class:`SourceFull`."""
        new = np.asarray(freqs, dtype=np.float64)
        with self._lock:  # check, write and sums together: concurrent first uploads must not mix shapes
            self._weigh(base)
            before = self._source_rows(source, client_id)
            if source and per_source > 0 and len(before.keys() - {client_id}) >= per_source:
                kind = "enrollment" if source.startswith("enr:") else "address"
                raise SourceFull(f"{per_source} clients of this {kind} have a DLE in the aggregate already "
                                 "(FL_SERVE_DLE_PER_SOURCE): one source's weight is bounded")
            own = before.get(client_id)
            if base is not None:
                allowed, whose = {base[1].shape}, "the served BTFL bundle's"
            else:
                own_shape = None if own is None else own.shape
                allowed = {s for s, sums in self._sums.items() if sums.clients - (s == own_shape) > 0}
                whose = "the other clients'"
            if allowed and new.shape not in allowed:
                shape = min(allowed)  # without a bundle there is one (every upload was checked against it)
                raise ShapeMismatch(f"DLE shape {list(new.shape)} differs from {whose} {list(shape)}")
            self._store.put_dle(client_id, freqs, num_samples)
            self._apply(list(before.values()), -1)
            self._apply(list({**before, client_id: new}.values()), +1)
            self._newest = (new.shape[0], new.shape[1])

    def remove(self, client_id: str, source: str | None) -> bool:
        """Take ``client_id``'s DLE out of the aggregate and the store (revocation); False: it has none."""
        with self._lock:
            before = self._source_rows(source, client_id)
            if client_id not in before:
                return False
            self._store.delete_dle(client_id)
            self._apply(list(before.values()), -1)
            self._apply([f for cid, f in before.items() if cid != client_id], +1)
            return True

    def view(self, client_id: str, base: Base | None, source: str | None = None) -> DLEView | None:
        """The aggregate of the current shape (the served bundle's, else the newest upload's); rows of another
        shape (stored before a BTFL bundle of another shape was served) are left out. ``others_dle`` leaves
        the caller's own DLE out (at its weight). None: nothing yet."""
        with self._lock:
            self._weigh(base)
            shape = tuple(base[1].shape) if base is not None else self._newest
            if shape is None:
                return None
            sums = self._sums.get(shape) or _Sums(np.zeros(shape), 0.0, 0)
            scale = self._scale(sums.weight)
            total, weight, clients = sums.total * scale, sums.weight * scale, sums.clients
            mine = self._source_rows(source, client_id)
            own = mine.get(client_id)
            same = sum(f.shape == shape for f in mine.values())
            own_weight = self._client_weight(max(1, same)) * scale
        if base is not None:
            total += base[2] * base[1]
            weight += base[2]
        if weight <= 0:
            return None
        others = _normalized(total, weight)
        if own is not None and own.shape == shape:
            rest = weight - own_weight
            others = _normalized(total - own_weight * own, rest) if rest > 1e-9 else None
        return DLEView(clients, _normalized(total, weight), others)


def _key(source: str | None, client_id: str) -> str:
    return source or f"client:{client_id}"


def _normalized(total: np.ndarray, weight: float) -> np.ndarray:
    """sum_i w_i f_i / sum_i w_i, with the rounding of the running sums (a subtraction can leave -1e-17)
    removed: entries >= 0 and rows summing to 1, as every DLE check on the device requires."""
    dle = np.maximum(total / weight, 0.0)
    return dle / dle.sum(axis=1, keepdims=True)


def view_json(view: DLEView, base: Base | None) -> dict[str, Any]:
    g = view.global_dle
    return {"clients": view.clients, "dims": g.shape[0], "levels": g.shape[1], "global_dle": g.tolist(),
            "others_dle": None if view.others_dle is None else view.others_dle.tolist(),
            "base": None if base is None else {"bundle_id": base[0], "clients": base[2]}}
