"""What a fault-injection or bad-input test injected and what happened, appended as one JSON line to
``$FL_RELIABILITY_LOG`` when it is set (``scripts/reliability_report.py`` sets it and renders the lines).
Tests call :func:`record` after their assertions, so a line means the case passed."""
from __future__ import annotations

import json
import os
from typing import Any


def record(category: str, case: str, outcome: str, injected: int = 1, **extra: Any) -> None:
    path = os.environ.get("FL_RELIABILITY_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]  # "nodeid (call)"
    row = {"category": category, "case": case, "outcome": outcome, "injected": injected, "test": test, **extra}
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
