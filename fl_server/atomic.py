"""The coordinator's one way to write a file atomically (a temporary sibling, then one rename over the target: a
reader sees the old file or the new one, never a part). The SDK's helpers (``edge_sdk.shared``), plus JSON and
numpy ``.npz``; no other module of fl_server renames files (tests/test_import_graph.py checks it)."""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from edge_sdk.shared import atomic_link, atomic_path, atomic_write_bytes, atomic_write_text, move

__all__ = ["atomic_link", "atomic_path", "atomic_write_bytes", "atomic_write_json", "atomic_write_npz",
           "atomic_write_text", "move"]


def atomic_write_json(path: str | os.PathLike, obj: Any, **dumps: Any) -> None:
    """``path`` holds ``json.dumps(obj, **dumps)``, replaced atomically."""
    atomic_write_text(path, json.dumps(obj, **dumps))


def atomic_write_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """``path`` holds ``np.savez(**arrays)`` (uncompressed), replaced atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
