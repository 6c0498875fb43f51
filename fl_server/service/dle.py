"""BTFL's global DLE on the coordinator (BTFL Sec. 4.1: the server averages the local DLEs): the per-client
average of every client's latest uploaded DLE and, when a BTFL bundle is served, its K training clients' DLE
counted as K clients.

Every client weighs the same, as in the paper, the authors' code and ``btgfl``: a client's claimed sample count
is recorded but is no weight, so no single upload can outweigh the others.

The aggregate is kept as running sums, one per [D, levels] shape: sum_i f_i and the number of clients. An
upload subtracts the client's previous DLE and adds the new one; a view reads the sums and the caller's own
row. Both cost O(D * levels) whatever the number of clients (each request used to decode every client's row
from the store under the lock). The sums are rebuilt from the store once, at start.
"""
from __future__ import annotations

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
    total: np.ndarray  # sum_i f_i, float64 [D, L]
    clients: int


@dataclass(frozen=True)
class DLEView:
    clients: int  # clients whose latest DLE is in the aggregate
    global_dle: np.ndarray
    others_dle: np.ndarray | None  # the aggregate without the caller's own DLE (None: nobody else)


class DLEAggregate:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._sums: dict[Shape, _Sums] = {}
        self._newest: Shape | None = None  # shape of the newest upload: fixes the view while no bundle does
        for row in store.dles():  # ordered by upload time
            self._add(np.asarray(row["freqs"], dtype=np.float64), +1)

    def _add(self, freqs: np.ndarray, sign: int) -> None:
        shape: Shape = (freqs.shape[0], freqs.shape[1])
        sums = self._sums.setdefault(shape, _Sums(np.zeros(shape), 0))
        sums.total += sign * freqs
        sums.clients += sign
        if sign > 0:
            self._newest = shape

    def _own(self, client_id: str) -> np.ndarray | None:
        row = self._store.dle(client_id)
        return None if row is None else np.asarray(row["freqs"], dtype=np.float64)

    def put(self, client_id: str, freqs: list[list[float]], num_samples: int, base: Base | None,
            source: str | None = None, per_source: int = 0) -> None:
        """Replace ``client_id``'s DLE (``num_samples`` is recorded, not a weight). A served BTFL bundle fixes
        the shape; else the other clients' DLEs do (the caller's own previous DLE is replaced, so it does not).
        At most ``per_source`` (> 0) clients of one ``source`` (enrollment or join address) have a DLE: one
        source's weight in the average is bounded, however many clients it mints. Raises
        :class:`ShapeMismatch` or :class:`SourceFull`."""
        new = np.asarray(freqs, dtype=np.float64)
        with self._lock:  # check, write and sums together: concurrent first uploads must not mix shapes
            if source and per_source > 0 and self._store.dle_clients_of(source, client_id) >= per_source:
                kind = "enrollment" if source.startswith("enr:") else "address"
                raise SourceFull(f"{per_source} clients of this {kind} have a DLE in the aggregate already "
                                 "(FL_SERVE_DLE_PER_SOURCE): one source's weight is bounded")
            own = self._own(client_id)
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
            if own is not None:
                self._add(own, -1)
            self._add(new, +1)

    def view(self, client_id: str, base: Base | None) -> DLEView | None:
        """The aggregate of the current shape (the served bundle's, else the newest upload's); rows of another
        shape (stored before a BTFL bundle of another shape was served) are left out. None: nothing yet."""
        with self._lock:
            shape = tuple(base[1].shape) if base is not None else self._newest
            if shape is None:
                return None
            sums = self._sums.get(shape) or _Sums(np.zeros(shape), 0)
            total, clients = sums.total.copy(), sums.clients
            own = self._own(client_id)
        count = clients
        if base is not None:
            total += base[2] * base[1]
            count += base[2]
        if count == 0:
            return None
        others = _normalized(total, count)
        if own is not None and own.shape == shape:
            others = _normalized(total - own, count - 1) if count > 1 else None
        return DLEView(clients, _normalized(total, count), others)


def _normalized(total: np.ndarray, count: int) -> np.ndarray:
    """sum_i f_i / count, with the rounding of the running sums (a subtraction can leave -1e-17) removed:
    entries >= 0 and rows summing to 1, as every DLE check on the device requires."""
    dle = np.maximum(total / count, 0.0)
    return dle / dle.sum(axis=1, keepdims=True)


def view_json(view: DLEView, base: Base | None) -> dict[str, Any]:
    g = view.global_dle
    return {"clients": view.clients, "dims": g.shape[0], "levels": g.shape[1], "global_dle": g.tolist(),
            "others_dle": None if view.others_dle is None else view.others_dle.tolist(),
            "base": None if base is None else {"bundle_id": base[0], "clients": base[2]}}
