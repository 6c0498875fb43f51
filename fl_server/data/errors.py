"""Exceptions raised by the data layer (:mod:`fl_server.data`).

Both exceptions carry a single-line, user-facing message: *which* file or
dataset is affected, *what* is wrong, and *how* to get the data.
"""

from __future__ import annotations

import os

__all__ = ["DataFileError", "FetchError", "DEFAULT_FETCH_HINT"]

#: Generic hint used when no dataset-specific hint is available.
DEFAULT_FETCH_HINT = (
    "to get the data run `fl-server data fetch mnist --dir DIR` "
    "(or `fl-server data fetch fashion_mnist --dir DIR`) and pass DIR as the data "
    "root or set FL_DATA_DIR=DIR"
)


class DataFileError(ValueError):
    """A dataset file is missing, truncated, corrupt or has unexpected content.

    Attributes:
        path: the offending file (or directory) as given.
        problem: short description of what is wrong.
        hint: how to obtain a correct copy of the data.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str, hint: str | None = None) -> None:
        self.path = os.fspath(path)
        self.problem = " ".join(str(problem).split())  # keep the message on one line
        self.hint = hint if hint is not None else DEFAULT_FETCH_HINT
        super().__init__(f"{self.path}: {self.problem}; {self.hint}")


class FetchError(RuntimeError):
    """Every way of obtaining a dataset failed (message lists what was tried)."""
