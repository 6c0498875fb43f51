"""Strict JSON (RFC 8259) in both directions. Python's :mod:`json` writes and reads ``NaN``, ``Infinity`` and
``-Infinity`` by default; no other parser does, so a manifest holding them cannot be read on a device outside
Python. Everything the coordinator signs or serves is written with :func:`dumps` and the SDK reads manifests,
signatures and replies with :func:`loads`.

An unbounded number is written as ``null`` (:func:`finite`): ``"dp_epsilon": null`` means no privacy budget
(epsilon = infinity, no noise).

    >>> dumps(finite({"dp_epsilon": float("inf"), "lr": 0.1}))
    '{"dp_epsilon": null, "lr": 0.1}'
    >>> loads('{"x": Infinity}')
    Traceback (most recent call last):
    ...
    ValueError: not strict JSON: Infinity is not a JSON value
"""
from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "finite", "loads"]


def _refuse(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"not strict JSON: the number {text[:40]} is out of a float's range")
    return value


def loads(data: str | bytes | bytearray) -> Any:
    """Parse RFC 8259 JSON; ``NaN`` / ``Infinity`` / ``-Infinity``, a number past a float's range (``1e999``) and
    nesting too deep for the parser raise ``ValueError`` (as malformed JSON does)."""
    try:
        return json.loads(data, parse_constant=_refuse, parse_float=_finite)
    except RecursionError:
        raise ValueError("not strict JSON: nested too deeply") from None


def dumps(obj: Any, **kwargs: Any) -> str:
    """Serialise as RFC 8259 JSON: a non-finite float raises ``ValueError`` instead of writing ``Infinity``."""
    return json.dumps(obj, allow_nan=False, **kwargs)


def finite(obj: Any) -> Any:
    """``obj`` with every infinite float replaced by ``None`` (unbounded), in nested dicts, lists and tuples;
    a NaN raises ``ValueError`` (it has no meaning to keep)."""
    if isinstance(obj, float):
        if math.isnan(obj):
            raise ValueError("NaN has no JSON representation")
        return None if math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
