"""HTTP byte ranges (RFC 9110 section 14) for artifact downloads: one range per request."""
from __future__ import annotations

import re

# at most 18 digits: int() of a longer string may exceed Python's digit limit (a 500), and no artifact is
# anywhere near 10**18 bytes; a longer number makes the header malformed, which is ignored
_RANGE = re.compile(r"^bytes=([0-9]{0,18})-([0-9]{0,18})$")


class Unsatisfiable(Exception):
    pass


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) inclusive for a single-range ``Range`` header; None means send the whole file (no
    header, a multi-range or a malformed one, which RFC 9110 lets a server ignore). Raises
    :class:`Unsatisfiable` when the range lies outside the file."""
    if not header:
        return None
    m = _RANGE.match(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):  # suffix: the last N bytes
        n = int(m.group(2))
        if n == 0:
            raise Unsatisfiable
        return max(0, size - n), size - 1
    first = int(m.group(1))
    last = int(m.group(2)) if m.group(2) else size - 1
    if first >= size or last < first:
        raise Unsatisfiable
    return first, min(last, size - 1)
